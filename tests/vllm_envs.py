"""Real vLLM installs for the CPU tests that import patched vLLM modules.

`.ci/run` creates one venv per release of `dsa_installer.manifest.VENV_RELEASES` under ~/.cache/dsa-overlay/venvs/vllm-<version>
(`pip install vllm==<version>`, marked complete by a `.dsa-complete` file) before the tests run;
`DSA_OVERLAY_VLLM_VENVS` points elsewhere. Tests never write into those venvs: `patched_site()`
hard-links the venv's `vllm/` package and dist-info into a temporary site-packages and applies the
overlay there with the real engine (which replaces files through new inodes, so the venv's files stay
untouched). Without a venv the tests skip and say which one is missing (a failure under CI=true); a
release listed without a patch set fails.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dsa_installer import cudastub, engine, manifest

VENVS = Path(os.environ.get("DSA_OVERLAY_VLLM_VENVS", Path.home() / ".cache" / "dsa-overlay" / "venvs"))


def venv(version: str) -> Path | None:
    """The complete venv holding vLLM `version`, or None."""
    v = VENVS / f"vllm-{version}"
    return v if (v / ".dsa-complete").exists() and site_packages(v) is not None else None


def site_packages(v: Path) -> Path | None:
    hits = sorted(v.glob("lib/python3*/site-packages"))
    return hits[0] if hits and (hits[0] / "vllm").is_dir() else None


def require(version: str) -> tuple[Path, Path]:
    """(python, site-packages) of the vLLM `version` venv, or skip the test saying what is missing."""
    v = venv(version)
    if v is None:
        pytest.skip(f"no complete vLLM {version} venv at {VENVS / f'vllm-{version}'} (.ci/run creates it)")
    return v / "bin" / "python", site_packages(v)


def patched_site(version: str, dest: Path) -> tuple[Path, Path, dict]:
    """Apply the overlay (the real engine) to a hard-linked copy of the venv's vLLM under `dest`.

    Returns (python, patched site dir to put first on PYTHONPATH, environment for subprocesses)."""
    if version not in manifest.supported_versions():  # fail, not skip: CI lists the release, the set must ship
        pytest.fail(f"vLLM {version} is in manifest.VENV_RELEASES but patches/{version}/ has no patch set yet; "
                    f"merge its patch set (or take it out of VENV_RELEASES)", pytrace=False)
    python, site = require(version)
    dest.mkdir(parents=True, exist_ok=True)
    dist = next(site.glob(f"vllm-{version}.dist-info"))
    subprocess.run(["cp", "-al", str(site / "vllm"), str(dist), str(dest)], check=True)
    engine.apply(dest)
    return python, dest, subprocess_env(dest, site)


def subprocess_env(patched: Path, venv_site: Path) -> dict:
    """PYTHONPATH with the patched tree first; the stub libcuda where no driver exists."""
    env = dict(os.environ, PYTHONPATH=str(patched), HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    stub = cudastub.stub_dir_for(venv_site)
    if stub is not None:
        env["LD_LIBRARY_PATH"] = f"{stub}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    return env

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

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsa_installer import cudastub, engine, fsops, manifest

REPO = Path(__file__).resolve().parents[1]
VENVS = Path(os.environ.get("DSA_OVERLAY_VLLM_VENVS", Path.home() / ".cache" / "dsa-overlay" / "venvs"))


def release(version: str) -> tuple[int, ...]:
    """"0.29.0" -> (0, 29, 0), for comparing releases in tests."""
    return tuple(int(x) for x in version.split("."))


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


_SHARED: dict = {}


def shared_site(version: str, tmp_path_factory) -> tuple[Path, Path, dict]:
    """One patched copy of the release per test session (`patched_site`), for tests that only read it;
    a test that writes or rolls back makes its own with `patched_site`."""
    if version not in _SHARED:
        _SHARED[version] = patched_site(version, tmp_path_factory.mktemp(f"shared-vllm{version}"))
    return _SHARED[version]


_VERIFY: dict = {}


def verify_json(version: str, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """`verify.py --vllm-site-packages SITE --python VENV_PYTHON --json` on the shared patched copy, run once
    per release and session (every module imported, the selection table of every capability, in the release's
    own interpreter); the overlay switches are cleared so the table shows the shipped defaults."""
    if version not in _VERIFY:
        python, site, _ = shared_site(version, tmp_path_factory)
        env = {k: v for k, v in os.environ.items() if k not in ("DSA_OVERLAY_PORTABLE", "DSA_OVERLAY_INDEXER")}
        proc = subprocess.run([sys.executable, str(REPO / "verify.py"), "--vllm-site-packages", str(site),
                               "--python", str(python), "--json"], capture_output=True, text=True, cwd=REPO,
                              env=env, timeout=900)
        _VERIFY[version] = (proc, json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {})
    return _VERIFY[version]


def selection_rows(report: str) -> list[dict]:
    """The rows of verify_hooks' markdown selection table (verify's hooks report)."""
    keys = ("cc", "kv_cache_dtype", "index_topk", "default", "portable", "explicit")
    rows = []
    for line in report.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(keys):
            row = dict(zip(keys, cells))
            row["index_topk"] = int(row["index_topk"])
            rows.append(row)
    return rows


def subprocess_env(patched: Path, venv_site: Path) -> dict:
    """PYTHONPATH with the patched tree first; the stub libcuda where no driver exists."""
    env = dict(os.environ, PYTHONPATH=str(patched), HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    stub = cudastub.stub_dir_for(venv_site)
    if stub is not None:
        env["LD_LIBRARY_PATH"] = f"{stub}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    return env


# --- vllm-gguf-plugin (GGUF on vLLM >= 0.24) ---

PLUGIN = ("vllm-gguf-plugin==0.0.3", "gguf==0.19.0")    # the pins that load beside torch 2.11 (FACTS)
PLUGIN_HOOK = "vllm/plugins/__init__.py"


def install_plugin(target: Path) -> None:
    """vllm-gguf-plugin and gguf into `target` (a site dir) with `pip install --no-deps --target`; wheels
    from the checkout's `.whl/` when it has them, else the index."""
    links = ["--find-links", str(REPO / ".whl")] if (REPO / ".whl").is_dir() else []
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *links,
                    *PLUGIN], check=True, capture_output=True)


@contextmanager
def hook_patch_set(version: str, site: Path, family: str = "0.26"):
    """The engine applies `version`'s shipped set when it carries the plugins hook; until then (the
    0.24-0.26 sets are written on other branches) a local set: that hook plus the overlay drop-ins."""
    if version in manifest.supported_versions() and any(p.target == PLUGIN_HOOK for p in manifest.load(version).patches):
        yield
        return
    real, real_supported = manifest.load, manifest.supported_versions
    hook = manifest.resources.patches_dir() / manifest.FAMILIES / family / "plugins.diff"
    sha = fsops.file_sha256(site / PLUGIN_HOOK)

    def load(v: str) -> manifest.PatchSet:
        if v != version:
            return real(v)
        return manifest.PatchSet(version, hook, (manifest.Patch(hook, PLUGIN_HOOK, sha),),
                                 real(real_supported()[-1]).dropins)

    manifest.load, manifest.supported_versions = load, lambda: [*real_supported(), version]
    try:
        yield
    finally:
        manifest.load, manifest.supported_versions = real, real_supported

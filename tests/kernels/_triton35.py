"""A cached venv with Triton 3.5.1 (the other Triton release the README claims; vLLM 0.16.0 pins it), for
running the cross-compile workers under it.

~/.cache/dsa-overlay/venvs/triton-3.5.1 (DSA_TRITON35_VENV overrides), made on first use with
`pip install triton==3.5.1 pytest` from the default index, no system site-packages, no torch: cross-compiling
needs none, and tests/kernels/_xcompile.py stands in for the three dtypes the kernel files read at import.
Measured here: 4 s with a warm pip cache (a 170 MB wheel otherwise), 634 MB on disk.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

VERSION = "3.5.1"


def venv_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DSA_TRITON35_VENV")
                        or pathlib.Path.home() / ".cache" / "dsa-overlay" / "venvs" / f"triton-{VERSION}")


def _make(venv: pathlib.Path) -> None:
    tmp = venv.with_name(venv.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, capture_output=True, text=True)
    subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    f"triton=={VERSION}", "pytest"], check=True, capture_output=True, text=True, timeout=1200)
    # compiled mode, as the cross-compile workers run (this test process has TRITON_INTERPRET=1, under which
    # importing triton needs numpy, which this venv does not have)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = subprocess.run([str(tmp / "bin" / "python"), "-c", "import triton; print(triton.__version__)"],
                         check=True, capture_output=True, text=True, env=env).stdout.strip()
    if got != VERSION:
        raise RuntimeError(f"the venv has triton {got}, not {VERSION}")
    (tmp / ".dsa-complete").write_text(f"triton {VERSION}\n")
    shutil.rmtree(venv, ignore_errors=True)
    tmp.rename(venv)


def python() -> str:
    """The venv's python, making the venv first if needed (one process at a time: a file lock). When it
    cannot be made (no network, no pip), the test skips with the reason, or fails where CI is set."""
    venv = venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".triton-{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".dsa-complete").exists():
            try:
                _make(venv)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", None) or str(e)
                msg = f"cannot make the Triton {VERSION} venv at {venv}: {str(detail).strip()[-500:]}"
                if os.environ.get("CI"):
                    pytest.fail(msg)
                pytest.skip(msg)
    return str(venv / "bin" / "python")

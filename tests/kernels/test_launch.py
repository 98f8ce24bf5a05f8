"""overlay/kernels/launch.py: the kill switch here; the direct-versus-JIT checks (tests/kernels/launch_checks.py)
in a fresh pytest process without TRITON_INTERPRET (this process's kernel tests interpret), on the CPU with a
stand-in Triton driver. The same comparison on CUDA, bit for bit: tests/kernels/gpu_checks.py."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _launch_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_dsa_launch_plain", ROOT / "overlay" / "kernels" / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kill_switch_values():
    L = _launch_module()
    for v in ("", "1", "true", "ON", " yes "):
        assert L.direct_launch_enabled({L.DIRECT_LAUNCH_ENV: v})
    assert L.direct_launch_enabled({})
    for v in ("0", "false", "Off", "no"):
        assert not L.direct_launch_enabled({L.DIRECT_LAUNCH_ENV: v})
    with pytest.raises(ValueError, match="DSA_OVERLAY_DIRECT_LAUNCH='maybe' is not understood"):
        L.direct_launch_enabled({L.DIRECT_LAUNCH_ENV: "maybe"})


def test_direct_launch_against_the_jit_entry_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                           f"--basetemp={tmp_path}", str(HERE / "launch_checks.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "skipped" not in out and "deselected" not in out, out[-3000:]

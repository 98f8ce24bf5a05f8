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


def test_pdl_is_opt_in_and_only_from_sm90_compiled(monkeypatch):
    """DSA_OVERLAY_PDL: off unless set to 1 (true/on/yes); on only for sm_90 and later (sm_80-89 have no PDL) and
    never interpreted; a value it does not know is an error naming it. pdl_kwargs: the kernels' PDL constexpr and
    Triton's launch_pdl option together, or nothing."""
    L = _launch_module()
    monkeypatch.setattr(L, "_interpreted", lambda: False)
    on = {L.PDL_ENV: "1"}
    for cap in ((9, 0), (10, 0), (12, 0), (12, 1)):
        assert L.pdl_launch(cap, on) and L.pdl_launch(cap, {L.PDL_ENV: " Yes "})
        assert L.pdl_kwargs(cap, on) == {"PDL": True, "launch_pdl": True}
    for cap in ((8, 0), (8, 6), (8, 9), None):
        assert not L.pdl_launch(cap, on) and L.pdl_kwargs(cap, on) == {}
    for env in ({}, {L.PDL_ENV: ""}, {L.PDL_ENV: "0"}, {L.PDL_ENV: "off"}):
        assert not L.pdl_launch((9, 0), env) and L.pdl_kwargs((9, 0), env) == {}
    with pytest.raises(ValueError, match="DSA_OVERLAY_PDL='2' is not understood"):
        L.pdl_launch((9, 0), {L.PDL_ENV: "2"})
    monkeypatch.setattr(L, "_interpreted", lambda: True)
    assert not L.pdl_launch((9, 0), on)


def test_direct_launch_against_the_jit_entry_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                           f"--basetemp={tmp_path}", str(HERE / "launch_checks.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "skipped" not in out and "deselected" not in out, out[-3000:]


def test_plan_key_parts_and_the_strides_of_a_copy():
    """tensor_key tells tensors apart by shape, strides, dtype and device; contiguous_strides gives what
    ``.contiguous()`` returns without the copy (odd strides of size-1 dimensions included); off_device names the
    first tensor on another device."""
    import torch

    L = _launch_module()
    t = torch.randn(3, 4, 5)
    views = (t.transpose(1, 2), t[:, :, ::2], t[:, :1], t[:1, :, :1], torch.randn(6, 1, 8)[:, :, ::4],
             t.as_strided((1, 1), (7, 3)), torch.randn(0, 4, 3).transpose(1, 2), t)
    for v in views:
        assert L.contiguous_strides(v) == v.contiguous().stride(), v.stride()
    keys = [L.tensor_key(x) for x in (t, t.transpose(1, 2), t.reshape(3, 20), t.double(), t.to("meta"))]
    assert len(set(keys)) == len(keys) and L.tensor_key(None) is None
    assert L.tensor_key(t) == L.tensor_key(t.clone())
    assert L.off_device(t.device, a=t, b=None, c=t[:1]) is None
    assert L.off_device(t.device, a=t, b=t.to("meta"), c=t.to("meta")) == "b is on meta, not cpu"

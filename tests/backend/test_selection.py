"""The sparse-MLA selection policy (overlay/selection.py), without vLLM, against a table written by hand
from README's policy ("Sparse attention on every GPU"), and how the hook reads `index_topk`."""

import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from dsa_installer import manifest
from overlay import selection as sel
from tests import vllm_envs

REPO = Path(__file__).resolve().parents[2]

# What the hook hands the policy for a GLM-5 sparse config (head 576, bf16): vLLM 0.23.0's MLA candidates'
# own answers plus FlashMLA's undeclared index_topk limit, written out. The dense MLA backends refuse
# sparse; FLASHMLA_SPARSE declares majors 9 and 10 and the kv-cache dtypes auto, bfloat16, fp8_ds_mla.
NOT_SPARSE = ["sparse not supported"]
TOPK_REASONS = {None: [], 2048: [], 256: [], 200: ["index_topk 200 is not a multiple of 128"]}


def upstream(cc, kv, topk):
    flashmla_sparse = [] if cc[0] in (9, 10) else ["compute capability not supported"]
    if kv not in ("auto", "bfloat16", "fp8_ds_mla"):
        flashmla_sparse = flashmla_sparse + ["kv_cache_dtype not supported"]
    return {
        "FLASH_ATTN_MLA": ["head_size not supported", *NOT_SPARSE],
        "FLASHMLA": NOT_SPARSE,
        "FLASHINFER_MLA": NOT_SPARSE,
        "TRITON_MLA": NOT_SPARSE,
        "FLASHMLA_SPARSE": flashmla_sparse + TOPK_REASONS[topk],
    }


# README: TRITON_MLA_SPARSE is picked whenever no upstream sparse backend accepts the configuration and when
# FlashMLA cannot run the model (index_topk not a multiple of 128); it needs cc >= 8.0 and reads auto /
# bfloat16 / fp8_ds_mla caches; DSA_OVERLAY_PORTABLE=1 makes Hopper/Blackwell datacenter behave like the rest.
# Each cell: as shipped, then with DSA_OVERLAY_PORTABLE=1.
#   T = TRITON_MLA_SPARSE   U = upstream's FLASHMLA_SPARSE stays   - = neither (upstream's own error stands)
GRID = """
cc    index_topk  auto  bfloat16  fp8_ds_mla  fp8
7.5   2048        --    --        --          --
7.5   200         --    --        --          --
8.0   2048        TT    TT        TT          --
8.0   200         TT    TT        TT          --
8.6   None        TT    TT        TT          --
8.9   2048        TT    TT        TT          --
9.0   2048        UT    UT        UT          --
9.0   256         UT    UT        UT          --
9.0   None        UT    UT        UT          --
9.0   200         TT    TT        TT          --
10.0  2048        UT    UT        UT          --
10.0  200         TT    TT        TT          --
12.0  2048        TT    TT        TT          --
12.0  200         TT    TT        TT          --
12.1  2048        TT    TT        TT          --
"""


def grid_cases() -> list:
    header, *rows = [line.split() for line in GRID.strip().splitlines()]
    return [pytest.param(tuple(map(int, cc.split("."))), kv, None if topk == "None" else int(topk), portable, symbol,
                         id=f"cc{cc}-{kv}-topk{topk}-{'portable' if portable else 'default'}")
            for cc, topk, *cells in rows
            for kv, cell in zip(header[2:], cells, strict=True)
            for portable, symbol in zip((False, True), cell, strict=True)]


@pytest.mark.parametrize("cc, kv, topk, portable, symbol", grid_cases())
def test_policy_table(cc, kv, topk, portable, symbol):
    d = sel.choose_sparse_backend(cc, True, kv, upstream(cc, kv, topk), portable=portable)
    where = f"cc {cc[0]}.{cc[1]}"
    if symbol == "T":
        assert d.backend == "TRITON_MLA_SPARSE"
        if portable:
            assert d.reason == f"DSA_OVERLAY_PORTABLE=1 is set (portable Triton path on {where})"
        else:  # the log line names the refused upstream sparse backend and why, not the dense ones
            why = ", ".join(upstream(cc, kv, topk)["FLASHMLA_SPARSE"])
            assert d.reason == f"no upstream sparse MLA backend validates on {where} (FLASHMLA_SPARSE: {why})"
    elif symbol == "U":
        assert (d.backend, d.reason) == (None, f"upstream FLASHMLA_SPARSE validates on {where}")
    else:
        assert d.backend is None
        if cc < (8, 0):
            assert d.reason == f"compute capability {cc[0]}.{cc[1]} is below 8.0 (no Triton sparse MLA)"
        else:
            assert d.reason.startswith(f"kv-cache dtype {kv} is not one TRITON_MLA_SPARSE reads")
            assert d.reason.endswith("use --kv-cache-dtype fp8_ds_mla")


def test_explicit_choice_is_left_to_vllm_even_with_switch():
    d = sel.choose_sparse_backend((9, 0), True, "auto", upstream((9, 0), "auto", 2048),
                                  explicit="FLASHMLA_SPARSE", portable=True)
    assert (d.backend, d.reason) == (None, "explicit --attention-backend FLASHMLA_SPARSE")


def test_not_sparse_untouched():
    d = sel.choose_sparse_backend((8, 0), False, "auto", {"FLASH_ATTN_MLA": []}, portable=True)
    assert (d.backend, d.reason) == (None, "model does not use sparse MLA")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "float16"])
def test_unsupported_kv_dtype_explains(kv):
    d = sel.choose_sparse_backend((8, 0), True, kv, upstream((8, 0), kv, 2048))
    assert d.backend is None
    assert d.reason == (f"kv-cache dtype {kv} is not one TRITON_MLA_SPARSE reads (auto, bfloat16, fp8_ds_mla); "
                        "use --kv-cache-dtype fp8_ds_mla")


def test_upstream_extra_reasons():
    assert sel.upstream_extra_reasons("FLASHMLA_SPARSE", 256) == []
    assert sel.upstream_extra_reasons("FLASHMLA_SPARSE", None) == []
    assert sel.upstream_extra_reasons("FLASHMLA_SPARSE", 200) == [
        "index_topk 200 is not a multiple of 128"
    ]
    assert sel.upstream_extra_reasons("TRITON_MLA", 200) == []


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("ON", True), ("0", False),
                                       ("", False), ("no", False)])
def test_portable_switch_values(value, on):
    assert sel.portable_switch({sel.PORTABLE_ENV: value}) is on
    assert sel.portable_switch({}) is False


def test_portable_switch_rejects_garbage():
    with pytest.raises(ValueError, match="DSA_OVERLAY_PORTABLE='maybe'"):
        sel.portable_switch({sel.PORTABLE_ENV: "maybe"})


def test_capability_and_kv_declarations():
    assert sel.supports_capability((8, 0)) and sel.supports_capability((12, 1))
    assert not sel.supports_capability((7, 5))
    assert sel.supports_kv_cache_dtype(None) and sel.supports_kv_cache_dtype("fp8_ds_mla")
    assert not sel.supports_kv_cache_dtype("fp8")


# --- index_topk as the hook reads it (selection._current_index_topk) ---------------------------------


def _vllm_with_config(monkeypatch, config):
    """A stand-in `vllm.config` whose current vLLM config is `config`."""
    vllm, vllm_config = types.ModuleType("vllm"), types.ModuleType("vllm.config")
    vllm_config.get_current_vllm_config_or_none = lambda: config
    vllm.config = vllm_config
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", vllm_config)


def _config(**hf_config):
    return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(**hf_config)))


@pytest.mark.parametrize("config", [None, types.SimpleNamespace(model_config=None), _config(),
                                    _config(index_topk=None)],
                         ids=["no-vllm-config", "no-model-config", "no-index_topk", "index_topk-null"])
def test_index_topk_absent(monkeypatch, config):
    _vllm_with_config(monkeypatch, config)
    assert sel._current_index_topk() is None


@pytest.mark.parametrize("value", [2048, 200, 1])
def test_index_topk_read(monkeypatch, value):
    _vllm_with_config(monkeypatch, _config(index_topk=value))
    assert sel._current_index_topk() == value


@pytest.mark.parametrize("value", ["2048", 2048.0, True, 0, -128, [2048]])
def test_index_topk_malformed_is_an_error(monkeypatch, value):
    _vllm_with_config(monkeypatch, _config(index_topk=value))
    with pytest.raises(ValueError, match=re.escape(f"index_topk={value!r} is not a positive integer; fix")):
        sel._current_index_topk()


@pytest.mark.parametrize("version", manifest.VENV_RELEASES)
def test_index_topk_absent_in_real_vllm(version):
    """The real vLLM: no config in context (as in verify_hooks' table), then a config without a model."""
    python, _ = vllm_envs.require(version)
    code = textwrap.dedent("""
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from overlay import selection
        outside = selection._current_index_topk()
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            print("RESULT", outside, selection._current_index_topk())
    """)
    proc = subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "RESULT None None"

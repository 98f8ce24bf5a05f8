"""The sparse-MLA selection policy (overlay/selection.py), without vLLM, against a table written by hand
from README's policy ("Sparse attention on every GPU"), and how the hook reads `index_topk`."""

import re
import sys
import types
from pathlib import Path

import pytest

from overlay import selection as sel

REPO = Path(__file__).resolve().parents[2]

# What the hook hands the policy for a GLM-5 sparse config (head 576, bf16, 64 heads, qk_nope 192): each
# release's MLA candidates' own answers plus FlashMLA's undeclared index_topk limit, written out by hand from the
# wheels. The dense MLA backends refuse sparse everywhere.
NOT_SPARSE = ["sparse not supported"]
TOPK_REASONS = {None: [], 2048: [], 512: [], 256: [], 200: ["index_topk 200 is not a multiple of 128"]}
DENSE = {"FLASH_ATTN_MLA": ["head_size not supported", *NOT_SPARSE], "FLASHMLA": NOT_SPARSE,
         "FLASHINFER_MLA": NOT_SPARSE, "TRITON_MLA": NOT_SPARSE}


def flashmla_sparse(cc, kv, topk, kv_dtypes=("auto", "bfloat16", "fp8_ds_mla")):
    """FLASHMLA_SPARSE: majors 9 and 10, its kv-cache dtypes, index_topk % 128 == 0 (the overlay's extra)."""
    reasons = [] if cc[0] in (9, 10) else ["compute capability not supported"]
    if kv not in kv_dtypes:
        reasons = reasons + ["kv_cache_dtype not supported"]
    return reasons + TOPK_REASONS[topk]


def upstream_023(cc, kv, topk):
    """vLLM 0.20.0-0.23.0 (as 0.23.0's wheel; its sm_100 FlashInfer sparse candidate left out)."""
    return {**DENSE, "FLASHMLA_SPARSE": flashmla_sparse(cc, kv, topk)}


def upstream_024(release):
    """vLLM 0.24.0 (release "0.24.0") or 0.25.0/0.25.1 ("0.25"), read from the wheels' platforms/cuda.py
    priority lists and each sparse backend's validate_configuration:
    - sm_100: FLASHINFER_MLA_SPARSE (kv auto/float16/bfloat16/fp8/fp8_e4m3, not fp8_ds_mla; qk_nope 128 or 192;
      any index_topk) before FLASHMLA_SPARSE for quantized caches, after it for bf16 at 64 heads;
    - sm_90 (0.25 only): FLASH_ATTN_MLA_SPARSE (FA3; kv auto/float16/bfloat16; any index_topk) before
      FLASHMLA_SPARSE (which also takes "fp8" as an alias of fp8_ds_mla from 0.24);
    - sm_12x: TRITON_MLA (dense) then FLASHINFER_MLA_SPARSE_SM120 (kv auto/fp8/fp8_e4m3/fp8_ds_mla, all stored as
      fp8_ds_mla; index_topk == 2048 when a model config is in context; FlashInfer's sparse MLA API present)."""
    def upstream(cc, kv, topk):
        fmla = flashmla_sparse(cc, kv, topk, ("auto", "bfloat16", "fp8_ds_mla", "fp8"))
        if cc[0] == 12:
            sm120 = [] if kv in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla") else ["kv_cache_dtype not supported"]
            if topk not in (None, 2048):
                sm120 = sm120 + [f"FLASHINFER_MLA_SPARSE_SM120 requires index_topk=2048; got {topk}"]
            return {"TRITON_MLA": NOT_SPARSE, "FLASHINFER_MLA_SPARSE_SM120": sm120}
        if cc[0] == 10:
            fi = [] if kv in ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3") else [
                "FLASHINFER_MLA_SPARSE SM10 does not support fp8_ds_mla kv-cache dtype"]
            pair = ({"FLASHINFER_MLA_SPARSE": fi, "FLASHMLA_SPARSE": fmla} if kv in ("fp8", "fp8_e4m3", "fp8_ds_mla")
                    else {"FLASHMLA_SPARSE": fmla, "FLASHINFER_MLA_SPARSE": fi})
            return {**DENSE, **pair}
        fa = [] if cc[0] == 9 else ["compute capability not supported"]
        if kv not in ("auto", "float16", "bfloat16"):
            fa = fa + ["kv_cache_dtype not supported"]
        return {**DENSE, **({"FLASH_ATTN_MLA_SPARSE": fa} if release == "0.25" else {}), "FLASHMLA_SPARSE": fmla}
    return upstream


# README: TRITON_MLA_SPARSE is picked whenever no upstream sparse backend accepts the configuration and when
# FlashMLA cannot run the model (index_topk not a multiple of 128); it needs cc >= 8.0 and reads auto /
# bfloat16 / fp8_ds_mla caches; DSA_OVERLAY_PORTABLE=1 makes every GPU behave like one without vendor kernels.
# Each cell: as shipped, then with DSA_OVERLAY_PORTABLE=1.
#   T = TRITON_MLA_SPARSE   U = upstream's first accepting sparse backend stays   - = neither (upstream decides)
GRID_023 = """
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

# 0.24.0-0.25.1: SM12x keeps FLASHINFER_MLA_SPARSE_SM120 for the caches it stores as fp8_ds_mla at index_topk 2048
# (and with no model config in context, where it cannot check); a bfloat16 cache or another top-k gets Triton.
# An "fp8" cache Triton cannot read stays with an upstream backend that accepts it (U-).
GRID_024 = """
cc    index_topk  auto  bfloat16  fp8_ds_mla  fp8
7.5   2048        --    --        --          --
8.0   2048        TT    TT        TT          --
8.6   200         TT    TT        TT          --
8.9   2048        TT    TT        TT          --
9.0   2048        UT    UT        UT          U-
9.0   200         TT    TT        TT          --
10.0  2048        UT    UT        UT          U-
10.0  200         UT    UT        TT          U-
12.0  2048        UT    TT        UT          U-
12.0  None        UT    TT        UT          U-
12.0  256         TT    TT        TT          --
12.0  200         TT    TT        TT          --
12.1  2048        UT    TT        UT          U-
12.1  512         TT    TT        TT          --
"""
# 0.25.0/0.25.1 differ from 0.24.0 on sm_90 only: FLASH_ATTN_MLA_SPARSE takes bf16 caches at any top-k.
GRID_025 = GRID_024.replace("9.0   200         TT    TT        TT          --",
                            "9.0   200         UT    UT        TT          --")
assert GRID_025 != GRID_024

MODELS = {"0.20-0.23": (upstream_023, GRID_023), "0.24.0": (upstream_024("0.24.0"), GRID_024),
          "0.25": (upstream_024("0.25"), GRID_025)}


def grid_cases() -> list:
    cases = []
    for release, (_, grid) in MODELS.items():
        header, *rows = [line.split() for line in grid.strip().splitlines()]
        cases += [pytest.param(release, tuple(map(int, cc.split("."))), kv, None if topk == "None" else int(topk),
                               portable, symbol,
                               id=f"{release}-cc{cc}-{kv}-topk{topk}-{'portable' if portable else 'default'}")
                  for cc, topk, *cells in rows
                  for kv, cell in zip(header[2:], cells, strict=True)
                  for portable, symbol in zip((False, True), cell, strict=True)]
    return cases


@pytest.mark.parametrize("release, cc, kv, topk, portable, symbol", grid_cases())
def test_policy_table(release, cc, kv, topk, portable, symbol):
    up = MODELS[release][0](cc, kv, topk)
    limits = {n: TOPK_REASONS[topk] if n == "FLASHMLA_SPARSE" else [] for n in up}
    d = sel.choose_sparse_backend(cc, True, kv, up, portable=portable, limits=limits)
    where = f"cc {cc[0]}.{cc[1]}"
    if symbol == "T":
        assert d.backend == "TRITON_MLA_SPARSE"
        if portable:
            assert d.reason == f"DSA_OVERLAY_PORTABLE=1 is set (portable Triton path on {where})"
        else:  # the log line names the refused upstream sparse backends and why, not the dense ones
            why = "; ".join(f"{n}: {', '.join(r)}" for n, r in up.items() if r != NOT_SPARSE and n not in DENSE)
            assert d.reason == f"no upstream sparse MLA backend validates on {where} ({why})"
    elif symbol == "U":  # the backend that runs is upstream's first that accepts, limits included
        first = next(n for n, r in up.items() if not r)
        vllm_own = next(n for n, r in up.items() if r == limits[n])  # what vLLM alone would pick
        runs = d.backend or vllm_own
        assert runs == first, (d, up)
        if d.backend is None:
            assert d.reason == f"upstream {first} validates on {where}"
    else:
        assert d.backend is None
        if cc < (8, 0):
            assert d.reason == f"compute capability {cc[0]}.{cc[1]} is below 8.0 (no Triton sparse MLA)"
        else:
            assert d.reason.startswith(f"kv-cache dtype {kv} is not one TRITON_MLA_SPARSE reads")
            assert d.reason.endswith("use --kv-cache-dtype fp8_ds_mla")


@pytest.mark.parametrize("release", ["0.24.0", "0.25"])
def test_sm100_bf16_topk_200_names_flashinfer_over_flashmla(release):
    """sm_100, bf16 cache, 64 heads: vLLM's own first pick is FLASHMLA_SPARSE, which validates index_topk 200
    but cannot run it (FlashMLA asserts top-k % 128 == 0); the hook names FLASHINFER_MLA_SPARSE instead of
    leaving the choice to vLLM (seen in verify.py's table on the H200, vLLM 0.26.0)."""
    up = upstream_024(release)((10, 0), "bfloat16", 200)
    assert list(up)[-2:] == ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"] and up["FLASHINFER_MLA_SPARSE"] == []
    d = sel.choose_sparse_backend((10, 0), True, "bfloat16", up,
                                  limits={"FLASHMLA_SPARSE": ["index_topk 200 is not a multiple of 128"]})
    assert (d.backend, d.reason) == ("FLASHINFER_MLA_SPARSE", "upstream's own pick FLASHMLA_SPARSE cannot run "
                                     "this model (index_topk 200 is not a multiple of 128); "
                                     "FLASHINFER_MLA_SPARSE validates on cc 10.0")
    # at top-k 2048 vLLM's own pick runs: left alone
    up = upstream_024(release)((10, 0), "bfloat16", 2048)
    d = sel.choose_sparse_backend((10, 0), True, "bfloat16", up, limits={"FLASHMLA_SPARSE": []})
    assert (d.backend, d.reason) == (None, "upstream FLASHMLA_SPARSE validates on cc 10.0")


def test_explicit_choice_is_left_to_vllm_even_with_switch():
    d = sel.choose_sparse_backend((9, 0), True, "auto", upstream_023((9, 0), "auto", 2048),
                                  explicit="FLASHMLA_SPARSE", portable=True)
    assert (d.backend, d.reason) == (None, "explicit --attention-backend FLASHMLA_SPARSE")


def test_not_sparse_untouched():
    d = sel.choose_sparse_backend((8, 0), False, "auto", {"FLASH_ATTN_MLA": []}, portable=True)
    assert (d.backend, d.reason) == (None, "model does not use sparse MLA")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "float16"])
def test_unsupported_kv_dtype_explains(kv):
    d = sel.choose_sparse_backend((8, 0), True, kv, upstream_023((8, 0), kv, 2048))
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


# In the real vLLM of every VENV_RELEASES venv: tests/backend/test_vllm_patched.py (index_topk outside a model
# config, the selection table of verify.py with its SM12x rows).

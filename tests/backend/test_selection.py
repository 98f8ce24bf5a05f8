"""The sparse-MLA selection policy (overlay/selection.py), without vLLM."""

import pytest

from overlay import selection as sel

NOT_SPARSE = ["sparse not supported"]


def upstream_for(capability, topk=2048):
    """What vLLM 0.23.0's MLA candidates answer for a GLM-5 sparse config (head 576, bf16).

    Mirrors the measured declarations: the dense MLA backends refuse sparse, FLASHMLA_SPARSE
    accepts only majors 9 and 10 (and its kernel needs index_topk % 128 == 0)."""
    flashmla_sparse = [] if capability[0] in (9, 10) else ["compute capability not supported"]
    flashmla_sparse = flashmla_sparse + sel.upstream_extra_reasons("FLASHMLA_SPARSE", topk)
    return {
        "FLASH_ATTN_MLA": ["head_size not supported", *NOT_SPARSE],
        "FLASHMLA": NOT_SPARSE,
        "FLASHINFER_MLA": NOT_SPARSE,
        "TRITON_MLA": NOT_SPARSE,
        "FLASHMLA_SPARSE": flashmla_sparse,
    }


@pytest.mark.parametrize(
    "cc, kv, expected",
    [
        ((8, 0), "auto", "TRITON_MLA_SPARSE"),
        ((8, 6), "bfloat16", "TRITON_MLA_SPARSE"),
        ((8, 9), "fp8_ds_mla", "TRITON_MLA_SPARSE"),
        ((9, 0), "auto", None),
        ((9, 0), "fp8_ds_mla", None),
        ((10, 0), "auto", None),
        ((12, 0), "auto", "TRITON_MLA_SPARSE"),
        ((12, 1), "fp8_ds_mla", "TRITON_MLA_SPARSE"),
    ],
)
def test_glm5_table(cc, kv, expected):
    d = sel.choose_sparse_backend(cc, True, kv, upstream_for(cc))
    assert d.backend == expected
    if expected is None:
        assert "FLASHMLA_SPARSE validates" in d.reason
    else:
        # the log line names the refused upstream sparse backend and why, not the dense ones
        assert "FLASHMLA_SPARSE: compute capability not supported" in d.reason
        assert "TRITON_MLA:" not in d.reason and f"cc {cc[0]}.{cc[1]}" in d.reason


def test_topk_not_multiple_of_128_moves_hopper_to_triton():
    d = sel.choose_sparse_backend((9, 0), True, "auto", upstream_for((9, 0), topk=200))
    assert d.backend == "TRITON_MLA_SPARSE"
    assert "index_topk 200 is not a multiple of 128" in d.reason


def test_portable_switch_on_hopper():
    d = sel.choose_sparse_backend((9, 0), True, "auto", upstream_for((9, 0)), portable=True)
    assert d.backend == "TRITON_MLA_SPARSE" and sel.PORTABLE_ENV in d.reason


def test_explicit_choice_is_left_to_vllm_even_with_switch():
    d = sel.choose_sparse_backend(
        (9, 0), True, "auto", upstream_for((9, 0)), explicit="FLASHMLA_SPARSE", portable=True
    )
    assert d.backend is None and "explicit" in d.reason


def test_not_sparse_untouched():
    d = sel.choose_sparse_backend((8, 0), False, "auto", {"FLASH_ATTN_MLA": []}, portable=True)
    assert d.backend is None


def test_below_ampere_untouched():
    d = sel.choose_sparse_backend((7, 5), True, "auto", upstream_for((7, 5)), portable=True)
    assert d.backend is None and "below 8.0" in d.reason


@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "float16"])
def test_unsupported_kv_dtype_explains(kv):
    d = sel.choose_sparse_backend((8, 0), True, kv, upstream_for((8, 0)))
    assert d.backend is None
    assert "fp8_ds_mla" in d.reason and kv in d.reason


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

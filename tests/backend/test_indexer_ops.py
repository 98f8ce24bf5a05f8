"""Dispatch of the sparse indexer's logits (overlay/indexer_ops.py) between DeepGEMM and the
Triton kernels, with recording fakes in place of both (no vLLM, no GPU)."""

import types

import pytest
import torch

from overlay import indexer_ops as ix


@pytest.mark.parametrize(
    "major, installed, portable, usable",
    [(9, True, False, True), (10, True, False, True), (9, True, True, False),
     (8, True, False, False), (12, True, False, False), (9, False, False, False),
     (None, True, False, False)],
)
def test_deep_gemm_usable_for(major, installed, portable, usable):
    assert ix.deep_gemm_usable_for(major, installed, portable) is usable


def test_forced_triton_switch():
    assert not ix.forced_triton({}) and not ix.forced_triton({"DSA_OVERLAY_INDEXER": "auto"})
    assert ix.forced_triton({"DSA_OVERLAY_INDEXER": " Triton "})
    with pytest.raises(ValueError, match="DSA_OVERLAY_INDEXER='deepgem'"):
        ix.forced_triton({"DSA_OVERLAY_INDEXER": "deepgem"})
    assert not ix.deep_gemm_usable_for(9, True, False, force_triton=True)


class Recorder(types.SimpleNamespace):
    def __init__(self, name, meta_shape=None):
        super().__init__()
        self.calls = []
        for fn in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "fp8_mqa_logits",
                   "fp8_paged_mqa_logits"):
            setattr(self, fn, self._rec(fn, name))
        if meta_shape is not None:
            def meta(context_lens, block_size, num_sms):
                self.calls.append("get_paged_mqa_logits_metadata")
                return torch.full(meta_shape, 7, dtype=torch.int32)
            self.get_paged_mqa_logits_metadata = meta

    def _rec(self, fn, name):
        def f(*args, **kwargs):
            self.calls.append(fn)
            return name
        return f


@pytest.fixture
def fakes(monkeypatch):
    dg, tr = Recorder("deep_gemm", (3, 2)), Recorder("triton", (3, 2))
    monkeypatch.setattr(ix, "_deep_gemm", lambda: dg)
    monkeypatch.setattr(ix, "_triton", lambda: tr)
    return dg, tr


def _use(monkeypatch, value):
    monkeypatch.setattr(ix, "use_deep_gemm", lambda: value)


@pytest.mark.parametrize("heads, deep_gemm_ok, expect", [
    (32, True, "deep_gemm"), (64, True, "deep_gemm"), (8, True, "triton"), (48, True, "triton"),
    (32, False, "triton"), (64, False, "triton"),
])
def test_logits_dispatch(fakes, monkeypatch, heads, deep_gemm_ok, expect):
    _use(monkeypatch, deep_gemm_ok)
    q = torch.zeros(4, heads, 128)
    assert ix.fp8_fp4_mqa_logits((q, None), None, None, None, None, False) == expect
    assert ix.fp8_mqa_logits(q, None, None, None, None, False) == expect
    qd = torch.zeros(2, 1, heads, 128)
    assert ix.fp8_fp4_paged_mqa_logits((qd, None), None, None, None, None, None, 64, False) == expect
    assert ix.fp8_paged_mqa_logits(qd, None, None, None, None, None, 64, False) == expect


def test_triton_path_never_touches_deep_gemm(fakes, monkeypatch):
    dg, tr = fakes
    _use(monkeypatch, False)
    buf = torch.zeros(3, 2, dtype=torch.int32)
    ix.fill_paged_mqa_logits_metadata(buf, torch.ones(2, 1, dtype=torch.int32), 64, 2)
    q = torch.zeros(2, 1, 32, 128)
    ix.fp8_fp4_paged_mqa_logits((q, None), None, None, None, None, buf, 64, False)
    assert dg.calls == []
    assert tr.calls == ["get_paged_mqa_logits_metadata", "fp8_fp4_paged_mqa_logits"]
    assert (buf == 7).all()  # the Triton schedule of the buffer's shape was copied in


def test_triton_metadata_of_other_shape_leaves_buffer(monkeypatch):
    tr = Recorder("triton", (5,))
    monkeypatch.setattr(ix, "_triton", lambda: tr)
    monkeypatch.setattr(ix, "_deep_gemm", lambda: pytest.fail("DeepGEMM touched"))
    _use(monkeypatch, False)
    buf = torch.zeros(3, 2, dtype=torch.int32)
    ix.fill_paged_mqa_logits_metadata(buf, torch.ones(2, 1, dtype=torch.int32), 64, 2)
    assert (buf == 0).all()


def test_deep_gemm_path_fills_metadata(fakes, monkeypatch):
    dg, tr = fakes
    _use(monkeypatch, True)
    buf = torch.zeros(3, 2, dtype=torch.int32)
    ix.fill_paged_mqa_logits_metadata(buf, torch.ones(2, 1, dtype=torch.int32), 64, 2)
    assert dg.calls == ["get_paged_mqa_logits_metadata"] and tr.calls == []
    assert (buf == 7).all()

"""Dispatch of the sparse indexer's logits (overlay/indexer_ops.py) between DeepGEMM and the
Triton kernels, with recording fakes in place of both (no vLLM, no GPU)."""

import os
import subprocess
import sys
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


@pytest.mark.parametrize("major, portable, force", [(10, True, False), (10, False, True), (10, False, False)])
def test_mx_format_cache_keeps_deep_gemm(major, portable, force):
    """vLLM 0.33.0 on sm_100 writes the indexer cache in DeepGEMM's MX format: neither switch moves it off
    DeepGEMM (the Triton kernels would read UE8M0 bytes as float32 scales); nothing to use without DeepGEMM."""
    assert ix.deep_gemm_usable_for(major, True, portable, force, format_required=True)
    assert not ix.deep_gemm_usable_for(major, False, portable, force, format_required=True)


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
        self.kwargs = []
        if meta_shape is not None:
            def meta(context_lens, block_size, num_sms, **kwargs):
                self.calls.append("get_paged_mqa_logits_metadata")
                self.kwargs.append(sorted(kwargs))
                return torch.full(meta_shape, 7, dtype=torch.int32)
            self.get_paged_mqa_logits_metadata = meta

    def _rec(self, fn, name):
        def f(*args, **kwargs):
            self.calls.append(fn)
            self.kwargs.append(sorted(kwargs))
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
    assert ix.fill_paged_mqa_logits_metadata(buf, torch.ones(2, 1, dtype=torch.int32), 64, 2) is buf
    assert (buf == 0).all()


def test_deep_gemm_path_fills_metadata(fakes, monkeypatch):
    dg, tr = fakes
    _use(monkeypatch, True)
    buf = torch.zeros(3, 2, dtype=torch.int32)
    view = ix.fill_paged_mqa_logits_metadata(buf, torch.ones(2, 1, dtype=torch.int32), 64, 2)
    assert dg.calls == ["get_paged_mqa_logits_metadata"] and tr.calls == []
    assert dg.kwargs == [[]]  # no `indices` keyword for the DeepGEMM wrappers of 0.16-0.27
    assert (buf == 7).all() and view.data_ptr() == buf.data_ptr() and view.shape == buf.shape


def test_deep_gemm_schedule_shorter_than_the_buffer(monkeypatch):
    """vLLM 0.28.0 on: DeepGEMM's schedule may have fewer rows than the builder's buffer (sized for one slot per
    SM); its first rows get it, the rest stay, and the view the decode metadata keeps is just those rows."""
    dg, tr = Recorder("deep_gemm", (2, 2)), Recorder("triton", (3, 2))
    monkeypatch.setattr(ix, "_deep_gemm", lambda: dg)
    monkeypatch.setattr(ix, "_triton", lambda: tr)
    _use(monkeypatch, True)
    buf = torch.full((5, 2), -3, dtype=torch.int32)
    rows = torch.arange(4, dtype=torch.int32)
    view = ix.fill_paged_mqa_logits_metadata(buf, torch.ones(4, dtype=torch.int32), 64, 2, indices=rows)
    assert dg.kwargs == [["indices"]] and tr.calls == []
    assert view.shape == (2, 2) and view.data_ptr() == buf.data_ptr() and (view == 7).all()
    assert (buf[2:] == -3).all()


@pytest.mark.parametrize("heads, deep_gemm_ok", [(32, True), (8, True), (32, False)])
def test_varlen_indices_reach_deep_gemm_only(fakes, monkeypatch, heads, deep_gemm_ok):
    """0.28.0's paged call passes `indices=` (request of each flattened varlen row): DeepGEMM gets it; the
    Triton kernel, whose flattened rows carry their own context length and block-table row, does not; a call
    without it passes nothing (the 0.20-0.27 wrappers have no such keyword)."""
    dg, tr = fakes
    _use(monkeypatch, deep_gemm_ok)
    q = torch.zeros(3, 1, heads, 128)
    rows = torch.tensor([0, 0, 1], dtype=torch.int32)
    got = ix.fp8_fp4_paged_mqa_logits((q, None), None, None, None, None, None, 64, False, indices=rows)
    ix.fp8_fp4_paged_mqa_logits((q, None), None, None, None, None, None, 64, False)
    on_dg = deep_gemm_ok and heads in ix.DEEP_GEMM_INDEX_HEADS
    assert got == ("deep_gemm" if on_dg else "triton")
    used = dg if on_dg else tr
    assert used.kwargs == [["clean_logits", "indices", "max_model_len"] if on_dg else ["clean_logits", "max_model_len"],
                           ["clean_logits", "max_model_len"]]


@pytest.mark.parametrize("heads, deep_gemm_ok, mx", [(32, True, False), (8, True, False), (32, False, False),
                                                     (8, True, True)])
def test_compressed_prefill_dispatch(fakes, monkeypatch, heads, deep_gemm_ok, mx):
    """0.33.0's prefill call (max_seqlen_k in sixth place, row-compressed result): DeepGEMM gets its own
    0.33 signature, the Triton kernel `max_seqlen_k=` and clean_logits=False; an MX-format cache (sm_100)
    stays on DeepGEMM whatever the head count."""
    dg, tr = fakes
    _use(monkeypatch, deep_gemm_ok)
    monkeypatch.setattr(ix, "deep_gemm_format_required", lambda: mx)
    q = torch.zeros(4, heads, 128)
    got = ix.fp8_fp4_mqa_logits_compressed((q, None), "kv", "w", "ks", "ke", 96)
    on_dg = deep_gemm_ok and (heads in ix.DEEP_GEMM_INDEX_HEADS or mx)
    assert got == ("deep_gemm" if on_dg else "triton")
    used, other = (dg, tr) if on_dg else (tr, dg)
    assert used.calls == ["fp8_fp4_mqa_logits"] and other.calls == []
    assert used.kwargs == [[] if on_dg else ["clean_logits", "max_seqlen_k"]]


@pytest.mark.parametrize("heads, deep_gemm_ok", [(32, True), (8, True), (32, False)])
def test_paged_call_without_clean_logits(fakes, monkeypatch, heads, deep_gemm_ok):
    """0.33.0's paged call has no clean_logits: DeepGEMM's 0.33 wrapper gets none (it has no such argument),
    the Triton kernel gets clean_logits=False."""
    dg, tr = fakes
    _use(monkeypatch, deep_gemm_ok)
    q = torch.zeros(3, 1, heads, 128)
    rows = torch.tensor([0, 0, 1], dtype=torch.int32)
    ix.fp8_fp4_paged_mqa_logits((q, None), None, None, None, None, None, max_model_len=64, indices=rows)
    on_dg = deep_gemm_ok and heads in ix.DEEP_GEMM_INDEX_HEADS
    used = dg if on_dg else tr
    assert used.kwargs == [["indices", "max_model_len"] if on_dg else ["clean_logits", "max_model_len"]]


# --- the fused indexer-query kernel's capability gate (0.25.0 on) ---------------------------------


@pytest.mark.parametrize("cap, ok", [((8, 0), False), ((8, 6), False), ((8, 7), False), ((8, 9), True),
                                     ((9, 0), True), ((10, 0), True), ((12, 0), True), ((12, 1), True),
                                     (None, False)])
def test_triton_fp8_store_supported(cap, ok):
    assert ix.triton_fp8_store_supported(cap) is ok


def _platform(monkeypatch, cuda: bool, cap):
    """A stand-in `vllm.platforms` whose current platform is CUDA (or not) at capability `cap`."""
    vllm, platforms = types.ModuleType("vllm"), types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(
        is_cuda=lambda: cuda,
        get_device_capability=lambda: None if cap is None else types.SimpleNamespace(major=cap[0], minor=cap[1]))
    vllm.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


@pytest.mark.parametrize("cuda, cap, ok", [(True, (8, 0), False), (True, (8, 6), False), (True, (8, 9), True),
                                           (True, (9, 0), True), (True, (12, 0), True), (True, None, False),
                                           (False, (9, 0), False)])
def test_fused_q_quant_supported_reads_the_platform(monkeypatch, cuda, cap, ok):
    _platform(monkeypatch, cuda, cap)
    assert ix.fused_q_quant_supported() is ok
    # 0.29.0+: upstream's CUDA DSA module stores fp8 from Triton in every call (fused_norm_rope, fused_q)
    assert ix.cuda_dsa_module_supported() is ok


_FP8_STORE_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def store_fp8(x, out):
    offs = tl.arange(0, 32)
    tl.store(out + offs, tl.load(x + offs).to(tl.float8e4nv))
'''

_COMPILE_EACH = '''
import sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp8_store import store_fp8

for cc in (80, 86, 89, 90, 120):
    src = ASTSource(fn=store_fp8, signature={"x": "*fp32", "out": "*fp8e4nv"}, constexprs={})
    try:
        triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 1})
        print(cc, "ok")
    except Exception as e:
        print(cc, "refused", type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
'''


def test_gate_matches_what_triton_compiles(tmp_path):
    """The threshold is Triton's: a kernel storing float8_e4m3fn (as upstream's fused indexer-query kernel
    does) cross-compiles for sm_89 and up and is refused below (compiled, not interpreted: a subprocess)."""
    (tmp_path / "fp8_store.py").write_text(_FP8_STORE_KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_EACH, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    for cc, outcome in seen.items():
        cap = (int(cc) // 10, int(cc) % 10)
        assert outcome.startswith("ok") is ix.triton_fp8_store_supported(cap), (cc, outcome)
    assert set(seen) == {"80", "86", "89", "90", "120"}

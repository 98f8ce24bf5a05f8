"""bench/e2e/reference.py (the float64 layer references behind bench/e2e/layerwise.py) against plain
loops written here and the overlay's own references, on small random inputs on CPU; and the
comparisons: top-k sets with ties and wrong picks, attention errors of a right and a poisoned output."""

import math
import sys as _sys
from pathlib import Path

import pytest
import torch

from bench.e2e import layerwise as LW
from bench.e2e import reference as REF
from overlay.kernels import indexer as KI
from overlay.kernels import sparse_mla as KS
from tools.fp8_ds_mla_codec import quantize_fp8_ds_mla


def _loop_logits(q, k, ks_, w, lo, hi):
    """One row of indexer logits, plain Python float64 loops (no torch math)."""
    out = []
    for n in range(lo, hi):
        total = 0.0
        for h in range(q.shape[0]):
            dot = sum(float(q[h, d]) * float(k[n, d]) for d in range(q.shape[1]))
            total += float(w[h]) * max(0.0, float(ks_[n]) * dot)
        out.append(total)
    return out


def test_indexer_logits_ref_equals_plain_loops_and_the_overlays_reference():
    g = torch.Generator().manual_seed(0)
    R, H, D, N = 3, 4, 16, 11
    q = (torch.randn(R, H, D, generator=g) * 3).to(torch.float8_e4m3fn)
    k = (torch.randn(N, D, generator=g) * 3).to(torch.float8_e4m3fn)
    k_scale = torch.rand(N, generator=g) + 0.1
    w = torch.randn(R, H, generator=g)
    ks, ke = torch.tensor([0, 2, 5]), torch.tensor([4, 9, 11])
    ref = REF.indexer_logits_ref(q, k, k_scale, w, ks, ke)
    assert ref.dtype == torch.float64
    for r in range(R):
        assert ref[r, ks[r]:ke[r]].tolist() == pytest.approx(_loop_logits(q[r], k, k_scale, w[r], ks[r], ke[r]),
                                                             rel=1e-12, abs=1e-12)
        assert torch.isinf(ref[r, :ks[r]]).all() and torch.isinf(ref[r, ke[r]:]).all()
    theirs = KI.fp8_mqa_logits_ref(q, (k, k_scale), w, ks.int(), ke.int())
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(theirs))
    assert torch.allclose(ref[fin].float(), theirs[fin], rtol=1e-6, atol=1e-5)


def test_compare_topk_tells_ties_from_wrong_picks_in_request_local_positions():
    # one row, keys 3..8 visible (ks = 3): local scores 5, 4, 3, 3, 1, 0.5; top-3
    scores = [float("-inf")] * 3 + [5.0, 4.0, 3.0, 3.0, 1.0, 0.5]
    ref = torch.tensor([scores], dtype=torch.float64)
    ks, ke = torch.tensor([3]), torch.tensor([9])
    rows = REF.compare_topk(torch.tensor([[0, 1, 2]]), ref, ks, ke, 3)
    assert rows[0]["same"] and rows[0]["overlap"] == 1.0 and rows[0]["differ"] == 0
    tie = REF.compare_topk(torch.tensor([[1, 0, 3]]), ref, ks, ke, 3)[0]      # 3 ties 2: both right
    assert not tie["same"] and tie["differ"] == 1 and tie["missed"] == 1 and tie["near_ties"] == 2
    assert tie["gap"] == 0.0 and tie["overlap"] == pytest.approx(2 / 3)
    wrong = REF.compare_topk(torch.tensor([[0, 1, 4]]), ref, ks, ke, 3)[0]    # score 1 vs k-th 3
    assert wrong["near_ties"] == 1 and wrong["gap"] == pytest.approx(2 / 5)   # only the missed side
    # the same pick is a near-tie when the path's own logits are off by more than half the gap
    noisy = ref.clone().float()
    noisy[0, 7] += 1.2
    explained = REF.compare_topk(torch.tensor([[0, 1, 4]]), ref, ks, ke, 3, path_logits=noisy)[0]
    assert explained["near_ties"] == 2 and explained["logit_err"] == pytest.approx(1.2 / 5, rel=1e-6)
    # a row with fewer visible keys than top-k keeps them all; padding (-1) is ignored
    short = REF.compare_topk(torch.tensor([[2, 0, 1, -1]]), ref[:, :6], ks, torch.tensor([6]), 4)[0]
    assert short["k"] == 3 and short["same"] and short["n"] == 3
    # a position outside the visible keys is never a near-tie
    out = REF.compare_topk(torch.tensor([[0, 1, 7]]), ref, ks, ke, 3)[0]
    assert out["differ"] == 1 and out["gap"] == math.inf and out["near_ties"] == 1


def _paged(g, nb, bs, width=576):
    return torch.randn(nb, bs, width, generator=g).to(torch.bfloat16)


def test_gather_kv_reads_slots_of_every_cache_view_without_copying_the_cache():
    g = torch.Generator().manual_seed(1)
    nb, bs = 5, 4
    big = torch.randn(nb, 2 * bs, 576, generator=g).to(torch.bfloat16)
    cache = big[:, :bs]                                    # strided blocks (cross-layer style)
    slots = torch.tensor([[0, 7, 19, -1], [3, 20, 5, 5]])
    rows, valid = REF.gather_kv(cache, slots)
    assert valid.tolist() == [[True, True, True, False], [True, False, True, True]]
    for r in range(2):
        for j in range(4):
            if valid[r, j]:
                s = int(slots[r, j])
                assert torch.equal(rows[r, j], cache[s // bs, s % bs].double())
    flat = cache.reshape(nb * bs, 576)
    for view in (flat, flat.unsqueeze(1), cache.unsqueeze(2)):
        r2, v2 = REF.gather_kv(view, slots)
        assert torch.equal(v2, valid) and torch.equal(r2[valid], rows[valid])
    _, vl = REF.gather_kv(cache, slots, valid_len=torch.tensor([2, 4]))
    assert vl.tolist() == [[True, True, False, False], [True, False, True, True]]


def test_gather_kv_dequantises_fp8_ds_mla_rows_like_the_codec():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 576, generator=g) * 2
    packed, exact = quantize_fp8_ds_mla(x)
    cache = packed.view(3, 4, 1, 656)                     # FlashMLA's [nb, bs, 1, 656] uint8 view
    slots = torch.tensor([[11, 0, 5]])
    rows, valid = REF.gather_kv(cache.view(torch.float8_e4m3fn), slots)
    assert valid.all()
    assert torch.allclose(rows[0], exact[slots[0]], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expected 576"):
        REF.gather_kv(torch.zeros(4, 100), slots.clamp(max=3))


def _loop_attention(q, rows, valid, scale):
    """softmax(scale q.k) v for one token and head, plain float64 math per slot."""
    s = [scale * float(q @ rows[j]) for j in range(rows.shape[0]) if valid[j]]
    m = max(s)
    p = [math.exp(x - m) for x in s]
    z = sum(p)
    v = [rows[j, :512] for j in range(rows.shape[0]) if valid[j]]
    return sum(pi / z * vj for pi, vj in zip(p, v)), m + math.log(z)


def test_sparse_attention_ref_equals_a_loop_and_the_overlays_reference():
    g = torch.Generator().manual_seed(3)
    nb, bs, R, H, K = 4, 8, 3, 2, 6
    cache = _paged(g, nb, bs)
    q = torch.randn(R, H, 576, generator=g).to(torch.bfloat16)
    slots = torch.randint(0, nb * bs, (R, K), generator=g)
    slots[1, 2] = -1
    slots[2, :] = -1                                        # no valid slot: out 0, lse -inf
    scale = 576 ** -0.5
    rows, valid = REF.gather_kv(cache, slots)
    out, lse = REF.sparse_attention_ref(q, rows, valid, scale)
    for r in range(2):
        for h in range(H):
            o, l = _loop_attention(q[r, h].double(), rows[r], valid[r], scale)
            assert torch.allclose(out[r, h], o, rtol=1e-12, atol=1e-12) and lse[r, h].item() == pytest.approx(l)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isinf(lse[2]).all()
    theirs, tl = KS.sparse_mla_reference(q, cache, slots.int(), scale)
    assert torch.allclose(out[:2].float(), theirs[:2], rtol=1e-5, atol=1e-5)


def test_attention_error_sees_bf16_rounding_small_and_a_wrong_slot_large():
    g = torch.Generator().manual_seed(4)
    cache = _paged(g, 8, 16)
    q = torch.randn(4, 16, 576, generator=g).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(128, generator=g)[:32] for _ in range(4)])
    rows, valid = REF.gather_kv(cache, slots)
    ref, _ = REF.sparse_attention_ref(q, rows, valid, 576 ** -0.5)
    right = ref.to(torch.bfloat16)                          # one bf16 rounding of the exact output
    assert REF.attention_error(right, ref).max() < 2 ** -8
    shifted = slots.clone()
    shifted[:, 0] = (shifted[:, 0] + 1) % 128               # one slot off by one: a kernel bug
    bad, _ = REF.sparse_attention_ref(q, *REF.gather_kv(cache, shifted), 576 ** -0.5)
    assert REF.attention_error(bad.to(torch.bfloat16), ref).min() > 10 * 2 ** -8


def test_summarize_counts_selecting_rows_only_and_reports_error_quantiles():
    rows = [dict(n=5, k=5, same=True, overlap=1.0, differ=0, missed=0, near_ties=0, gap=0.0, logit_err=0.0, tol=0),
            dict(n=9, k=4, same=False, overlap=0.75, differ=1, missed=1, near_ties=2, gap=1e-7, logit_err=1e-7,
                 tol=1e-6),
            dict(n=9, k=4, same=True, overlap=1.0, differ=0, missed=0, near_ties=0, gap=0.0, logit_err=2e-7, tol=1e-6)]
    s = REF.summarize(rows, [1e-3, 2e-3, 5e-2])
    assert s["topk_rows"] == 2 and s["same_set"] == 0.5 and s["overlap"] == 0.875
    assert s["differ"] == 2 and s["near_ties"] == 2 and s["gap_max"] == 1e-7 and s["logit_err_max"] == 2e-7
    assert s["attn_err_median"] == 2e-3 and s["attn_err_max"] == 5e-2 and s["attn_rows"] == 3
    assert REF.summarize([], [])["same_set"] is None


def test_layerwise_verdict_separates_rounding_from_a_defect():
    good = {"topk_rows": 10, "differ": 4, "near_ties": 4, "attn_err_p99": 5e-3, "attn_rows": 10}
    assert LW.verdict({"l0": good, "l1": good}, "auto").startswith("rounding")
    wrong_pick = dict(good, near_ties=3)
    v = LW.verdict({"l0": good, "l1": wrong_pick}, "auto")
    assert v.startswith("DEFECT") and "l1" in v and "top-k" in v
    v = LW.verdict({"l0": dict(good, attn_err_p99=0.2)}, "auto")
    assert v.startswith("DEFECT") and "attention" in v
    assert LW.verdict({"l0": dict(good, attn_err_p99=0.02)}, "fp8_ds_mla").startswith("rounding")
    assert LW.verdict({}, "auto").startswith("no data")


def test_against_upstream_holds_ours_to_upstreams_own_distance_from_the_reference():
    up = {"l0": {"topk_rows": 100, "differ": 6, "near_ties": 2, "attn_err_p99": 4e-3}}
    same = {"l0": {"topk_rows": 100, "differ": 7, "near_ties": 2, "attn_err_p99": 5e-3}}
    assert LW.against_upstream(same, up).startswith("as close")     # a shared cause is not ours
    more = {"l0": {"topk_rows": 100, "differ": 12, "near_ties": 2, "attn_err_p99": 5e-3}}
    assert "top-k picks beyond tolerance" in LW.against_upstream(more, up)
    worse = {"l0": {"topk_rows": 100, "differ": 6, "near_ties": 2, "attn_err_p99": 9e-3}}
    assert "attention error p99 9.00e-03 vs upstream's 4.00e-03" in LW.against_upstream(worse, up)
    assert LW.against_upstream({}, up).startswith("not compared")


def _fake_layer(g, T=6, N=40, H=4, D=16):
    """One layer's indexer inputs (two prefill chunks of one request, keys 0..N) and its cache."""
    q = (torch.randn(T, H, D, generator=g) * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(N, D, generator=g) * 2).to(torch.float8_e4m3fn)
    k_scale = torch.rand(N, generator=g) + 0.5
    w = torch.randn(T, H, generator=g)
    ke = torch.arange(N - T + 1, N + 1)            # token t sees keys [0, N - T + 1 + t)
    ks = torch.zeros(T, dtype=torch.long)
    return q, (k, k_scale), w, ks, ke


class _Impl:
    num_heads = 4

    def __init__(self, buf):
        self.topk_indices_buffer = buf


class _Layer:
    def __init__(self, i):
        self.layer_name = f"model.layers.{i}.self_attn.attn"


class _Op:
    def __init__(self, i):
        self.k_cache = type("C", (), {"prefix": f"model.layers.{i}.self_attn.indexer.k_cache"})()


def _engine_step(cap, layers, topk, pick=None, attention=None, g=None, logits=None, D=16, paged=False):
    """What vLLM does per layer in one prefill step, with the hooks of layerwise.install: the indexer
    op (two logits calls, 3 rows each, q passed as vLLM 0.20+ does: (values, None)), the top-k into
    the shared buffer, forward_mqa -> attention."""
    ref_logits = lambda q, kv, w, ks, ke, clean_logits=False: KI.fp8_mqa_logits_ref(q[0], kv, w, ks, ke)  # noqa: E731
    logits_fn = cap.indexer("indexer.fp8_fp4_mqa_logits", logits or ref_logits)
    attn_fn = cap.attention("sparse_mla.sparse_mla_attention", attention or KS.sparse_mla_attention)
    buf = torch.full((6, topk), -1, dtype=torch.int32)
    cache = torch.randn(4, 16, 576, generator=g).to(torch.bfloat16)
    q_attn = torch.randn(6, 6, 576, generator=g).to(torch.bfloat16)      # 6 heads: 2 of padding
    for i in layers:
        q, kv, w, ks, ke = _fake_layer(g, D=D)

        def indexer_forward(op):
            for lo, hi in ((0, 3), (3, 6)):
                lg = logits_fn((q[lo:hi], None), kv, w[lo:hi], ks[lo:hi].int(), ke[lo:hi].int(),
                               clean_logits=False)
                top = torch.topk(lg, topk, dim=1).indices.int()      # keys from 0: local = key
                buf[lo:hi] = top if pick is None else pick(top)

        cap.indexer_op(lambda op: indexer_forward(op))(_Op(i))

        def mqa(impl, q_, kv_cache, md, layer):
            if paged:   # the 0.26 backend: request-local positions in a larger buffer, converted in the kernel
                big = torch.full((9, topk), -1, dtype=torch.int32)
                big[:6] = buf.clamp(max=63)
                return attn_fn(q_attn, cache, big, 576 ** -0.5, block_table=PAGED_TABLE,
                               req_id=torch.zeros(9, dtype=torch.int32))
            return attn_fn(q_attn, cache, buf.clamp(max=63), 576 ** -0.5)

        cap.forward_mqa(mqa)(_Impl(buf), None, None, None, _Layer(i))


def test_the_hooks_pair_each_layers_indexer_rows_with_its_chosen_topk_and_measure_attention():
    """The hooks layerwise.install puts in place, driven the way vLLM drives them: a correct path
    (the overlay's float32 references standing in for the kernels) is rounding at every layer; a
    wrong top-k pick or a wrong slot in attention is a DEFECT at that layer."""
    g = torch.Generator().manual_seed(5)
    attention = lambda q, kv_cache, indices, softmax_scale, kv_format="bf16": KS.sparse_mla_reference(  # noqa: E731
        q, kv_cache, indices, softmax_scale, kv_format)
    cap = LW.Capture(topk=8, rows=2)
    cap.on = True
    _engine_step(cap, [0, 1], 8, attention=attention, g=g)
    s = cap.summary()
    assert list(s) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    for layer in s.values():
        assert layer["topk_rows"] == 4 and layer["same_set"] == 1.0 and layer["differ"] == 0
        assert layer["attn_rows"] == 2 and layer["attn_err_max"] < 1e-6        # float32 vs float64
        assert layer["logit_err_max"] < 1e-6
    assert LW.verdict(s, "auto").startswith("rounding") and not cap.pending
    assert cap.calls == {"indexer.fp8_fp4_mqa_logits": 4, "sparse_mla.sparse_mla_attention": 2}

    def swap_last(top):                     # the worst position instead of the k-th best one
        bad = top.clone()
        bad[:, -1] = 0 if int(bad[0, :-1].min()) != 0 else 1
        return bad

    cap = LW.Capture(topk=8, rows=2)
    cap.on = True
    _engine_step(cap, [0], 8, pick=swap_last, attention=attention, g=g)
    v = LW.verdict(cap.summary(), "auto")
    assert v.startswith("DEFECT") and "model.layers.0.self_attn.attn: top-k" in v

    def off_by_one(q, kv_cache, indices, softmax_scale, kv_format="bf16"):
        return attention(q, kv_cache, (indices + 1) % 64, softmax_scale, kv_format)

    cap = LW.Capture(topk=8, rows=2)
    cap.on = True
    _engine_step(cap, [0], 8, attention=off_by_one, g=g)
    v = LW.verdict(cap.summary(), "auto")
    assert v.startswith("DEFECT") and "attention error" in v and "top-k" not in v


PAGED_TABLE = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)   # position p -> block PAGED_TABLE[0, p // 16]


def test_attention_given_request_local_indices_and_a_block_table_is_checked_on_the_slots_it_reads():
    """From vLLM 0.26 the overlay's backend hands the kernel the indexer's request-local buffer (more rows
    than tokens) with block_table / req_id. The hook must compare against the slots those positions map
    to (on the H200 it reshaped the whole buffer to the token count and crashed); a kernel that reads the
    wrong block is a DEFECT."""
    from overlay.triton_mla_sparse_ops import convert_req_index_to_global

    def paged(shift):
        def attention(q, kv_cache, indices, softmax_scale, kv_format="bf16", block_table=None, req_id=None):
            T = q.shape[0]
            slots = convert_req_index_to_global(req_id[:T], block_table.roll(shift, 1), indices[:T], 16)
            # a list, as FlashMLA's sparse prefill kernel returns on 0.26 (the hook crashed on it)
            return list(KS.sparse_mla_reference(q, kv_cache, slots, softmax_scale, kv_format))
        return attention

    local = torch.tensor([[0, 17, 63, -1], [40, 64, 5, 31]])
    assert REF.local_to_slots(local, torch.zeros(2, dtype=torch.int32), PAGED_TABLE, 16).tolist() == [
        [32, 1, 31, -1], [56, -1, 37, 15]]
    g = torch.Generator().manual_seed(7)
    cap = LW.Capture(topk=8, rows=2)
    cap.on = True
    _engine_step(cap, [0, 1], 8, attention=paged(0), g=g, paged=True)
    s = cap.summary()
    assert all(l["attn_rows"] == 2 and l["attn_err_max"] < 1e-6 for l in s.values()), s
    assert LW.verdict(s, "auto").startswith("rounding")
    cap = LW.Capture(topk=8, rows=2)
    cap.on = True
    _engine_step(cap, [0], 8, attention=paged(1), g=g, paged=True)
    v = LW.verdict(cap.summary(), "auto")
    assert v.startswith("DEFECT") and "attention error" in v


def test_a_step_without_forward_mqa_leaves_no_sample_for_the_next_step():
    """vLLM 0.26 sends a prefill no longer than top-k to dense MHA: the indexer ran, forward_mqa did not. Its
    samples must not be paired with the next step's top-k, nor shift that step's rows (on the H200 the
    shifted rows indexed past the top-k buffer: a device-side assert in every engine)."""
    g = torch.Generator().manual_seed(6)
    attention = lambda q, kv_cache, indices, softmax_scale, kv_format="bf16": KS.sparse_mla_reference(  # noqa: E731
        q, kv_cache, indices, softmax_scale, kv_format)
    cap = LW.Capture(topk=8, rows=2)
    cap.on = True
    q, kv, w, ks, ke = _fake_layer(g, D=16)
    logits_fn = cap.indexer("indexer.fp8_fp4_mqa_logits",
                            lambda q, kv, w, ks, ke, clean_logits=False: KI.fp8_mqa_logits_ref(q[0], kv, w, ks, ke))
    cap.indexer_op(lambda op: logits_fn((q[:6], None), kv, w[:6], ks[:6].int(), ke[:6].int()))(_Op(0))
    assert len(cap.pending) == 1 and cap.row_offset["model.layers.0.self_attn.indexer.k_cache"] == 6
    _engine_step(cap, [0], 8, attention=attention, g=g)    # the next step: indexer, then forward_mqa
    s = cap.summary()
    assert s["model.layers.0.self_attn.attn"]["topk_rows"] == 4
    assert s["model.layers.0.self_attn.attn"]["same_set"] == 1.0 and not cap.pending and cap.stale == 1
    assert LW.verdict(s, "auto").startswith("rounding")


def test_layerwise_main_runs_one_engine_per_cache_and_path_and_writes_the_table(tmp_path, monkeypatch):
    """The orchestration without a GPU: one worker per (kv, path), the dsv32 prompts longer than its
    top-k, the table and verdicts written to --out with the JSON beside it; a failed engine is a row."""
    import json
    import sys as _sys

    from bench.e2e import run as RUN

    specs = []
    monkeypatch.setattr(RUN, "make_model", lambda d, m: (d.mkdir(parents=True), (d / "config.json").write_text("{}")))

    class Popen:
        def __init__(self, cmd, **kw):
            specs.append(json.loads(Path(cmd[-1]).read_text()))  # the spec travels as a file (spec_arg)
            assert kw.get("start_new_session")

    layer = REF.summarize([dict(n=3000, k=2048, same=True, overlap=1.0, differ=0, missed=0, near_ties=0, gap=0.0,
                                logit_err=1e-7, tol=1e-6)], [3e-3])

    def finish(proc, t0, timeout):
        s = specs[-1]
        if s["kv"] == "fp8_ds_mla" and s["path"] == "triton":
            return {"error": "exit 1", "log": "Traceback: boom"}
        return {"layers": {"model.layers.0.self_attn.attn": layer}, "calls": {"x": 1}, "not_hooked": [],
                "unpaired_indexer_samples": 0}

    monkeypatch.setattr(LW.subprocess, "Popen", Popen)
    monkeypatch.setattr(RUN, "finish_worker", finish)
    out = tmp_path / "lw.md"
    monkeypatch.setattr(_sys, "argv", ["layerwise.py", "--workdir", str(tmp_path / "w"), "--out", str(out)])
    assert LW.main() == 1
    assert [(s["kv"], s["path"]) for s in specs] == [("auto", "upstream"), ("auto", "triton"),
                                                     ("fp8_ds_mla", "upstream"), ("fp8_ds_mla", "triton")]
    assert all(s["topk"] == 2048 and min(map(len, s["sequences"])) > 2048 for s in specs)
    text = out.read_text()
    assert "| auto | triton | model.layers.0.self_attn.attn | 1 | 1.0000 |" in text
    assert "- auto / upstream: rounding" in text and "| fp8_ds_mla | triton | FAILED: exit 1 |" in text
    assert "- auto, Triton vs upstream: as close to the reference as upstream" in text
    assert "Traceback: boom" in text and json.loads(out.with_suffix(".json").read_text())["auto/triton"]


def test_the_overlays_real_kernels_interpreted_are_rounding_layer_by_layer():
    """The overlay's own Triton kernels (indexer logits with D = 128, sparse attention), run by Triton's
    CPU interpreter, through the same hooks: every top-k pick matches the float64 reference and the
    attention error is bf16 rounding."""
    from tools.triton_interp import load_interpreted

    root = Path(__file__).resolve().parents[2]
    M = _sys.modules.get("_sparse_mla_interpreted") or load_interpreted(
        root / "overlay" / "kernels" / "sparse_mla.py", "_sparse_mla_interpreted")
    ix = _sys.modules.get("_indexer_interpreted") or load_interpreted(
        root / "overlay" / "kernels" / "indexer.py", "_indexer_interpreted")
    g = torch.Generator().manual_seed(6)
    cap = LW.Capture(topk=8, rows=3)
    cap.on = True
    _engine_step(cap, [0, 1], 8, g=g, logits=ix.fp8_fp4_mqa_logits, attention=M.sparse_mla_attention, D=128)
    s = cap.summary()
    assert len(s) == 2 and not cap.pending
    for layer in s.values():
        assert layer["topk_rows"] == 6 and layer["differ"] == layer["near_ties"]
        assert layer["logit_err_max"] < 1e-5 and 0 < layer["attn_err_max"] < 2 ** -7
    assert LW.verdict(s, "auto").startswith("rounding")

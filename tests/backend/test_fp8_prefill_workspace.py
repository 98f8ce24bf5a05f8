"""fp8_ds_mla prefills through a bf16 workspace: the plan (which requests, which workspace blocks), the
up-conversion kernel (Triton's interpreter) against the cache layout decoded by hand, and the backend's
segmented forward against a float64 reference that never reads the paged cache."""

import pytest
import torch

from overlay import triton_mla_sparse_ops as ops
from overlay.kernels import sparse_mla as SM
from tests.kernels._fp8_ds_mla import quantize_fp8_ds_mla
from tools.triton_interp import bf16_rounding, numpy24_fix


def qsl_of(query_lens):
    return torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)


def test_plan_groups_worthy_requests_and_covers_every_token():
    # decode, decode, long prefill chunk, continuation against a long context (not worthy), two fresh prompts
    query = [1, 1, 100, 70, 64, 90]
    seqs = [300, 5000, 100, 70 * 256 + 1, 64, 200]
    plan = ops.plan_fp8_prefill(qsl_of(query), torch.tensor(seqs), 64, capacity_blocks=6)
    spans = [(s.tok_start, s.tok_end, s.req_start, s.req_end, s.ws_blocks) for s in plan]
    # request 2 (2 blocks) alone; request 3: 70 tokens x 256 rows < its 281 blocks x 64 rows -> fp8; 4 + 5 share
    # a segment (1 + 4 blocks <= 6)
    assert spans == [(0, 2, 0, 2, 0), (2, 102, 2, 3, 2), (102, 172, 3, 4, 0), (172, 326, 4, 6, 5)]
    assert all(s.block_table is None and s.req_id is None for s in plan if not s.ws_blocks)
    ws = plan[3]
    assert ws.block_table.tolist() == [[0, -1, -1, -1], [1, 2, 3, 4]]
    assert ws.req_id.tolist() == [0] * 64 + [1] * 90 and ws.req_id.dtype == torch.int32
    assert plan[1].block_table.tolist() == [[0, 1]]


def test_plan_splits_at_capacity_and_skips_what_does_not_fit():
    query = [128, 128, 128]
    seqs = [128, 256, 1000]
    plan = ops.plan_fp8_prefill(qsl_of(query), torch.tensor(seqs), 64, capacity_blocks=4)
    spans = [(s.tok_start, s.tok_end, s.ws_blocks) for s in plan]
    # 2 + 4 blocks exceed 4: two segments; 16 blocks never fit: read from fp8
    assert spans == [(0, 128, 2), (128, 256, 4), (256, 384, 0)]
    assert plan[1].block_table.tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("query, seqs", [([1] * 8, [100] * 8), ([63], [63]), ([64], [64 * 257])])
def test_plan_none_for_decodes_and_short_or_long_context_steps(query, seqs):
    assert ops.plan_fp8_prefill(qsl_of(query), torch.tensor(seqs), 64, capacity_blocks=1000) is None


def test_workspace_switch(monkeypatch):
    assert ops.fp8_workspace_enabled({})
    assert not ops.fp8_workspace_enabled({ops.FP8_WS_ENV: "0"})
    with pytest.raises(ValueError, match=ops.FP8_WS_ENV):
        ops.fp8_workspace_enabled({ops.FP8_WS_ENV: "maybe"})


def fp8_cache(g, num_blocks, block_size):
    """A cache of real fp8_ds_mla rows (the codec's), every row different; returns (bytes, float64 rows)."""
    dense = torch.randn(num_blocks * block_size, 576, generator=g) * torch.rand(num_blocks * block_size, 1,
                                                                                generator=g).add(0.1)
    rows, exact = quantize_fp8_ds_mla(dense)
    return rows.view(num_blocks, block_size, 656).clone(), exact.view(num_blocks, block_size, 576)


@pytest.mark.parametrize("fp8_native", [True, False])
def test_upconvert_equals_the_layout_decoded_by_hand(fp8_native):
    from overlay.kernels.fp8_workspace import upconvert_blocks

    numpy24_fix()
    g = torch.Generator().manual_seed(3 + fp8_native)
    bs, nb = 16, 7
    cache, exact = fp8_cache(g, nb, bs)
    src = torch.tensor([[6, 2, 0], [5, 3, 1], [4, -1, 9]], dtype=torch.int32)   # -1 and 9: no such block
    dst = torch.tensor([[3, 0, -1, -1], [1, 4, 2, 5]], dtype=torch.int32)      # requests 1 and 2 of src
    ws = torch.full((7, bs, 576), float("nan"), dtype=torch.bfloat16)
    with bf16_rounding():  # the GPU's float32 -> bf16 rounding (the interpreter's own truncates)
        upconvert_blocks(cache, src, 1, dst, ws, fp8_native=fp8_native)
    # what the attention kernel computes from the bytes: float32 (e4m3 x tile scale), rounded to bf16 once
    want = SM.dequantize_fp8_ds_mla(cache).to(torch.bfloat16)
    assert torch.equal(ws[3], want[5]) and torch.equal(ws[0], want[3])
    assert torch.equal(ws[1], want[4])
    assert torch.equal(ws[4], torch.zeros(bs, 576, dtype=torch.bfloat16))      # a -1 source block: zeros
    assert torch.equal(ws[2], torch.zeros(bs, 576, dtype=torch.bfloat16))      # block 9 of 7: zeros
    assert torch.equal(ws[5], torch.zeros(bs, 576, dtype=torch.bfloat16))      # past the source table: zeros
    assert ws[6].isnan().all()                                                  # no destination: untouched
    # the bytes' meaning, independently of the reference decoder: within bf16 rounding of the codec's values
    assert torch.allclose(ws[3].double(), exact[5], rtol=2 ** -8, atol=0)


def test_upconvert_refuses_bad_arguments():
    from overlay.kernels.fp8_workspace import upconvert_blocks

    cache = torch.zeros(2, 16, 656, dtype=torch.uint8)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="workspace must be bf16"):
        upconvert_blocks(cache, bt, 0, bt, torch.zeros(1, 64, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="are not all in the block table"):
        upconvert_blocks(cache, bt, 1, bt, torch.zeros(1, 16, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kv_cache must be"):
        upconvert_blocks(cache[..., :576], bt, 0, bt, torch.zeros(1, 16, 576, dtype=torch.bfloat16))


@pytest.mark.parametrize("pair", [True, False])
def test_segmented_forward_against_float64(pair, monkeypatch):
    """Two decodes, a prompt that takes the workspace, a continuation against a long context that reads fp8, a
    second workspace prompt, then CUDA-graph padding rows: every real token equals float64 sparse attention over
    its own top-k of the dense rows; the workspace tokens equal the direct fp8 path within bf16 rounding."""
    numpy24_fix()
    g = torch.Generator().manual_seed(21 + pair)
    bs, nb, H, topk, scale = 16, 40, 3, 24, 0.09
    reqs = [(70, 1), (33, 1), (40, 20), (300, 3), (30, 18)]   # (seq_len, query_len), decodes first
    cache, exact = fp8_cache(g, nb, bs)
    cache[0] = 0xFF                                           # block 0 is owned by nobody: NaN bytes
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    width = max(-(-s // bs) for s, _ in reqs) + 1
    bt = torch.zeros(len(reqs), width, dtype=torch.int32)    # zero-padded like vLLM's
    for r, (s, _) in enumerate(reqs):
        n = -(-s // bs)
        bt[r, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    pos, req = [], []
    for r, (s, q) in enumerate(reqs):
        pos += list(range(s - q, s))
        req += [r] * q
    T, pad = len(pos), 3
    local = torch.full((T + pad + 4, topk), -1, dtype=torch.int32)
    chosen = []
    for t, p in enumerate(pos):
        sel = torch.randperm(p + 1, generator=g)[:topk]
        chosen.append(sel)
        local[t, : sel.numel()] = sel.to(torch.int32)
    local[T:T + pad] = torch.randint(0, 16, (pad, topk), generator=g, dtype=torch.int32)
    req_id = torch.tensor(req + [0] * (pad + 4), dtype=torch.int32)
    q = (torch.randn(T + pad, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    qsl = qsl_of([qq for _, qq in reqs])
    plan = ops.plan_fp8_prefill(qsl, torch.tensor([s for s, _ in reqs]), bs, capacity_blocks=8, min_query=16,
                                rows_per_token=8)
    assert [(s.tok_start, s.tok_end, s.ws_blocks) for s in plan] == [(0, 2, 0), (2, 22, 3), (22, 25, 0),
                                                                   (25, 43, 2)]
    ops._WORKSPACES.clear()
    poison = ops.fp8_workspace(8, bs, "cpu")
    poison.fill_(float("nan"))
    qin = (q[..., :512], q[..., 512:]) if pair else q
    out, lse = ops.sparse_mla_forward(qin, cache, local, req_id, bt, bs, scale, "fp8_ds_mla", segments=plan)
    direct, dlse = ops.sparse_mla_forward(qin, cache, local, req_id, bt, bs, scale, "fp8_ds_mla")
    assert out.shape == (T + pad, H, 512) and not out.isnan().any()
    for t, (p, r) in enumerate(zip(pos, req)):
        dense = torch.stack([exact.view(-1, 576)[int(bt[r, i // bs]) * bs + i % bs] for i in chosen[t].tolist()])
        s = q[t].double() @ dense.T * scale
        ref = torch.softmax(s, -1) @ dense[:, :512]
        err = ((out[t].double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (t, err)
        assert abs(lse[t].double() - torch.logsumexp(s, -1)).max() < 2e-2
    assert torch.equal(out[:2], direct[:2]) and torch.equal(out[22:25], direct[22:25])   # the fp8 segments
    assert torch.equal(out[T:], direct[T:])                                             # padding rows
    ws_rows = torch.cat([torch.arange(2, 22), torch.arange(25, 43)])
    assert ((out[ws_rows].float() - direct[ws_rows].float()).abs().max() <= 2 ** -6 * direct.float().abs().max())

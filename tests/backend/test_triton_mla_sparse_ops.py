"""The TRITON_MLA_SPARSE tensor work (overlay/triton_mla_sparse_ops.py) and its declarations,
without vLLM. The attention itself is a float32 torch stand-in defined here (test-only); the
kernel has its own tests."""

import math
from types import SimpleNamespace

import pytest
import torch

from overlay import triton_mla_sparse_ops as ops
from overlay.triton_mla_sparse import TritonMLASparseBackend


def loop_reference_convert(req_id, block_table, local, block_size):
    out = torch.full(local.shape, -1, dtype=torch.int32)
    for t in range(local.shape[0]):
        r = int(req_id[t])
        for j in range(local.shape[1]):
            pos = int(local[t, j])
            if pos < 0 or pos // block_size >= block_table.shape[1]:
                continue
            phys = int(block_table[r, pos // block_size])
            out[t, j] = phys * block_size + pos % block_size
    return out


def test_req_id_per_token():
    qsl = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)
    assert ops.req_id_per_token(qsl).tolist() == [0, 0, 0, 2, 2, 2, 2, 3]
    assert ops.req_id_per_token(qsl).dtype == torch.int32
    assert ops.req_id_per_token(torch.tensor([0])).numel() == 0


@pytest.mark.parametrize("block_size, topk", [(64, 200), (64, 256), (16, 37), (1, 5)])
def test_convert_matches_loop(block_size, topk):
    g = torch.Generator().manual_seed(block_size * 1000 + topk)
    num_reqs, max_blocks, pool = 5, 7, 64
    # a column slice of a wider buffer: non-contiguous rows, like vLLM's persistent block table
    wide = torch.randperm(pool, generator=g)[: num_reqs * (max_blocks + 3)]
    block_table = wide.to(torch.int32).view(num_reqs, max_blocks + 3)[:, :max_blocks]
    assert not block_table.is_contiguous()
    qsl = torch.tensor([0, 1, 4, 4, 9, 10])
    req_id = ops.req_id_per_token(qsl)
    T = req_id.numel()
    # positions inside and beyond the block table, plus -1 padding and other negatives
    local = torch.randint(-3, max_blocks * block_size + 2 * block_size, (T, topk), generator=g)
    local[:, -1] = -1
    local = local.to(torch.int32)
    got = ops.convert_req_index_to_global(req_id, block_table, local, block_size)
    want = loop_reference_convert(req_id, block_table, local, block_size)
    assert got.dtype == torch.int32 and got.shape == (T, topk)
    assert torch.equal(got, want)
    assert (got[:, -1] == -1).all()


def test_convert_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="do not match 3 tokens"):
        ops.convert_req_index_to_global(
            torch.zeros(3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
            torch.zeros(4, 8, dtype=torch.int32), 64,
        )


def test_kv_slots_checks_and_never_copies():
    bf16 = torch.randn(3, 64, 576).to(torch.bfloat16)
    assert ops.kv_slots(bf16, "bf16") is bf16
    fp8 = torch.zeros(3, 64, 656, dtype=torch.uint8)
    v = ops.kv_slots(fp8, "fp8_ds_mla")
    assert v.dtype == torch.uint8 and v.data_ptr() == fp8.data_ptr() and v.shape == fp8.shape
    as_fp8 = fp8.view(torch.float8_e4m3fn)  # vLLM may hand the cache in an fp8 dtype
    assert ops.kv_slots(as_fp8, "fp8_ds_mla").dtype == torch.uint8
    # strided blocks (a cross-layer allocation) pass through untouched
    strided = torch.zeros(64, 3, 576, dtype=torch.bfloat16).transpose(0, 1)
    assert ops.kv_slots(strided, "bf16") is strided
    with pytest.raises(ValueError, match="656"):
        ops.kv_slots(torch.zeros(3, 64, 576, dtype=torch.uint8), "fp8_ds_mla")
    with pytest.raises(ValueError, match="bfloat16"):
        ops.kv_slots(torch.zeros(3, 64, 576, dtype=torch.float16), "bf16")
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ops.kv_slots(torch.zeros(3, 576, 64, dtype=torch.bfloat16).transpose(1, 2), "bf16")
    with pytest.raises(ValueError, match="1-byte"):
        ops.kv_slots(torch.zeros(3, 64, 656, dtype=torch.bfloat16), "fp8_ds_mla")


def test_kv_format_for():
    assert ops.kv_format_for("auto") == "bf16" and ops.kv_format_for("bfloat16") == "bf16"
    assert ops.kv_format_for("fp8_ds_mla") == "fp8_ds_mla"
    with pytest.raises(ValueError, match="'fp8'"):
        ops.kv_format_for("fp8")


def fp32_sparse_mla_standin(q, kv, indices, softmax_scale, kv_format="bf16"):
    """Test-only float32 stand-in with the kernel's contract (bf16 cache only)."""
    assert kv_format == "bf16"
    kv = kv.reshape(-1, kv.shape[-1])
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512)
    lse = torch.full((T, H), -math.inf)
    for t in range(T):
        idx = indices[t].long()
        idx = idx[(idx >= 0) & (idx < kv.shape[0])]
        if idx.numel() == 0:
            continue
        k = kv[idx].float()
        s = q[t].float() @ k.T * softmax_scale
        lse[t] = torch.logsumexp(s, dim=-1)
        out[t] = torch.softmax(s, dim=-1) @ k[:, :512]
    return out.to(torch.bfloat16), lse


@pytest.mark.parametrize("seed", [7, 8, 9], ids=lambda s: f"seed={s}")
def test_forward_end_to_end_against_dense_attention(seed):
    """Paged cache + request-local top-k through sparse_mla_forward equals attention over the
    chosen tokens of each request, computed from the requests' own (unpaged) KV."""
    g = torch.Generator().manual_seed(seed)
    block_size, H, topk = 16, 3, 11
    seq_lens = [20, 5, 33]
    num_blocks = 12
    blocks = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_table = torch.full((3, 3), 0, dtype=torch.int32)
    cache = torch.zeros(num_blocks, block_size, 576, dtype=torch.bfloat16)
    req_kv, used = [], 0
    for r, L in enumerate(seq_lens):
        nb = -(-L // block_size)
        block_table[r, :nb] = blocks[used : used + nb]
        used += nb
        kv = torch.randn(L, 576, generator=g).to(torch.bfloat16)
        req_kv.append(kv)
        for p in range(L):
            cache[block_table[r, p // block_size], p % block_size] = kv[p]
    # one decode token for req 0, a 2-token chunk for req 1, a 3-token chunk for req 2
    qsl = torch.tensor([0, 1, 3, 6])
    req_id = ops.req_id_per_token(qsl)
    T = 6
    local = torch.full((T + 4, topk), -1, dtype=torch.int32)  # buffer wider than the batch
    for t in range(T):
        r = int(req_id[t])
        n = min(topk - 2, seq_lens[r])
        local[t, :n] = torch.randperm(seq_lens[r], generator=g)[:n].to(torch.int32)
    local[5, :] = -1  # a token whose indexer found nothing: output 0
    ql_nope = torch.randn(T, H, 512, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(T, H, 64, generator=g).to(torch.bfloat16)
    scale = 576 ** -0.5
    out, lse = ops.sparse_mla_forward(
        (ql_nope, q_pe), cache, local, req_id, block_table, block_size, scale, "bf16",
        attention=fp32_sparse_mla_standin,
    )
    q = torch.cat([ql_nope, q_pe], -1).float()
    for t in range(T):
        r = int(req_id[t])
        sel = local[t][local[t] >= 0].long()
        if sel.numel() == 0:
            assert (out[t] == 0).all() and torch.isinf(lse[t]).all()
            continue
        k = req_kv[r][sel].float()
        p = torch.softmax(q[t] @ k.T * scale, -1)
        # The stand-in's only error is rounding its float32 result to bfloat16: at most 2^-8 relative (measured
        # 3.89e-3 over seeds 7-60: the bound itself; never beyond it), atol only for float32 noise near 0.
        torch.testing.assert_close(out[t].float(), p @ k[:, :512], atol=1e-6, rtol=2 ** -8)


def test_backend_declarations_without_vllm():
    B = TritonMLASparseBackend
    cc = lambda a, b: SimpleNamespace(major=a, minor=b)  # noqa: E731
    for ok in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1)]:
        assert B.supports_compute_capability(cc(*ok))
    assert not B.supports_compute_capability(cc(7, 5))
    assert B.get_name() == "TRITON_MLA_SPARSE" and B.is_sparse() and B.is_mla()
    assert B.get_supported_head_sizes() == [576]
    assert B.supported_kv_cache_dtypes == ["auto", "bfloat16", "fp8_ds_mla"]
    assert B.get_kv_cache_shape(10, 64, 1, 576, "fp8_ds_mla") == (10, 64, 656)
    assert B.get_kv_cache_shape(10, 64, 1, 576, "auto") == (10, 64, 576)
    assert B.get_supported_kernel_block_sizes() == [64]


def test_sparse_bases_follow_the_installed_vllm():
    """Without vLLM the bases are placeholders; the 0.26+ bases are chosen by the module's presence (a missing
    parent package counts as absent), so an import error inside an existing module is never swallowed."""
    from overlay import triton_mla_sparse as tms

    assert not tms.HAVE_VLLM and not tms.SHARED_SPARSE_BASES
    assert tms._has_module("json.decoder") and not tms._has_module("json.no_such_module")
    assert not tms._has_module("no_such_package.sparse_mla_attention")
    assert tms.SPARSE_COMMON_MODULE.endswith("layers.attention.sparse_mla_attention")


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_forward_default_kernel_path_equals_converting_first(kv_format):
    """The backend's own call (no `attention`): the Triton kernel (interpreted here) gets the (q_nope, q_pe)
    pair and the request-local top-k with the block table, and must give bit for bit what the same kernel
    gives on the concatenated q and the slot ids of `convert_req_index_to_global`."""
    from overlay.kernels import sparse_mla as SM
    from tools.triton_interp import numpy24_fix

    numpy24_fix()
    assert SM.INTERPRETED  # tests/conftest.py: CPU, Triton's interpreter
    g = torch.Generator().manual_seed(12)
    block_size, num_blocks, T, H, topk = 16, 6, 5, 3, 23
    width = 576 if kv_format == "bf16" else 656
    if kv_format == "bf16":
        cache = torch.randn(num_blocks, block_size, width, generator=g).to(torch.bfloat16)
    else:  # random e4m3 bytes (no NaN pattern), positive scales, bf16 rope
        cache = torch.randint(0, 0x70, (num_blocks, block_size, width), generator=g, dtype=torch.uint8)
        cache[..., 512:528] = torch.rand(num_blocks, block_size, 4, generator=g).add(0.5).view(torch.uint8) \
            .view(num_blocks, block_size, 16)
        cache[..., 528:] = torch.randn(num_blocks, block_size, 64, generator=g).to(torch.bfloat16) \
            .view(torch.uint8).view(num_blocks, block_size, 128)
    block_table = torch.tensor([[3, 1, 5], [0, 4, -1]], dtype=torch.int32)
    req_id = torch.tensor([0, 0, 1, 1, 0, 1, 1], dtype=torch.int32)  # longer than the batch
    local = torch.randint(-2, 3 * block_size + 4, (T + 2, topk), generator=g, dtype=torch.int32)
    ql_nope = torch.randn(T, H, 512, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(T, H, 64, generator=g).to(torch.bfloat16)
    out, lse = ops.sparse_mla_forward((ql_nope, q_pe), cache, local, req_id, block_table, block_size, 0.07,
                                      kv_format)
    slots = ops.convert_req_index_to_global(req_id[:T], block_table, local[:T], block_size)
    assert (slots < 0).any() and (slots >= 0).any()
    want_o, want_l = SM.sparse_mla_attention(torch.cat([ql_nope, q_pe], -1), cache, slots, 0.07, kv_format)
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    assert torch.isfinite(want_l).any()

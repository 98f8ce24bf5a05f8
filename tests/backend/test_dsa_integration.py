"""TRITON_MLA_SPARSE inside a real (patched) vLLM on CPU, end to end on one mixed batch, against a
dense float32/float64 reference of DeepSeek sparse attention that never looks at the paged cache.

What runs is what serves on a GPU: the real metadata builder and impl of the overlay's backend,
vLLM's own `CommonAttentionMetadata`, the real Triton kernels (sparse MLA; indexer logits) under
Triton's CPU interpreter, and vLLM 0.23.0's own helpers where it has torch versions of the CUDA
steps (`_topk_indices_torch`: the contract of `top_k_per_row_prefill`). The batch mixes two decodes, a chunked-prefill continuation whose
positions cross the top-k width, and a fresh prefill; block tables are shuffled physical blocks;
cache slots no request owns hold NaN, so any wrong slot read shows.

The reference builds each request's sequence densely (position p of request r is row p of a plain
tensor), scores positions 0..p itself and selects its own top-k, then attends over the selected rows.
"""

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests import vllm_envs

TOOLS = Path(__file__).resolve().parents[2] / "tools"  # shared interpreter fix and fp8_ds_mla codec


@pytest.fixture(scope="module", params=["0.23.0"])
def staged(request, tmp_path_factory):
    return vllm_envs.patched_site(request.param, tmp_path_factory.mktemp(f"vllm{request.param}"))


def run_json(staged, code, timeout=600):
    python, root, env = staged
    env = dict(env, TRITON_INTERPRET="1")
    prelude = PRELUDE.replace("@TOOLS@", str(TOOLS))
    proc = subprocess.run([str(python), "-c", textwrap.dedent(prelude + code)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(root))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PRELUDE = """
import json, math, types
import torch

import importlib.util, sys

def _load(name, path):
    # the repository's shared helpers (tools/), by path (the venv's site-packages may hold an unrelated `tests`)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

_load("_dsa_interp", "@TOOLS@/triton_interp.py").numpy24_fix()
quantize_fp8_ds_mla = _load("_dsa_fp8_codec", "@TOOLS@/fp8_ds_mla_codec.py").quantize_fp8_ds_mla

BS = 64

def scenario(seed, reqs, num_blocks):
    '''reqs: [(seq_len, query_len)], decodes first. -> dict with block table (shuffled physical
    blocks, zero-padded like vLLM's), query_start_loc, positions and request of every token.'''
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // BS) for s, _ in reqs]
    perm = torch.randperm(num_blocks, generator=g)[: sum(need)].tolist()
    width = max(need) + 1
    bt = torch.zeros(len(reqs), width, dtype=torch.int32)
    owned = []
    for r, n in enumerate(need):
        bt[r, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        owned += perm[:n]
        perm = perm[n:]
    qsl = [0]
    pos, req = [], []
    for r, (s, q) in enumerate(reqs):
        qsl.append(qsl[-1] + q)
        pos += list(range(s - q, s))
        req += [r] * q
    slots = [int(bt[r, p // BS]) * BS + p % BS for p, r in zip(pos, req)]
    return dict(g=g, reqs=reqs, bt=bt, qsl=torch.tensor(qsl, dtype=torch.int32),
                pos=pos, req=req, slots=torch.tensor(slots, dtype=torch.int64), owned=owned)

def latent_cache(sc, kv_format, num_blocks):
    '''Random latent KV rows (576 wide) for every position of every request of the scenario, written
    into a paged cache whose other slots are NaN. -> (cache, per request: the rows as the cache holds
    them, float64, for the dense reference)'''
    dense = [torch.randn(s, 576, generator=sc["g"]) for s, _ in sc["reqs"]]
    if kv_format == "bf16":
        cache = torch.full((num_blocks, BS, 576), float("nan"), dtype=torch.bfloat16)
        exact = [d.to(torch.bfloat16).double() for d in dense]
        rows = [d.to(torch.bfloat16) for d in dense]
    else:
        cache = torch.full((num_blocks, BS, 656), 0xFF, dtype=torch.uint8)   # NaN bytes
        enc = [quantize_fp8_ds_mla(d) for d in dense]
        rows = [e[0] for e in enc]
        exact = [e[1] for e in enc]
    for r, (s, _) in enumerate(sc["reqs"]):
        for p in range(s):
            cache[int(sc["bt"][r, p // BS]), p % BS] = rows[r][p]
    return cache, exact
"""


ATTENTION = """
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm._dsa_overlay import triton_mla_sparse as tms
from vllm._dsa_overlay.kernels import sparse_mla as K

assert type(K._sparse_mla_fwd_kernel).__name__ == "InterpretedFunction"

H, TOPK, NUM_BLOCKS = 3, 40, 12
SCALE = (192 + 64) ** -0.5 * 1.37   # qk_head_dim**-0.5 times a yarn-like mscale, not 576**-0.5
results = {}
# fp8_ds_mla+ws: the two prefills read a bf16 copy of their context (the workspace plan, its query-length floor
# lowered to fit this batch); fp8_ds_mla: every token reads the fp8 cache (no request reaches the default floor)
for name, kv_format, kv_dtype, ws_min_query in (("bf16", "bf16", "auto", None),
                                                 ("fp8_ds_mla", "fp8_ds_mla", "fp8_ds_mla", None),
                                                 ("fp8_ds_mla+ws", "fp8_ds_mla", "fp8_ds_mla", 16)):
    if ws_min_query:
        tms.ops.FP8_WS_MIN_QUERY = ws_min_query
    # two decodes, a chunked-prefill continuation crossing TOPK, a fresh prefill shorter than TOPK
    sc = scenario(11, [(150, 1), (97, 1), (140, 40), (20, 20)], NUM_BLOCKS)
    g = sc["g"]
    T = len(sc["pos"])
    cache, exact = latent_cache(sc, kv_format, NUM_BLOCKS)

    # the indexer's output: request-local positions <= p, best first, -1 padded (top_k_per_row)
    buf = torch.full((64, TOPK), -7, dtype=torch.int32)     # rows past T: garbage, never read
    chosen = []
    for t, (p, r) in enumerate(zip(sc["pos"], sc["req"])):
        score = torch.rand(p + 1, generator=g)
        sel = torch.argsort(score, descending=True)[:TOPK]
        chosen.append(sel)
        buf[t] = -1
        buf[t, : sel.numel()] = sel.to(torch.int32)

    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(index_topk=TOPK)),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64),
        speculative_config=None,
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
    builder = tms.TritonMLASparseMetadataBuilder(types.SimpleNamespace(block_size=BS), ["l0"], cfg,
                                                 torch.device("cpu"))
    seq_lens = torch.tensor([s for s, _ in sc["reqs"]], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=sc["qsl"], query_start_loc_cpu=sc["qsl"], seq_lens=seq_lens,
        num_reqs=len(sc["reqs"]), num_actual_tokens=T, max_query_len=40, max_seq_len=150,
        block_table_tensor=sc["bt"], slot_mapping=sc["slots"])
    md = builder.build(0, cm)
    indexer = types.SimpleNamespace(topk_indices_buffer=buf)
    impl = tms.TritonMLASparseImpl(H, 576, SCALE, 1, None, None, kv_dtype, None, "decoder", None,
                                   indexer=indexer, kv_lora_rank=512, topk_indices_buffer=buf)
    q = (torch.randn(T, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    out, _ = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, md, None)
    # a GLM-5.2 layer without an indexer (index_topk_freq > 1) reads the shared buffer vLLM passes
    shared = tms.TritonMLASparseImpl(H, 576, SCALE, 1, None, None, kv_dtype, None, "decoder", None,
                                     indexer=None, kv_lora_rank=512, topk_indices_buffer=buf)
    indexerless = torch.equal(shared.forward_mqa((q[..., :512], q[..., 512:]), cache, md, None)[0], out)

    errs, worst = [], 0.0
    for t, (p, r) in enumerate(zip(sc["pos"], sc["req"])):
        k = exact[r][chosen[t]]                             # dense rows, never the paged cache
        ref = torch.softmax(q[t].double() @ k.T * SCALE, -1) @ k[:, :512]
        err = ((out[t].double() - ref).abs().max() / ref.abs().max()).item()
        errs.append(err)
    results[name] = dict(max_rel=max(errs), nan=bool(out.isnan().any()), shape=list(out.shape),
                         indexerless=indexerless, worst_token=int(max(range(T), key=lambda i: errs[i])),
                         segments=[(s.tok_start, s.tok_end, s.ws_blocks) for s in md.fp8_segments or []])
print(json.dumps(results))
"""


def test_backend_mixed_batch_vs_dense_reference(staged):
    """Decodes + chunked prefill + fresh prefill, shuffled blocks, bf16 and fp8_ds_mla caches, real
    builder/impl/kernel: every token equals dense sparse attention over its own top-k positions; a layer
    without an indexer (GLM-5.2) gives the same through the shared top-k buffer."""
    out = run_json(staged, ATTENTION)
    for fmt in ("bf16", "fp8_ds_mla", "fp8_ds_mla+ws"):
        assert not out[fmt]["nan"], out
        assert out[fmt]["shape"] == [62, 3, 512] and out[fmt]["indexerless"], out
        # bf16 output rounding (2^-8 relative) plus bf16 probabilities inside the kernel
        assert out[fmt]["max_rel"] < 2e-2, out
    assert out["bf16"]["segments"] == out["fp8_ds_mla"]["segments"] == [], out
    # decodes from the fp8 cache, both prefills (3 + 1 blocks of context) from one workspace segment
    assert out["fp8_ds_mla+ws"]["segments"] == [[0, 2, 0], [2, 62, 4]], out


INDEXER = """
from vllm.v1.attention.ops.rocm_aiter_mla_sparse import _topk_indices_torch
from vllm._dsa_overlay import indexer_ops as ix
from vllm._dsa_overlay.kernels import indexer as KI

HI, D, TOPK, NUM_BLOCKS, MAX_MODEL_LEN = 4, 128, 40, 12, 320
reqs = [(150, 1), (97, 1), (140, 40), (20, 20)]     # 2 decodes, continuation, fresh prefill
sc = scenario(5, reqs, NUM_BLOCKS)
g = sc["g"]
T = len(sc["pos"])
nd = 2

def quant(k):   # ue8m0 per-token scale, e4m3 values (vLLM's indexer_k_quant_and_cache rule)
    s = k.abs().amax(-1).clamp_min(1e-4) / 448.0
    s = torch.exp2(torch.ceil(torch.log2(s)))
    return (k / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), s.float()

keys = [torch.randn(s, D, generator=g).to(torch.bfloat16) for s, _ in reqs]
qk = [quant(k.float()) for k in keys]
cache = torch.full((NUM_BLOCKS, BS, D + 4), 0xFF, dtype=torch.uint8)   # NaN bytes everywhere
for r, (s, _) in enumerate(reqs):                                    # context + this step's keys
    slots = torch.tensor([int(sc["bt"][r, p // BS]) * BS + p % BS for p in range(s)])
    KI.indexer_k_quant_and_cache_ref(keys[r], cache, slots, D, "ue8m0")
q = (torch.randn(T, HI, D, generator=g) * 2).to(torch.float8_e4m3fn)
w = torch.randn(T, HI, generator=g)
seq_lens = torch.tensor([s for s, _ in reqs], dtype=torch.int32)

local = torch.full((T, TOPK), -1, dtype=torch.int32)
# decode: vLLM 0.23.0 passes (q [B, 1, H, D], None), cache.unsqueeze(-2), seq_lens [B, 1]
logits = ix.fp8_fp4_paged_mqa_logits(
    (q[:nd].view(nd, 1, HI, D), None), cache.unsqueeze(-2), w[:nd], seq_lens[:nd].unsqueeze(-1),
    sc["bt"][:nd], torch.zeros(5, 2, dtype=torch.int32), MAX_MODEL_LEN, False)
col = torch.arange(MAX_MODEL_LEN)
visible = col[None, :] < seq_lens[:nd, None]                  # what top_k_per_row_decode reads
local[:nd] = _topk_indices_torch(logits.masked_fill(~visible, float("-inf")), TOPK)
# prefill: one chunk holding both prefill requests. ks/ke as vLLM 0.23.0's
# _build_prefill_chunk_metadata_kernel writes them (a Triton kernel vLLM will not launch without a
# GPU driver): ks = the request's first row in the chunk's concatenated keys, ke = ks + position + 1
starts = [0, reqs[nd][0]]
ks_l, ke_l = [], []
for i, (s, ql) in enumerate(reqs[nd:]):
    for j in range(ql):
        ks_l.append(starts[i]); ke_l.append(starts[i] + s - ql + j + 1)
chunk = types.SimpleNamespace(cu_seqlen_ks=torch.tensor(ks_l, dtype=torch.int32),
                              cu_seqlen_ke=torch.tensor(ke_l, dtype=torch.int32),
                              token_start=int(sc["qsl"][nd]), token_end=T)
kq = torch.cat([qk[r][0] for r in range(nd, len(reqs))])      # what cp_gather_indexer_k_quant_cache
ks_ = torch.cat([qk[r][1] for r in range(nd, len(reqs))])     # writes: each request's keys 0..s-1
sl = slice(chunk.token_start, chunk.token_end)
logits = ix.fp8_fp4_mqa_logits((q[sl], None), (kq, ks_), w[sl], chunk.cu_seqlen_ks,
                               chunk.cu_seqlen_ke, False)
n = torch.arange(logits.shape[1])
visible = (n[None, :] >= chunk.cu_seqlen_ks[:, None]) & (n[None, :] < chunk.cu_seqlen_ke[:, None])
local[sl] = _topk_indices_torch(logits.masked_fill(~visible, float("-inf")), TOPK,
                                row_starts=chunk.cu_seqlen_ks)

bad = []
for t, (p, r) in enumerate(zip(sc["pos"], sc["req"])):
    kd = qk[r][0][: p + 1].double() * qk[r][1][: p + 1].double()[:, None]
    ref = ((q[t].double() @ kd.T).clamp_min(0) * w[t].double()[:, None]).sum(0)
    k = min(TOPK, p + 1)
    thr = torch.sort(ref, descending=True).values[k - 1]   # ties at the threshold (ReLU zeros) may
    must = set(torch.nonzero(ref > thr).flatten().tolist())  # go either way; nothing else may
    got = local[t][local[t] >= 0].tolist()
    ok = (len(got) == k == len(set(got)) and must <= set(got)
          and all(0 <= i <= p and ref[i] >= thr for i in got))
    if not ok:
        bad.append([t, p, r, len(got), k, sorted(must - set(got))[:5]])
print(json.dumps({"bad": bad, "ks": chunk.cu_seqlen_ks.tolist()[:3] + chunk.cu_seqlen_ks.tolist()[-3:],
                  "ke": chunk.cu_seqlen_ke.tolist()[:3] + chunk.cu_seqlen_ke.tolist()[-3:],
                  "rows": T}))
"""


def test_indexer_path_selects_the_dense_topk(staged):
    """The Triton indexer logits called exactly as vLLM 0.23.0's sparse_attn_indexer calls them
    (decode: paged cache + [B, 1] context lengths; prefill: a two-request chunk laid out like vLLM's
    prefill chunk metadata, the second request starting at ks > 0), fed to the top-k contract,
    give every token the top-k set of a dense float64 scoring of positions 0..p of its request."""
    out = run_json(staged, INDEXER)
    assert out["bad"] == [], out
    assert out["ks"][-1] > 0 and out["rows"] == 62

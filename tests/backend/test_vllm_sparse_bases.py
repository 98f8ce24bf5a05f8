"""vLLM 0.26.0 and later (0.26.0, 0.28.0, 0.31.0, 0.33.0: a venv per family) patched on CPU (hard-linked copies of the
real venvs, tests/vllm_envs.py): the patch set's hooks import and reach the overlay, and TRITON_MLA_SPARSE runs on the
sparse bases these releases share (`SparseMLACommonMetadataBuilder` / `SparseMLACommonImpl`) through the REAL builder
and impl, kernels in the Triton interpreter, against a dense float64 reference that never reads the paged cache.

0.26's MLAAttention.forward_impl sends the first `num_decode_tokens` tokens to `forward_mqa` and, when
`prefill_max_seq_len <= topk_tokens` and a dense prefill backend exists, the prefills to dense MHA;
otherwise every token to `forward_mqa`. The tests build the metadata with the real builder and feed
`forward_mqa` exactly those slices; a stand-in prefill backend receives the dense-MHA prefill metadata
the shared builder makes (the dense-MHA prefill itself is upstream's CUDA code: GPU only). 0.27.0 adds a masked-MHA
prefill to the same bases for sm_100 with FlashAttention 4 only (`_is_masked_mha_available`); elsewhere its split is
0.26's. 0.30 adds `decode_max_query_len` to the metadata, 0.31 index groups (the impl registers with the group of
its top-k buffer; upstream converts indices once per group, the Triton kernel converts them itself), 0.32 a Triton
token-to-request kernel in the builder (run by the interpreter here).

From 0.29.0 vLLM serves DeepSeek-V3.2 / GLM-5 on CUDA from `vllm/models/deepseek_v32/nvidia/`, whose Triton kernels
store fp8 (sm_89+ only): the hook routes sm_80/86 to the generic deepseek_v2 classes (test_dsa_model_module_by_capability).

The venvs from 0.28.0 on hold torch 2.13.0's CPU build (the wheel this machine serves; .ci/run; 0.33.0 pins 2.14.0,
see manifest.VENV_TORCH_SUBSTITUTE), without the libtorch_cuda.so / libc10_cuda.so vLLM's CUDA extensions link
against: the stub directory (dsa_installer/cudastub.py) supplies both there, so `vllm.platforms.cuda` imports as with
a CUDA torch.
"""

import pytest

from tests import vllm_envs
from tests.backend.test_dsa_integration import run_json

VERSIONS = ("0.26.0", "0.28.0", "0.31.0", "0.33.0")


@pytest.fixture(scope="module", params=VERSIONS)
def staged(request, tmp_path_factory):
    return vllm_envs.patched_site(request.param, tmp_path_factory.mktemp(f"vllm{request.param}"))


def test_hooks_reach_the_overlay(staged, request):
    """Registry entry, selection hook, indexer hooks and the fused indexer-q gate, in the patched release."""
    out = run_json(staged, """
import inspect
import vllm.model_executor.layers.sparse_attn_indexer as sai
import vllm.model_executor.models.deepseek_v2 as dsv2
import vllm.v1.attention.backends.mla.indexer as mix
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl, SparseMLACommonMetadataBuilder)
from vllm._dsa_overlay import triton_mla_sparse as tms, indexer_ops as ix
import vllm.platforms.cuda as cuda
B = E["TRITON_MLA_SPARSE"].get_class()
print(json.dumps({
    "backend": B.get_name(), "shared": tms.SHARED_SPARSE_BASES,
    "impl_base": issubclass(B.get_impl_cls(), SparseMLACommonImpl),
    "builder_base": issubclass(B.get_builder_cls(), SparseMLACommonMetadataBuilder),
    "ix": sai._dsa_ix.__name__,
    "select_hook": "_dsa_selection.vllm_select" in inspect.getsource(cuda.CudaPlatformBase.get_attn_backend_cls),
    "cpu_torch": torch.__version__.endswith("+cpu"),
    "meta_hook": "_dsa_ix.fill_paged_mqa_logits_metadata" in inspect.getsource(mix),
    "gate_hook": "_dsa_ix.fused_q_quant_supported()" in inspect.getsource(dsv2.Indexer.__init__),
    "gate": [ix.triton_fp8_store_supported(c) for c in ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0))],
}))
""")
    # 0.28.0 on, torch's CPU build: the stub libtorch_cuda.so made vllm.platforms.cuda importable above
    assert out.pop("cpu_torch") == (request.node.callspec.params["staged"] != "0.26.0")
    assert out == {"backend": "TRITON_MLA_SPARSE", "shared": True, "impl_base": True, "builder_base": True,
                   "ix": "vllm._dsa_overlay.indexer_ops", "select_hook": True, "meta_hook": True,
                   "gate_hook": True, "gate": [False, False, True, True, True]}


def test_later_hooks_reach_the_overlay(staged, request):
    """0.29.0+: the model-module hook; 0.32.0+: the draft-decode schedule hook (a second DeepGEMM call upstream);
    0.33.0: the row-compressed prefill logits call. Each present exactly from its release on, and nothing of
    DeepGEMM's left on those paths."""
    version = vllm_envs.release(request.node.callspec.params["staged"])
    out = run_json(staged, """
import inspect
import vllm.model_executor.layers.sparse_attn_indexer as sai
import vllm.v1.attention.backends.mla.indexer as mix
from vllm._dsa_overlay import verify_hooks as vh
src_ix, src_sai = inspect.getsource(mix), inspect.getsource(sai.sparse_attn_indexer)
models, problems = vh.model_module_report()
print(json.dumps({
    "model_hook": bool(models) and not problems,
    "schedule_hooks": src_ix.count("_dsa_ix.fill_paged_mqa_logits_metadata("),
    "deep_gemm_schedule_calls": src_ix.count("= get_paged_mqa_logits_metadata("),
    "compressed_hook": "_dsa_ix.fp8_fp4_mqa_logits_compressed(" in src_sai,
    "upstream_logits_calls": src_sai.count(" fp8_fp4_mqa_logits(") + src_sai.count(" fp8_fp4_paged_mqa_logits("),
}))
""")
    assert out == {"model_hook": version >= (0, 29, 0),
                   "schedule_hooks": 2 if version >= (0, 32, 0) else 1,
                   "deep_gemm_schedule_calls": 0,
                   "compressed_hook": version >= (0, 33, 0),
                   "upstream_logits_calls": 0}, out


MODEL_MODULE = """
import sys, types
import vllm.platforms as P
from vllm._dsa_overlay.verify_hooks import _platform_at
P._current_platform = _platform_at(CAP)()
# Upstream's CUDA module imports FlashInfer and cuteDSL kernels that need a GPU: stand-ins record that the CUDA
# branch was taken (this test is about which branch, not about that module).
sentinels = {}
for name, classes in ((".nvidia.model", ("DeepseekV32ForCausalLM",)), (".nvidia.mtp", ("DeepseekV32MTP",))):
    mod = types.ModuleType("vllm.models.deepseek_v32" + name)
    for c in classes:
        setattr(mod, c, type(c, (), {}))
        sentinels[c] = getattr(mod, c)
    sys.modules[mod.__name__] = mod
import vllm.models.deepseek_v32 as m
import vllm.model_executor.models.deepseek_v2 as v2
print(json.dumps({"cuda_module": m.GlmMoeDsaForCausalLM is sentinels["DeepseekV32ForCausalLM"],
                  "generic": m.GlmMoeDsaForCausalLM is v2.GlmMoeDsaForCausalLM
                             and m.DeepseekV32ForCausalLM is v2.DeepseekV3ForCausalLM,
                  "mtp_generic": m.DeepseekV32MTP.__module__ == "vllm.model_executor.models.deepseek_mtp"}))
"""


@pytest.mark.parametrize("version", [v for v in VERSIONS if vllm_envs.release(v) >= (0, 29, 0)])
@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)])
def test_dsa_model_module_by_capability(version, cap, tmp_path_factory):
    """0.29.0+ serves DeepSeek-V3.2 / GLM-5 from `vllm/models/deepseek_v32/nvidia/` on CUDA, whose Triton kernels
    store fp8 (Triton refuses that below sm_89): with the hook, sm_80/86 get the generic deepseek_v2 classes (and
    the generic MTP), sm_89+ keep upstream's CUDA module."""
    out = run_json(vllm_envs.shared_site(version, tmp_path_factory), MODEL_MODULE.replace("CAP", repr(cap)))
    cuda = cap >= (8, 9)
    assert out == {"cuda_module": cuda, "generic": not cuda, "mtp_generic": not cuda}, (cap, out)


# vLLM's own Triton kernels in the interpreter (0.32+'s builder maps tokens to requests with one; 0.29+'s CUDA model
# module writes its caches with them): vLLM disables Triton where it finds no active GPU driver (placeholders instead
# of triton.jit), so its modules are given the real Triton before they import (TRITON_INTERPRET=1 runs it here).
VLLM_REAL_TRITON = """
import triton, triton.language
import vllm.triton_utils as triton_utils
if not triton_utils.HAS_TRITON:
    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, triton.language, True
"""

BACKEND = VLLM_REAL_TRITON + """
import vllm.utils.torch_utils as torch_utils
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm._dsa_overlay import triton_mla_sparse as tms
from vllm._dsa_overlay.kernels import sparse_mla as K

# The shared builder pins host memory (PIN_MEMORY; pin_memory=True in build_mla_chunked_context_metadata):
# no driver to pin it with on this machine, so pinning is dropped; nothing else changes.
torch_utils.PIN_MEMORY = False
for _name in ("empty", "zeros", "tensor"):   # tensor: 0.32 pins the chunked-context lengths
    def _unpinned(*a, _f=getattr(torch, _name), pin_memory=False, **kw):
        return _f(*a, **kw)
    setattr(torch, _name, _unpinned)

# 0.27's impl reads the tensor-parallel size (an engine initialises that group; one process here: TP 1).
import vllm.model_executor.layers.attention.sparse_mla_attention as _sma
if hasattr(_sma, "get_tensor_model_parallel_world_size"):
    _sma.get_tensor_model_parallel_world_size = lambda: 1
# 0.31's impl registers its layer with the index group of the shared top-k buffer, reading the engine's config
# (set in context by an engine): the stand-in config below, host-offloaded sparse KV off.
if hasattr(_sma, "get_current_vllm_config"):
    _sma.get_current_vllm_config = lambda: vllm_config(PrefillBackend())

assert type(K._sparse_mla_fwd_kernel).__name__ == "InterpretedFunction"
assert tms.SHARED_SPARSE_BASES

H, TOPK, NUM_BLOCKS = 3, 40, 12
SCALE = (192 + 64) ** -0.5 * 1.37

class PrefillBackend:   # stands in for the CUDA dense-MHA prefill backend the layer holds on a GPU
    def __init__(self):
        self.prepared = []
    def clone(self):
        return self
    def prepare_metadata(self, prefill):
        self.prepared.append(prefill)

def vllm_config(prefill_backend):
    hf = types.SimpleNamespace(index_topk=TOPK, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
                               v_head_dim=256, q_lora_rank=None)
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16,
                                           max_model_len=320,
                                           model_arch_config=types.SimpleNamespace(total_num_attention_heads=H)),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=8),
        cache_config=types.SimpleNamespace(block_size=BS, cache_dtype="auto"),
        speculative_config=None,
        attention_config=types.SimpleNamespace(sparse_mla_force_mqa=False,   # 0.27: dense MHA unless forced off
                                               hisparse_config=None),   # 0.32: host-offloaded sparse KV off
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                              cp_kv_cache_interleave_size=1),
        compilation_config=types.SimpleNamespace(
            static_forward_context={"l0": types.SimpleNamespace(prefill_backend=prefill_backend)}))

def impl(kv_dtype, **kw):
    return tms.TritonMLASparseImpl(
        H, 576, SCALE, 1, None, None, kv_dtype, None, "decoder", None,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, qk_head_dim=256,
        v_head_dim=256, kv_b_proj=None, **kw)

def run(seed, reqs, kv_format, layer, ws_min_query=64):
    kv_dtype = "auto" if kv_format == "bf16" else "fp8_ds_mla"
    tms.ops.FP8_WS_MIN_QUERY = ws_min_query   # lowered: this batch's prefills read a bf16 copy of their context
    sc = scenario(seed, reqs, NUM_BLOCKS)
    g = sc["g"]
    T = len(sc["pos"])
    cache, exact = latent_cache(sc, kv_format, NUM_BLOCKS)
    buf = torch.full((64, TOPK), -7, dtype=torch.int32)     # the indexer's output; rows past T never read
    chosen = []
    for t, (p, r) in enumerate(zip(sc["pos"], sc["req"])):
        sel = torch.argsort(torch.rand(p + 1, generator=g), descending=True)[:TOPK]
        chosen.append(sel)
        buf[t] = -1
        buf[t, : sel.numel()] = sel.to(torch.int32)
    prefill_backend = PrefillBackend()
    builder = tms.TritonMLASparseMetadataBuilder(types.SimpleNamespace(block_size=BS), ["l0"],
                                                 vllm_config(prefill_backend), torch.device("cpu"))
    seq_lens = torch.tensor([s for s, _ in sc["reqs"]], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=sc["qsl"], query_start_loc_cpu=sc["qsl"], seq_lens=seq_lens,
        num_reqs=len(sc["reqs"]), num_actual_tokens=T, max_query_len=max(q for _, q in reqs),
        max_seq_len=max(s for s, _ in reqs), block_table_tensor=sc["bt"], slot_mapping=sc["slots"],
        seq_lens_cpu_upper_bound=seq_lens)
    md = builder.build(0, cm)
    assert type(md) is tms.TritonMLASparseMetadata, type(md)
    if layer == "indexer":
        im = impl(kv_dtype, indexer=types.SimpleNamespace(topk_indices_buffer=buf),
                  topk_indices_buffer=torch.full_like(buf, 10**6))   # the indexer's own buffer wins
    else:   # GLM-5.2 (index_topk_freq > 1): no indexer, the shared buffer the previous layer filled
        im = impl(kv_dtype, indexer=None, topk_indices_buffer=buf)
    q = (torch.randn(T, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    # forward_impl's split: decodes through MQA; prefills through dense MHA when they fit in top-k and a
    # prefill backend exists (it does on a GPU), else through MQA as well. Both MQA slices are checked.
    mha = md.num_prefills > 0 and md.prefill_max_seq_len <= md.topk_tokens
    pm = md.prefill
    prefill = None if pm is None else dict(
        prepared=prefill_backend.prepared == [pm], qsl=pm.query_start_loc.tolist(), max_q=pm.max_query_len,
        rows=pm.block_table.shape[0], context=pm.chunked_context is not None,
        dense=getattr(pm, "use_dense_mha", None))   # 0.27+: the builder's own dense-MHA decision
    out_all, _ = im.forward_mqa((q[..., :512], q[..., 512:]), cache, md, None)
    n = md.num_decode_tokens
    out_dec, _ = im.forward_mqa((q[:n, :, :512], q[:n, :, 512:]), cache, md, None)
    errs = []
    for t, (p, r) in enumerate(zip(sc["pos"], sc["req"])):
        k = exact[r][chosen[t]]
        ref = torch.softmax(q[t].double() @ k.T * SCALE, -1) @ k[:, :512]
        errs.append(((out_all[t].double() - ref).abs().max() / ref.abs().max()).item())
    same_dec = bool(torch.equal(out_dec, out_all[:n]))
    return dict(max_rel=max(errs), nan=bool(out_all.isnan().any()), shape=list(out_all.shape),
                num_decodes=md.num_decodes, num_decode_tokens=n, num_prefills=md.num_prefills,
                prefill_max_seq_len=md.prefill_max_seq_len, mha=mha, decode_slice_same=same_dec,
                req_ids=md.req_id_per_token.tolist(), buffer_is_shared=im.topk_indices_buffer is buf,
                prefill=prefill, segments=[(s.tok_start, s.tok_end, s.ws_blocks) for s in md.fp8_segments or []])

results = {}
for kv_format in ("bf16", "fp8_ds_mla"):
    for layer in ("indexer", "indexerless"):
        # two decodes, a chunked-prefill continuation crossing TOPK, a fresh prefill shorter than TOPK
        results[f"long/{kv_format}/{layer}"] = run(11, [(150, 1), (97, 1), (140, 40), (20, 20)], kv_format, layer)
        # two decodes and one fresh prefill no longer than TOPK (the dense-MHA case on a GPU)
        results[f"short/{kv_format}/{layer}"] = run(12, [(150, 1), (97, 1), (30, 30)], kv_format, layer)
results["long/fp8_ds_mla+ws/indexer"] = run(11, [(150, 1), (97, 1), (140, 40), (20, 20)], "fp8_ds_mla", "indexer", 16)
results["short/fp8_ds_mla+ws/indexer"] = run(12, [(150, 1), (97, 1), (30, 30)], "fp8_ds_mla", "indexer", 16)
try:
    impl("auto", indexer=None, topk_indices_buffer=None)
    results["no_buffer"] = None
except ValueError as e:
    results["no_buffer"] = str(e)
print(json.dumps(results))
"""


def test_backend_on_026_bases_vs_dense_reference(staged):
    """Real shared-bases builder + impl (0.26.0, 0.28.0, 0.31.0, 0.33.0), bf16 and fp8_ds_mla caches, layers with and without an indexer
    (GLM-5.2 reads the shared top-k buffer), a long mixed batch (all MQA) and a short prefill (MHA-eligible):
    every MQA token equals dense sparse attention over its own top-k, decode slices included."""
    out = run_json(staged, BACKEND)
    assert "topk_indices_buffer" in out.pop("no_buffer"), out
    for key, r in out.items():
        assert not r["nan"] and r["max_rel"] < 2e-2, (key, r)
        # +ws: decodes from the fp8 cache, the prefills from one workspace segment (3 + 1 blocks, or 1)
        assert r.pop("segments") == {"long/fp8_ds_mla+ws/indexer": [[0, 2, 0], [2, 62, 4]],
                                     "short/fp8_ds_mla+ws/indexer": [[0, 2, 0], [2, 32, 1]]}.get(key, []), (key, r)
        assert r["decode_slice_same"] and r["buffer_is_shared"], (key, r)
        assert r["num_decodes"] == 2 and r["num_decode_tokens"] == 2, (key, r)
        if key.startswith("long/"):
            assert r["shape"] == [62, 3, 512] and r["num_prefills"] == 2, (key, r)
            assert r["prefill_max_seq_len"] == 140 and not r["mha"], (key, r)
            assert r["req_ids"] == [0, 1] + [2] * 40 + [3] * 20, (key, r)
            assert r["prefill"].pop("dense") in (None, False), (key, r)
            assert r["prefill"] == dict(prepared=True, qsl=[0, 40, 60], max_q=40, rows=2, context=True), (key, r)
        else:
            assert r["shape"] == [32, 3, 512] and r["num_prefills"] == 1, (key, r)
            assert r["prefill_max_seq_len"] == 30 and r["mha"], (key, r)
            assert r["req_ids"] == [0, 1] + [2] * 30, (key, r)
            assert r["prefill"].pop("dense") in (None, True), (key, r)
            assert r["prefill"] == dict(prepared=True, qsl=[0, 30], max_q=30, rows=1, context=False), (key, r)


# 0.29+'s CUDA model module (sm_89+): upstream's fused_norm_rope, in the interpreter, with a RoPE table (cos | sin
# halves) for 128 positions and 64 rotary dims.
FUSED_NORM_ROPE = VLLM_REAL_TRITON + """
# The interpreter's own float -> fp8 rounding loses mantissa carries (124 <= |x| < 128 -> 64): fixed as on the GPU.
sys.modules["_dsa_interp"].fp8_downcast_fix()
from vllm.models.deepseek_v32.common.kernels import fused_norm_rope
angles = torch.arange(128)[:, None] * (10000.0 ** (-torch.arange(32) / 32))[None, :]
cos_sin = torch.cat([angles.cos(), angles.sin()], -1).float()
"""

CUDA_MODULE_CACHE = FUSED_NORM_ROPE + """
# 0.29+'s CUDA model module (sm_89+) writes the MLA cache itself, in `fused_norm_rope` (RMS norm, RoPE, fp8_ds_mla
# quantisation and the cache write in one Triton kernel, a different writer than concat_and_cache_mla). Here that
# upstream kernel runs in the interpreter into the cache TRITON_MLA_SPARSE allocates, and the overlay's kernel reads it.
from vllm._dsa_overlay import triton_mla_sparse as tms, triton_mla_sparse_ops as ops

g = torch.Generator().manual_seed(7)
T, BS, NB, H, TOPK, QL = 37, 64, 3, 2, 16, 64
SCALE = 0.0625
results = {}
for kv_dtype in ("auto", "fp8_ds_mla"):
    kv_format = ops.kv_format_for(kv_dtype)
    shape = tms.TritonMLASparseBackend.get_kv_cache_shape(NB, BS, 1, 576, kv_dtype)
    cache = (torch.full(shape, float("nan"), dtype=torch.bfloat16) if kv_format == "bf16"
             else torch.full(shape, 0xFF, dtype=torch.uint8))          # NaN everywhere nothing is written
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)            # one request, positions 0..T-1
    pos = torch.arange(T)
    slots = block_table[0, pos // BS].long() * BS + pos % BS
    kv_c = torch.randn(T, 512, generator=g).to(torch.bfloat16)
    k_pe = torch.randn(T, 64, generator=g).to(torch.bfloat16)
    kv_c_out, k_pe_out = torch.empty_like(kv_c), torch.empty_like(k_pe)
    fused_norm_rope(pos, torch.randn(T, QL, generator=g).to(torch.bfloat16), torch.ones(QL, dtype=torch.bfloat16),
                    1e-6, kv_c, (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16), 1e-6, k_pe, cos_sin,
                    None, None, None, 1e-6, None, torch.zeros(T, TOPK, dtype=torch.int32),
                    slot_mapping=slots, mla_kv_cache=cache, mla_kv_cache_dtype=kv_dtype,
                    mla_k_scale=torch.ones(1), has_indexer=False, kv_c_out=kv_c_out, k_pe_out=k_pe_out)
    rows = cache.view(NB * BS, -1)[slots]
    if kv_format == "bf16":
        exact = rows.double()
        layout_ok = torch.equal(rows, torch.cat([kv_c_out, k_pe_out], -1))
        nope_err = 0.0
    else:   # the documented fp8_ds_mla layout, decoded by hand
        nope = rows[:, :512].view(torch.float8_e4m3fn).double().view(T, 4, 128)
        scales = rows[:, 512:528].contiguous().view(torch.float32).double()
        rope = rows[:, 528:656].contiguous().view(torch.bfloat16)
        exact = torch.cat([(nope * scales[..., None]).view(T, 512), rope.double()], -1)
        layout_ok = torch.equal(rope, k_pe_out)
        ref = kv_c_out.double().view(T, 4, 128)
        nope_err = ((exact[:, :512].view(T, 4, 128) - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
    # Every token attends to a random top-k of the positions written so far (-1 padding where fewer).
    topk = torch.full((T, TOPK), -1, dtype=torch.int32)
    for t in range(T):
        sel = torch.randperm(t + 1, generator=g)[:TOPK]
        topk[t, : sel.numel()] = sel.to(torch.int32)
    q = (torch.randn(T, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    out, lse = ops.sparse_mla_forward((q[..., :512], q[..., 512:]), cache, topk, torch.zeros(T, dtype=torch.int32),
                                      block_table, BS, SCALE, kv_format)
    errs = []
    for t in range(T):
        k = exact[topk[t][topk[t] >= 0].long()]
        ref_out = torch.softmax(q[t].double() @ k.T * SCALE, -1) @ k[:, :512]
        errs.append(((out[t].double() - ref_out).abs().max() / ref_out.abs().max()).item())
    results[kv_format] = dict(layout_ok=layout_ok, nope_err=nope_err, max_rel=max(errs),
                              nan=bool(out.isnan().any()), untouched=int(cache.view(NB * BS, -1)[BS:2 * BS].isnan().all()
                                                                         if kv_format == "bf16" else
                                                                         (cache.view(NB * BS, -1)[BS:2 * BS] == 0xFF).all()))
print(json.dumps(results))
"""


@pytest.mark.parametrize("version", [v for v in VERSIONS if vllm_envs.release(v) >= (0, 29, 0)])
def test_cuda_module_cache_writer_read_by_triton(version, tmp_path_factory):
    """sm_89+ on 0.29.0+: upstream's CUDA model module writes the MLA cache with its own fused kernel
    (`fused_norm_rope`, power-of-two fp8_ds_mla scales). Run in the interpreter into TRITON_MLA_SPARSE's cache, for bf16
    and fp8_ds_mla: the rows hold what the layout says (bf16: exactly the normed latent and roped k_pe it returns;
    fp8_ds_mla: its bf16 rope bit for bit, the fp8 tiles within e4m3 rounding), a block no token maps to stays
    untouched, and the overlay's kernel reading that cache equals dense attention over the decoded rows."""
    out = run_json(vllm_envs.shared_site(version, tmp_path_factory), CUDA_MODULE_CACHE)
    for fmt, r in out.items():
        assert r["layout_ok"] and r["untouched"] and not r["nan"], (fmt, r)
        # e4m3 rounding: half a step of the tile's top binade, whose scale is amax / 448 rounded up to a power of 2
        assert r["nope_err"] <= 2 ** -4, (fmt, r)
        assert r["max_rel"] < 2e-2, (fmt, r)


CUDA_MODULE_INDEXER_CACHE = FUSED_NORM_ROPE + """
# 0.29+'s CUDA model module also writes the indexer's K cache itself (fused_norm_rope: LayerNorm, RoPE, fp8 with a
# power-of-two scale), where older releases call indexer_k_quant_and_cache. The Triton indexer must read it.
from vllm._dsa_overlay.kernels import indexer as IX

g = torch.Generator().manual_seed(11)
T, BS, NB, D, HI, QL = 45, 64, 3, 128, 4, 64
idx_cache = torch.full((NB, BS, D + 4), 0xFF, dtype=torch.uint8)   # how vLLM allocates it; NaN bytes elsewhere
block_table = torch.tensor([[1, 2]], dtype=torch.int32)
pos = torch.arange(T)
slots = block_table[0, pos // BS].long() * BS + pos % BS
index_k = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16)
index_k_out = torch.empty_like(index_k)
fused_norm_rope(pos, torch.randn(T, QL, generator=g).to(torch.bfloat16), torch.ones(QL, dtype=torch.bfloat16), 1e-6,
                torch.randn(T, 512, generator=g).to(torch.bfloat16), torch.ones(512, dtype=torch.bfloat16), 1e-6,
                torch.randn(T, 64, generator=g).to(torch.bfloat16), cos_sin,
                index_k, (1 + 0.2 * torch.randn(D, generator=g)).to(torch.bfloat16),
                (0.1 * torch.randn(D, generator=g)).to(torch.bfloat16), 1e-6, cos_sin,
                torch.zeros(T, 16, dtype=torch.int32), slot_mapping=slots, indexer_k_cache=idx_cache,
                has_indexer=True, index_k_out=index_k_out)
# the documented layout, decoded by hand: per block, BS * D fp8 bytes (token t at t * D), then BS float32 scales
flat = idx_cache.view(NB, -1)
blk, off = (slots // BS), (slots % BS)
vals = torch.stack([flat[b, o * D:(o + 1) * D] for b, o in zip(blk.tolist(), off.tolist())]).view(torch.float8_e4m3fn)
scales = torch.stack([flat[b, BS * D + 4 * o:BS * D + 4 * o + 4] for b, o in zip(blk.tolist(), off.tolist())])
scales = scales.contiguous().view(torch.float32).double().view(-1)
decoded = vals.double() * scales[:, None]
ref_k = index_k_out.double()
k_err = ((decoded - ref_k).abs().amax(-1) / ref_k.abs().amax(-1)).max().item()
# decode logits for three requests over that cache (context lengths T, 10, 1), every head weighted
cl = torch.tensor([T, 10, 1], dtype=torch.int32)
B = cl.numel()
q = (torch.randn(B, 1, HI, D, generator=g) * 2).to(torch.float8_e4m3fn)
w = torch.randn(B, HI, generator=g)
logits = IX.fp8_paged_mqa_logits(q, idx_cache.view(NB, BS, 1, D + 4), w, cl, block_table.expand(B, -1).contiguous(),
                                 None, 2 * BS, True)
dots = torch.einsum("bhd,nd->bhn", q[:, 0].double(), vals.double())
ref = (w.double()[:, :, None] * dots.clamp(min=0)).sum(1) * scales[None, :]
mag = (w.double().abs()[:, :, None] * torch.einsum("bhd,nd->bhn", q[:, 0].double().abs(),
                                                    vals.double().abs())).sum(1) * scales[None, :]
errs, masked = [], True
for b in range(B):
    n = int(cl[b])
    errs.append(((logits[b, :n].double() - ref[b, :n]).abs() / mag[b, :n].clamp_min(1e-30)).max().item())
    masked &= bool(torch.isinf(logits[b, n:]).all())
print(json.dumps(dict(k_err=k_err, max_rel=max(errs), masked=masked, finite=bool(logits[0, :T].isfinite().all()),
                      scales_pow2=bool((scales.log2() == scales.log2().round()).all()))))
"""


@pytest.mark.parametrize("version", [v for v in VERSIONS if vllm_envs.release(v) >= (0, 29, 0)])
def test_cuda_module_indexer_cache_read_by_triton_indexer(version, tmp_path_factory):
    """sm_89+ on 0.29.0+: upstream's CUDA module writes the indexer K cache in its fused kernel (power-of-two
    scales) instead of indexer_k_quant_and_cache. Run in the interpreter: the cache holds the layout the Triton
    indexer reads (per block: fp8 rows, then float32 scales), its values are the normed, roped K it returns within
    e4m3 rounding, and the Triton paged logits over it equal a float64 reference (-inf past each context)."""
    r = run_json(vllm_envs.shared_site(version, tmp_path_factory), CUDA_MODULE_INDEXER_CACHE)
    assert r["scales_pow2"] and r["finite"] and r["masked"], r
    assert r["k_err"] <= 2 ** -4, r
    assert r["max_rel"] < 1e-5, r

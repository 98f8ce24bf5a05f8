"""What the end-to-end proof runs and how it judges: models, runs, comparisons, noise floors, plans.

A run is a `Run` (model, path, kv cache dtype, CUDA graphs, tokens/s, prefill chunk); its name is
derived from those fields by `run_name` (model/path/cache/mode[/c<chunk>]) and nowhere written by hand.
A comparison is (candidate run, reference run, what it shows) and is named by its candidate run. A
`Plan` bundles runs (in the order of their value: a budget stops at the first run that no longer
fits), comparisons, noise floors and the checked comparisons. Everything here is data plus a few
lookups; bench/e2e/judge.py applies it.
"""

from __future__ import annotations

from typing import NamedTuple

VOCAB = 8192
GREEDY_STEPS = 48
MIN_IDENTICAL_STEPS = 32
PROMPT_LENS = (300, 347, 433, 561)
TPS_BATCH = 16
DEFAULT_CHUNK = 256   # max_num_batched_tokens: prefills are chunked into 256-token steps
TIME_BUDGET_S = 470   # default --max-minutes x 60: stop starting engines (one device call < 10 min)


class Model(NamedTuple):
    """A tiny random checkpoint (run.make_model) or a GGUF file of the --gguf-fixture folder."""
    config: dict                   # GlmMoeDsaConfig arguments over run.make_model's base
    json: dict = {}                # keys written into config.json after saving (no transformers argument)
    prompt_lens: tuple = PROMPT_LENS
    max_model_len: int = 1024
    gguf: str | None = None        # fixture.json "gguf" tag (BF16, Q8_0, Q4_K_M): serve that file


_GLM5 = dict(num_attention_heads=16, index_n_heads=32, index_topk=256)
MODELS = {
    "glm5": Model(_GLM5),
    "odd": Model(dict(num_attention_heads=12, index_n_heads=8, index_topk=200)),
    # model A with both layers dense: no MoE routing, whose discrete expert choice turns bf16
    # noise into large logit jumps on a random model (isolation runs only)
    "dense": Model(dict(_GLM5, first_k_dense_replace=2)),
    # GLM-5.2 style (vLLM >= 0.21 deepseek_v2.py): a layer skips its indexer and reuses the previous
    # layer's top-k when max(layer - index_skip_topk_offset + 1, 0) % index_topk_freq != 0: with
    # freq 2 and offset 1, layers 1 and 3 of 4 have no indexer (on 0.20.0 every layer keeps one)
    "glm52": Model(dict(_GLM5, num_hidden_layers=4),
                   json=dict(index_topk_freq=2, index_skip_topk_offset=1)),
    # DeepSeek-V3.2 shaped: 64 index heads, top-k 2048, qk_nope 128, v_head 128, served as
    # model_type deepseek_v32 (vLLM's DeepseekV32ForCausalLM); prompts longer than the top-k
    "dsv32": Model(dict(num_attention_heads=16, index_n_heads=64, index_topk=2048,
                        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192),
                   json=dict(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"]),
                   prompt_lens=(2600, 2987, 3500), max_model_len=4096),
    # llama.cpp GGUFs of tests/fixtures/make_glm_dsa_gguf.py --variant h200 (16 heads, 32 index
    # heads, top-k 256); on vLLM >= 0.24 through vllm-gguf-plugin, before that the in-tree loader
    "gguf_bf16": Model(dict(_GLM5), gguf="BF16"),
    "gguf_q8_0": Model(dict(_GLM5), gguf="Q8_0"),
    "gguf_q4_k_m": Model(dict(_GLM5), gguf="Q4_K_M"),
}

# path: upstream = FLASHMLA_SPARSE + DeepGEMM (asked for by name: 0.26.0 would pick FLASH_ATTN_MLA_SPARSE
# on the H200); upstream_fa = FLASH_ATTN_MLA_SPARSE + DeepGEMM (upstream's other Hopper choice, a
# second reference); triton = DSA_OVERLAY_PORTABLE=1 (vendor kernels raise); attn_triton = explicit
# TRITON_MLA_SPARSE + DeepGEMM indexer (switch off); idx_triton = explicit FLASHMLA_SPARSE +
# DSA_OVERLAY_INDEXER=triton.
PATHS = ("upstream", "upstream_fa", "triton", "attn_triton", "idx_triton")
UPSTREAM_PATHS = ("upstream", "upstream_fa")
ATTENTION_BACKEND = {"upstream": "FLASHMLA_SPARSE", "upstream_fa": "FLASH_ATTN_MLA_SPARSE",
                     "idx_triton": "FLASHMLA_SPARSE", "attn_triton": "TRITON_MLA_SPARSE"}


class Run(NamedTuple):
    model: str
    path: str
    kv: str = "auto"               # vLLM's kv_cache_dtype: auto (bf16) or fp8_ds_mla
    graphs: bool = False           # CUDA graphs (else enforce_eager)
    tps: bool = False              # also measure decode tokens/s (runs alone, after the others)
    chunk: int = DEFAULT_CHUNK     # prefill chunk (max_num_batched_tokens)

    @property
    def name(self) -> str:
        return run_name(self)


def run_name(run: Run) -> str:
    """model/path/cache/mode, plus /c<chunk> for another prefill chunking (the same kernels on another
    batch composition, i.e. the bf16 noise of upstream itself)."""
    cache = "bf16" if run.kv == "auto" else run.kv
    tail = "" if run.chunk == DEFAULT_CHUNK else f"/c{run.chunk}"
    return f"{run.model}/{run.path}/{cache}/{'graphs' if run.graphs else 'eager'}{tail}"


class Plan(NamedTuple):
    runs: list                     # Run, most valuable first
    comparisons: list              # (candidate run name, reference run name, what it shows)
    floors: dict                   # floor set -> the noise-floor comparisons that make it
    must_match: dict               # checked comparison -> the floor set that judges it


# --- the stored 0.23.0 proof (bench/results/h200-e2e_proof-run2*, bench/RESULTS.md) -------------------

_G = "glm5"
RUNS_023 = [
    Run(_G, "upstream"), Run(_G, "triton"), Run(_G, "upstream", chunk=512),
    Run(_G, "upstream", "fp8_ds_mla"), Run(_G, "triton", "fp8_ds_mla"),
    Run("odd", "triton"), Run("odd", "triton", graphs=True), Run("odd", "triton", "fp8_ds_mla", True),
    Run(_G, "upstream", graphs=True, tps=True), Run(_G, "triton", graphs=True, tps=True),
    Run(_G, "upstream", "fp8_ds_mla", True, True), Run(_G, "triton", "fp8_ds_mla", True, True),
]
ISOLATE_RUNS = [
    Run(_G, "upstream"), Run(_G, "triton"), Run(_G, "attn_triton"), Run(_G, "idx_triton"),
    Run(_G, "upstream", chunk=512),
    Run("dense", "upstream"), Run("dense", "triton"), Run("dense", "upstream", chunk=512),
    Run(_G, "upstream", "fp8_ds_mla"), Run(_G, "triton", "fp8_ds_mla"),
    Run(_G, "attn_triton", "fp8_ds_mla"), Run(_G, "upstream", graphs=True),
]

# (candidate run, reference run, what the comparison shows)
COMPARISONS_023 = [
    ("glm5/upstream/bf16/graphs", "glm5/upstream/bf16/eager",
     "NOISE FLOOR: upstream graphs vs upstream eager, bf16"),
    ("glm5/upstream/bf16/eager/c512", "glm5/upstream/bf16/eager",
     "NOISE FLOOR: upstream, 512- vs 256-token prefill chunks, bf16"),
    ("glm5/upstream/fp8_ds_mla/graphs", "glm5/upstream/fp8_ds_mla/eager",
     "NOISE FLOOR: upstream graphs vs upstream eager, fp8_ds_mla"),
    ("glm5/triton/bf16/eager", "glm5/upstream/bf16/eager", "Triton vs upstream, bf16, eager"),
    ("glm5/triton/bf16/graphs", "glm5/upstream/bf16/graphs", "Triton vs upstream, bf16, graphs"),
    ("glm5/triton/fp8_ds_mla/eager", "glm5/upstream/fp8_ds_mla/eager",
     "Triton vs upstream, fp8_ds_mla, eager"),
    ("glm5/triton/fp8_ds_mla/graphs", "glm5/upstream/fp8_ds_mla/graphs",
     "Triton vs upstream, fp8_ds_mla, graphs"),
    ("odd/triton/bf16/graphs", "odd/triton/bf16/eager",
     "topk 200 / 8 index heads (upstream cannot run it): Triton graphs vs Triton eager, bf16"),
    ("odd/triton/fp8_ds_mla/graphs", "odd/triton/bf16/graphs",
     "topk 200 / 8 index heads: fp8_ds_mla vs bf16 cache (quantization, informative)"),
]
ISOLATE_COMPARISONS = [
    ("glm5/upstream/bf16/graphs", "glm5/upstream/bf16/eager",
     "NOISE FLOOR: upstream graphs vs upstream eager, bf16"),
    ("glm5/upstream/bf16/eager/c512", "glm5/upstream/bf16/eager",
     "NOISE FLOOR: upstream, 512- vs 256-token prefill chunks, bf16"),
    ("dense/upstream/bf16/eager/c512", "dense/upstream/bf16/eager",
     "NOISE FLOOR, dense layers: upstream, 512- vs 256-token chunks, bf16"),
    ("dense/triton/bf16/eager", "dense/upstream/bf16/eager",
     "dense layers: Triton attn + Triton indexer, bf16"),
    ("glm5/triton/bf16/eager", "glm5/upstream/bf16/eager", "Triton attn + Triton indexer, bf16"),
    ("glm5/attn_triton/bf16/eager", "glm5/upstream/bf16/eager",
     "Triton attn + DeepGEMM indexer, bf16"),
    ("glm5/idx_triton/bf16/eager", "glm5/upstream/bf16/eager",
     "FlashMLA attn + Triton indexer, bf16"),
    ("glm5/triton/fp8_ds_mla/eager", "glm5/upstream/fp8_ds_mla/eager",
     "Triton attn + Triton indexer, fp8_ds_mla"),
    ("glm5/attn_triton/fp8_ds_mla/eager", "glm5/upstream/fp8_ds_mla/eager",
     "Triton attn + DeepGEMM indexer, fp8_ds_mla"),
]
# Noise floors: upstream against itself on the same weights and prompts, with a change that only
# reorders bf16 arithmetic (CUDA graphs + torch.compile, another prefill chunking). On a tiny random
# model a bf16-sized difference in layer 0 grows through softmax and the indexer's top-k boundary
# (bench/RESULTS.md, the isolation run), so "identical greedy tokens" is a property of the model, not of
# the kernels. A checked comparison therefore passes when (1) its TF mean |dlogprob| <= FLOOR_FACTOR x
# the largest floor of its floor set and its TF top-5 overlap is no lower than the lowest floor's minus
# 0.02; (2) at every prompt's first greedy divergence each run's token is in the other's top-5 (vLLM's
# check_logprobs_close), or the prompts agree for >= MIN_IDENTICAL_STEPS steps; (3) where both runs
# dumped layer 0 (bit-identical inputs there), the indexer chose the same top-k set for >= 99.9% of
# tokens and the attention output's per-token error p99 is within LAYER0_ERR_P99 of the cache dtype.
# Comparisons are named by their candidate run (unique within a list; plan_errors checks it).
FLOORS_023 = {"auto": ["glm5/upstream/bf16/graphs", "glm5/upstream/bf16/eager/c512"],
              "fp8_ds_mla": ["glm5/upstream/fp8_ds_mla/graphs"]}
MUST_MATCH_023 = {"glm5/triton/bf16/eager": "auto", "glm5/triton/bf16/graphs": "auto",
                  "glm5/triton/fp8_ds_mla/eager": "fp8_ds_mla",
                  "glm5/triton/fp8_ds_mla/graphs": "fp8_ds_mla", "odd/triton/bf16/graphs": "auto"}


# --- the proof for vLLM 0.20.0 and 0.24.0+ (one engine at a time, runs by value) --------------

def _proof_plan() -> Plan:
    """Per model and cache dtype, in order of value: upstream eager, Triton eager and upstream with
    512-token chunks (its eager noise floor); then CUDA graphs with tok/s (floors: chunking and
    graphs vs eager). A budget cut therefore leaves whole verdicts, the most valuable first."""
    runs, comps, floors, must = [], [], {}, {}

    def block(model, kv="auto", graphs=False, tps=False):
        up, tri = Run(model, "upstream", kv, graphs, tps), Run(model, "triton", kv, graphs, tps)
        cache = up.name.split("/")[2]
        key = f"{model}/{cache}/{'graphs' if graphs else 'eager'}"
        if not graphs:
            c512 = Run(model, "upstream", kv, chunk=512)
            runs.extend([up, tri, c512])
            comps.append((c512.name, up.name, f"NOISE FLOOR {model}: upstream, 512- vs 256-token "
                                              f"prefill chunks, {cache}"))
            floors[key] = [c512.name]
        else:
            eager = Run(model, "upstream", kv)
            runs.extend([up, tri])
            comps.append((up.name, eager.name, f"NOISE FLOOR {model}: upstream graphs vs eager, {cache}"))
            floors[key] = [up.name, Run(model, "upstream", kv, chunk=512).name]
        comps.append((tri.name, up.name, f"{model}: Triton vs upstream, {cache}, "
                                         f"{'graphs' if graphs else 'eager'}"))
        must[tri.name] = key

    block("glm5")
    block("dsv32")
    block("glm52")
    block("glm5", "fp8_ds_mla")
    block("glm5", graphs=True, tps=True)
    block("glm5", "fp8_ds_mla", graphs=True, tps=True)
    block("gguf_bf16")
    block("dsv32", "fp8_ds_mla")
    # upstream's other Hopper backend (0.26.0's own choice on the H200): informative
    fa = Run("glm5", "upstream_fa")
    runs.append(fa)
    comps += [(fa.name, "glm5/upstream/bf16/eager", "glm5: FLASH_ATTN_MLA_SPARSE vs FLASHMLA_SPARSE "
                                                    "(two upstream references, informative)"),
              ]
    block("gguf_q8_0")
    block("gguf_q4_k_m")
    block("glm52", "fp8_ds_mla")
    block("dsv32", graphs=True)
    return Plan(runs, comps, floors, must)


def _isolate_plan(model: str) -> Plan:
    """Which component moves `model` away from upstream: each Triton piece alone with the upstream
    other one, and upstream's own chunking floor (bf16, eager)."""
    up = Run(model, "upstream")
    runs = [up, Run(model, "triton"), Run(model, "attn_triton"), Run(model, "idx_triton"),
            Run(model, "upstream", chunk=512)]
    what = {"triton": "Triton attn + Triton indexer", "attn_triton": "Triton attn + DeepGEMM indexer",
            "idx_triton": "FlashMLA attn + Triton indexer"}
    comps = [(runs[4].name, up.name, f"NOISE FLOOR {model}: upstream, 512- vs 256-token chunks, bf16")]
    comps += [(r.name, up.name, f"{model}: {what[r.path]}, bf16") for r in runs[1:4]]
    return Plan(runs, comps, {"auto": [runs[4].name]}, {})


PLANS = {
    "h200": _proof_plan(),
    "h200-0.23": Plan(RUNS_023, COMPARISONS_023, FLOORS_023, MUST_MATCH_023),
    # isolation: nothing checked; its two glm5 floors are labelled as such in the report
    "isolate": Plan(ISOLATE_RUNS, ISOLATE_COMPARISONS, {"auto": FLOORS_023["auto"]}, {}),
    "isolate-dsv32": _isolate_plan("dsv32"),
}
FLOOR_FACTOR = 1.5
# per-token max|a - b| / max|upstream| at layer 0, p99 over tokens. bf16: two roundings of the bf16
# output (2 x 2^-8) plus accumulation order; fp8_ds_mla: FlashMLA's fp8 path itself is 4-7e-3 off a
# float32 reference on whole tensors (bench/RESULTS.md), more per token on small-magnitude rows.
LAYER0_ERR_P99 = {"auto": 1.0e-2, "fp8_ds_mla": 3.0e-2}
LAYER0_SAME_SET = 0.999

# Seconds one run takes alone on the H200 (wall, process start to result), from the stored logs
# (bench/results/h200-e2e_proof-run2.json.gz, -run3-odd-fp8, h200-e2e_isolate-run1.json.gz: eager
# 19-27 s, graphs 28-74 s of which torch.compile 12-50 s, the tok/s measurement ~20 s;
# h200-gguf_proof-run3.md: a GGUF engine 36-44 s). Long prompts (dsv32: 3 x ~3000 tokens) add prefill.
EST_EAGER_S, EST_GRAPHS_S, EST_TPS_S, EST_LONG_S, EST_GGUF_S = 25, 50, 20, 15, 15


def estimate_s(run: Run) -> float:
    """Budget estimate of one run (see EST_*)."""
    model = MODELS[run.model]
    s = EST_GRAPHS_S if run.graphs else EST_EAGER_S
    s += EST_TPS_S if run.tps else 0
    s += EST_LONG_S if sum(model.prompt_lens) > 4 * 1000 else 0
    s += EST_GGUF_S if model.gguf else 0
    return s


VENDOR_ENTRY_POINTS = {
    "vllm.utils.deep_gemm": ["fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                             "get_paged_mqa_logits_metadata", "fp8_mqa_logits",
                             "fp8_paged_mqa_logits"],
    "vllm.model_executor.layers.sparse_attn_indexer": ["fp8_fp4_mqa_logits",
                                                       "fp8_fp4_paged_mqa_logits",
                                                       "fp8_mqa_logits", "fp8_paged_mqa_logits"],
    "vllm.v1.attention.backends.mla.indexer": ["get_paged_mqa_logits_metadata"],
    "vllm.v1.attention.ops.flashmla": ["flash_mla_sparse_fwd", "flash_mla_with_kvcache",
                                       "get_mla_metadata"],
    "vllm.v1.attention.backends.mla.flashmla_sparse": ["flash_mla_sparse_fwd",
                                                       "flash_mla_with_kvcache",
                                                       "get_mla_metadata"],
    "vllm.v1.attention.backends.mla.flashattn_mla_sparse": ["flash_attn_varlen_func"],
}
TRITON_ENTRY_POINTS = {
    "vllm._dsa_overlay.kernels.sparse_mla": ["sparse_mla_attention"],
    "vllm._dsa_overlay.kernels.indexer": ["fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                                          "fp8_mqa_logits", "fp8_paged_mqa_logits"],
}
# The profiler census (worker: torch.profiler over the teacher-forced pass): a CUDA kernel is a
# vendor DSA kernel when its name contains one of these (DeepGEMM's indexer logits and FlashMLA's
# kernels), unless it is one of the overlay's Triton kernels (named after their jit functions).
VENDOR_KERNEL_PATTERNS = ("deep_gemm", "mqa_logits", "flash_mla", "flashmla", "splitkv_mla",
                          "mla_combine", "sparse_attn_fwd", "sparse_prefill", "sparse_decode")
TRITON_KERNEL_NAMES = ("_mqa_logits_kernel", "_paged_mqa_logits_kernel", "_sparse_mla_fwd_kernel",
                       "_sparse_mla_combine_kernel")


def vendor_kernel(name: str) -> bool:
    """A CUDA kernel name of the census is one of FlashMLA's or DeepGEMM's DSA kernels."""
    return (not name.startswith(TRITON_KERNEL_NAMES)
            and any(p in name.lower() for p in VENDOR_KERNEL_PATTERNS))


def index_topk(run_name: str) -> int:
    """The index_topk of the model a run (or a comparison, by its candidate) serves."""
    return MODELS[run_name.split("/")[0]].config["index_topk"]


def needed_runs(plan: Plan) -> set[str]:
    """The runs a verdict needs: each checked comparison's candidate and reference and its floors' runs.
    (Another run only feeds informative rows, e.g. FLASH_ATTN_MLA_SPARSE, which vLLM 0.20.0 lacks.)"""
    comps = {c: r for c, r, _ in plan.comparisons}
    need = set()
    for cand, key in plan.must_match.items():
        need |= {cand, comps.get(cand)} | {n for f in plan.floors.get(key, []) for n in (f, comps.get(f))}
    return need - {None}


def plan_errors(plan: Plan) -> list[str]:
    """Why a plan is inconsistent ([] when it is not): run names are unique; comparisons name runs of
    the plan, are named uniquely by their candidate, compare runs of one model; floors and must_match
    name comparisons; a floor compares upstream with upstream on one cache dtype; a checked
    comparison's candidate has its floor set's cache dtype."""
    errors = []
    names = [r.name for r in plan.runs]
    errors += [f"run {n!r} listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    by_name = {r.name: r for r in plan.runs}
    cands = [c for c, _, _ in plan.comparisons]
    errors += [f"comparison {c!r} listed twice" for c in sorted({c for c in cands if cands.count(c) > 1})]
    for cand, ref, _ in plan.comparisons:
        errors += [f"comparison {cand!r}: no run {n!r}" for n in (cand, ref) if n not in by_name]
        if cand.split("/")[0] != ref.split("/")[0]:
            errors.append(f"comparison {cand!r}: its reference {ref!r} serves another model")
    comps = {c: r for c, r, _ in plan.comparisons}
    floor_kv = {}
    for key, floor_names in plan.floors.items():
        for name in floor_names:
            if name not in comps:
                errors.append(f"floors[{key!r}]: {name!r} is not a comparison")
                continue
            pair = [by_name.get(n) for n in (name, comps[name])]
            kvs = {r.kv for r in pair if r}
            if not all(r and r.path == "upstream" for r in pair) or len(kvs) != 1:
                errors.append(f"floors[{key!r}]: {name!r} is not upstream vs upstream on one cache")
            elif floor_kv.setdefault(key, kvs.pop()) != pair[0].kv:
                errors.append(f"floors[{key!r}]: {name!r} mixes cache dtypes")
    for name, key in plan.must_match.items():
        if name not in comps:
            errors.append(f"must_match: {name!r} is not a comparison")
        elif key not in plan.floors:
            errors.append(f"must_match[{name!r}]: no floor set {key!r}")
        elif name in by_name and key in floor_kv and by_name[name].kv != floor_kv[key]:
            errors.append(f"must_match[{name!r}]: cache {by_name[name].kv!r} judged by the {key!r} "
                          f"floors (cache {floor_kv[key]!r})")
    return errors

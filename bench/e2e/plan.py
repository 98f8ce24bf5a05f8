"""What the end-to-end proof runs and how it judges: models, runs, comparisons, noise floors.

A run is (name, model, path, kv cache dtype, cuda graphs, measure tokens/s); its name is
model/path/cache/mode[/c512]. A comparison is (candidate run, reference run, what it shows) and is named
by its candidate run. Everything here is data plus two lookups; bench/e2e/judge.py applies it.
"""

from __future__ import annotations

VOCAB = 8192
GREEDY_STEPS = 48
MIN_IDENTICAL_STEPS = 32
PROMPT_LENS = (300, 347, 433, 561)
TPS_BATCH = 16
TIME_BUDGET_S = 470  # stop starting new engines after this (one device call: < 10 min in all)

MODELS = {
    "glm5": dict(num_attention_heads=16, index_n_heads=32, index_topk=256),
    "odd": dict(num_attention_heads=12, index_n_heads=8, index_topk=200),
    # model A with both layers dense: no MoE routing, whose discrete expert choice turns bf16
    # noise into large logit jumps on a random model (isolation runs only)
    "dense": dict(num_attention_heads=16, index_n_heads=32, index_topk=256,
                  first_k_dense_replace=2),
}
# a run name ending in /c512 schedules prefill chunks of 512 tokens instead of 256: the same
# kernels on a different batch composition, i.e. the bf16 noise of upstream itself
CHUNK_SUFFIX = "/c512"

# path: upstream = FLASHMLA_SPARSE + DeepGEMM; triton = DSA_OVERLAY_PORTABLE=1 (vendor kernels
# raise); attn_triton = explicit TRITON_MLA_SPARSE + DeepGEMM indexer (switch off);
# idx_triton = explicit FLASHMLA_SPARSE + DSA_OVERLAY_INDEXER=triton.
PATHS = ("upstream", "triton", "attn_triton", "idx_triton")
# (name, model, path, kv cache dtype, cuda graphs, measure tokens/s)
RUNS = [
    ("glm5/upstream/bf16/eager", "glm5", "upstream", "auto", False, False),
    ("glm5/triton/bf16/eager", "glm5", "triton", "auto", False, False),
    ("glm5/upstream/bf16/eager/c512", "glm5", "upstream", "auto", False, False),
    ("glm5/upstream/fp8_ds_mla/eager", "glm5", "upstream", "fp8_ds_mla", False, False),
    ("glm5/triton/fp8_ds_mla/eager", "glm5", "triton", "fp8_ds_mla", False, False),
    ("odd/triton/bf16/eager", "odd", "triton", "auto", False, False),
    ("odd/triton/bf16/graphs", "odd", "triton", "auto", True, False),
    ("odd/triton/fp8_ds_mla/graphs", "odd", "triton", "fp8_ds_mla", True, False),
    ("glm5/upstream/bf16/graphs", "glm5", "upstream", "auto", True, True),
    ("glm5/triton/bf16/graphs", "glm5", "triton", "auto", True, True),
    ("glm5/upstream/fp8_ds_mla/graphs", "glm5", "upstream", "fp8_ds_mla", True, True),
    ("glm5/triton/fp8_ds_mla/graphs", "glm5", "triton", "fp8_ds_mla", True, True),
]
ISOLATE_RUNS = [
    ("glm5/upstream/bf16/eager", "glm5", "upstream", "auto", False, False),
    ("glm5/triton/bf16/eager", "glm5", "triton", "auto", False, False),
    ("glm5/attn_triton/bf16/eager", "glm5", "attn_triton", "auto", False, False),
    ("glm5/idx_triton/bf16/eager", "glm5", "idx_triton", "auto", False, False),
    ("glm5/upstream/bf16/eager/c512", "glm5", "upstream", "auto", False, False),
    ("dense/upstream/bf16/eager", "dense", "upstream", "auto", False, False),
    ("dense/triton/bf16/eager", "dense", "triton", "auto", False, False),
    ("dense/upstream/bf16/eager/c512", "dense", "upstream", "auto", False, False),
    ("glm5/upstream/fp8_ds_mla/eager", "glm5", "upstream", "fp8_ds_mla", False, False),
    ("glm5/triton/fp8_ds_mla/eager", "glm5", "triton", "fp8_ds_mla", False, False),
    ("glm5/attn_triton/fp8_ds_mla/eager", "glm5", "attn_triton", "fp8_ds_mla", False, False),
    ("glm5/upstream/bf16/graphs", "glm5", "upstream", "auto", True, False),
]

# (candidate run, reference run, what the comparison shows)
COMPARISONS = [
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
# the largest floor of its cache dtype and its TF top-5 overlap is no lower than the lowest floor's minus
# 0.02; (2) at every prompt's first greedy divergence each run's token is in the other's top-5 (vLLM's
# check_logprobs_close), or the prompts agree for >= MIN_IDENTICAL_STEPS steps; (3) where both runs
# dumped layer 0 (bit-identical inputs there), the indexer chose the same top-k set for >= 99.9% of
# tokens and the attention output's per-token error p99 is within LAYER0_ERR_P99 of the cache dtype.
# Comparisons are named by their candidate run (unique within a list; plan_errors checks it).
# cache dtype -> the noise-floor comparisons that judge it
FLOORS = {"auto": ["glm5/upstream/bf16/graphs", "glm5/upstream/bf16/eager/c512"],
          "fp8_ds_mla": ["glm5/upstream/fp8_ds_mla/graphs"]}
# checked comparison -> the floor set (cache dtype) it is judged against
MUST_MATCH = {"glm5/triton/bf16/eager": "auto", "glm5/triton/bf16/graphs": "auto",
              "glm5/triton/fp8_ds_mla/eager": "fp8_ds_mla", "glm5/triton/fp8_ds_mla/graphs": "fp8_ds_mla",
              "odd/triton/bf16/graphs": "auto"}
FLOOR_FACTOR = 1.5
# per-token max|a - b| / max|upstream| at layer 0, p99 over tokens. bf16: two roundings of the bf16
# output (2 x 2^-8) plus accumulation order; fp8_ds_mla: FlashMLA's fp8 path itself is 4-7e-3 off a
# float32 reference on whole tensors (bench/RESULTS.md), more per token on small-magnitude rows.
LAYER0_ERR_P99 = {"auto": 1.0e-2, "fp8_ds_mla": 3.0e-2}
LAYER0_SAME_SET = 0.999

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
}
TRITON_ENTRY_POINTS = {
    "vllm._dsa_overlay.kernels.sparse_mla": ["sparse_mla_attention"],
    "vllm._dsa_overlay.kernels.indexer": ["fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                                          "fp8_mqa_logits", "fp8_paged_mqa_logits"],
}


def index_topk(run_name: str) -> int:
    """The index_topk of the model a run (or a comparison, by its candidate) serves."""
    return MODELS[run_name.split("/")[0]]["index_topk"]


def plan_errors(runs: list, comparisons: list, floors: dict, must_match: dict) -> list[str]:
    """Why a plan is inconsistent ([] when it is not): comparisons name runs of the plan, are named
    uniquely by their candidate, compare runs of one model; FLOORS and MUST_MATCH name comparisons, a
    floor compares upstream with upstream, a checked comparison's floor set is its cache dtype."""
    errors = []
    by_name = {r[0]: r for r in runs}
    cands = [c for c, _, _ in comparisons]
    errors += [f"comparison {c!r} listed twice" for c in sorted({c for c in cands if cands.count(c) > 1})]
    for cand, ref, _ in comparisons:
        errors += [f"comparison {cand!r}: no run {n!r}" for n in (cand, ref) if n not in by_name]
        if cand.split("/")[0] != ref.split("/")[0]:
            errors.append(f"comparison {cand!r}: its reference {ref!r} serves another model")
    comps = {c: r for c, r, _ in comparisons}
    for kv, names in floors.items():
        for name in names:
            if name not in comps:
                errors.append(f"FLOORS[{kv!r}]: {name!r} is not a comparison")
            elif not all(n in by_name and by_name[n][2] == "upstream" and by_name[n][3] == kv
                         for n in (name, comps[name])):
                errors.append(f"FLOORS[{kv!r}]: {name!r} is not upstream vs upstream with cache {kv!r}")
    for name, kv in must_match.items():
        if name not in comps:
            errors.append(f"MUST_MATCH: {name!r} is not a comparison")
        elif kv not in floors:
            errors.append(f"MUST_MATCH[{name!r}]: no floor set {kv!r}")
        elif name in by_name and by_name[name][3] != kv:
            errors.append(f"MUST_MATCH[{name!r}]: cache {by_name[name][3]!r} judged by the {kv!r} floors")
    return errors

"""End-to-end proof on the H200: TRITON_MLA_SPARSE + the Triton indexer inside vLLM 0.23.0 agree
with upstream (FLASHMLA_SPARSE + DeepGEMM) and run with every vendor DSA kernel made to raise.

One command, one device call (vLLM 0.23.0 staged at /root/site, see ../shared/device/README.md):

    . /root/vllm-env.sh && python3 bench/e2e_proof.py --site /root/site --out $OUT/e2e_proof.md

Isolation mode (one device call that pins a mismatch on a component; all runs eager, no tok/s):

    . /root/vllm-env.sh && python3 bench/e2e_proof.py --site /root/site --isolate \
        --out $OUT/e2e_isolate.md

runs, on the same prompts and schedule, upstream (FLASHMLA_SPARSE + DeepGEMM), the Triton path,
Triton attention + DeepGEMM indexer (explicit TRITON_MLA_SPARSE, portable switch off), FlashMLA +
Triton indexer (explicit FLASHMLA_SPARSE, DSA_OVERLAY_INDEXER=triton), and upstream with CUDA graphs
(the execution-noise floor), and dumps for every attention call of the teacher-forced pass the
indexer's top-k rows and the attention output (before W_UV). The report compares each run with
upstream per layer, split at position < index_topk / >= index_topk: top-k set agreement and output
relative error. Layer 0 sees bit-identical inputs in every run, so there any top-k difference is
an indexer bug and any output error above bf16 rounding (~4e-3) an attention bug; later layers
inherit the differences of earlier ones. The default proof dumps too (its layer-0 checks; `--no-dump`
skips them).

What it does (each vLLM engine in its own subprocess, whole run < 8 minutes):
1. Patched vLLM: with `--apply` (and apply.py present) runs `apply.py --vllm-site-packages SITE`
   then `verify.py`; if SITE already carries the overlay it is used as is; otherwise a private
   patched copy is staged in a temp dir (hard links + the real engine; SITE is never written).
2. Saves two tiny random `GlmMoeDsaForCausalLM` checkpoints (transformers, initializer_range 0.1
   so logits are not flat; `topk_method="noaux_tc"`):
   A "glm5": GLM-5 attention dims (kv_lora_rank 512, qk_rope 64, qk_nope 192, v_head 256),
      16 heads, index_n_heads 32, index_topk 256 - upstream can run it on Hopper;
   B "odd": 12 heads, index_n_heads 8, index_topk 200 - upstream cannot (DeepGEMM wants 32/64
      index heads, FlashMLA index_topk % 128 == 0).
3. Runs, on 4 prompts of 300-560 token ids (longer than index_topk; max_num_batched_tokens 256
   so prefills are chunked): 48 greedy steps, teacher-forced `prompt_logprobs` over
   prompt + a fixed continuation, and (graphs on, model A) decode tokens/s at batch 16.
   Portable runs set DSA_OVERLAY_PORTABLE=1 and replace FlashMLA's and DeepGEMM's DSA entry points
   by functions that raise; call counters prove which kernels ran.
4. Writes a markdown report to --out (tables + pass/fail lines) and the raw JSON beside it.

Time: runs without a tok/s measurement go first, up to --parallel (default 4) engines at once on the
one GPU (each with a small memory share; a run that fails in vLLM's memory profiling because a
neighbour started or stopped is retried alone at the end); the tok/s runs follow one at a time on
an otherwise idle GPU. The TF logprob noise floor comes from upstream graphs vs upstream eager.

No GPU: `--rejudge run.json[,later.json]` rebuilds the report of stored runs with today's rules.
The code: bench/e2e/ (plan, worker, run, judge, report); this file is the command line only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import plan  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", default="/root/site", help="site-packages holding vLLM 0.23.0")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e_proof.md"))
    ap.add_argument("--apply", action="store_true", help="run apply.py + verify.py on --site first")
    ap.add_argument("--workdir", default=None, help="where to save the tiny checkpoints and dumps")
    ap.add_argument("--only", default=None, help="comma-separated run names (debugging)")
    ap.add_argument("--isolate", action="store_true",
                    help="component isolation runs (eager, with per-layer dumps) instead of the proof")
    ap.add_argument("--no-dump", action="store_true",
                    help="skip the per-layer dumps (and the layer-0 checks) in the default proof")
    ap.add_argument("--parallel", type=int, default=4,
                    help="engines at once for runs without a tok/s measurement (1 = one at a time)")
    ap.add_argument("--rejudge", default=None, metavar="JSON",
                    help="no GPU: rebuild the report of an earlier run from its JSON (runs + dumps) "
                         "with this script's rules, e.g. after a rule change")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from bench.e2e.worker import worker

        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    runs = plan.ISOLATE_RUNS if args.isolate else plan.RUNS
    comparisons = plan.ISOLATE_COMPARISONS if args.isolate else plan.COMPARISONS
    if args.rejudge:
        from bench.e2e.report import rejudge

        text, ok = rejudge(args, runs, comparisons)
        Path(args.out).write_text(text)
    else:
        from bench.e2e.run import prove

        text, ok = prove(args, runs, comparisons)
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""End-to-end proof on the H200: TRITON_MLA_SPARSE + the Triton indexer inside vLLM agree with upstream
(FLASHMLA_SPARSE + DeepGEMM, asked for by name) within upstream's own noise floor, and run with every
vendor DSA kernel made to raise (call counters, and a torch.profiler census of the CUDA kernels).

One command per device call (vLLM staged at /root/site and the overlay applied, bench/README.md):

    . /root/vllm-env.sh && python3 bench/e2e_proof.py --site /root/site --workdir .e2e_work \
        --max-minutes 9 --out $OUT/e2e_proof.md [--gguf-fixture .fixtures/h200]

and, to continue where the budget stopped (same warm machine, same --workdir), the same command with
`--resume`. Plans (`--plan`): `h200` (default; vLLM 0.20.0 and 0.24.0+): per model and cache dtype, in
order of value, upstream eager, Triton eager and upstream with 512-token prefill chunks (its noise
floor), for the GLM-5-shaped model, a DeepSeek-V3.2-shaped one (deepseek_v32, 64 index heads, top-k
2048, prompts of 2600-3500 tokens), a GLM-5.2-style one (index_topk_freq 2: layers without an
indexer), bf16 and fp8_ds_mla, CUDA graphs with decode tok/s, the GGUF fixture's BF16 / Q8_0 / Q4_K_M
files (with --gguf-fixture), and FLASH_ATTN_MLA_SPARSE as a second upstream reference (informative);
`h200-0.23` (the stored 0.23.0 proof, for --rejudge); `isolate` (= --isolate: pins a mismatch on a
component: Triton attention + DeepGEMM indexer, FlashMLA + Triton indexer; all eager, no tok/s);
`isolate-dsv32` (the same for the DeepSeek-V3.2-shaped model, 5 engines, ~3.5 min).

Budget (`--max-minutes`, default 7.8): runs start in plan order while their estimate (plan.estimate_s,
from the stored H200 logs) fits in what is left; the first that does not ends the call. After every
run the report ($OUT/e2e_proof.md), the raw JSON beside it and the tables for bench/RESULTS.md
($OUT/e2e_proof-results.md) are rewritten, so a cut or a killed call still leaves partial tables.
Each engine runs in its own worker process, one at a time (`--parallel N` for more; ../shared/FACTS.md: engines
started together fail at random); a worker prints its result and ends with os._exit (a vLLM 0.26.0
engine does not exit by itself), and one that hangs is killed at its timeout.

Per-layer dumps (default; `--no-dump` skips them; models with top-k <= 256 only): for every attention
call of the teacher-forced pass, the indexer's top-k rows and the attention output; layer 0 sees
bit-identical inputs in every run, so there any top-k difference is an indexer bug and any output
error above bf16 rounding an attention bug. Tokens are matched by KV slot (vLLM 0.26's backends order a
batch's short prefills differently), and with dumps on every run sets vLLM 0.26+'s `sparse_mla_force_mqa`,
so that every token goes through `forward_mqa` in every engine (without it upstream sends prefills no
longer than top-k to dense MHA by its own batch split, and the dumps see other calls). The layer-by-layer comparison of each path with a float64
reference is bench/e2e/layerwise.py.

Quality (issue 17): `--reference-ppl reference_ppl.json[,more.json]` (bench/reference_ppl.py on the trained
reference model, run before in the same session) adds the perplexity rules of bench/e2e/quality.py to the verdict:
the proof passes only when the noise-floor rules and those hold.

No GPU: `--rejudge run.json[,later.json] --plan h200-0.23` rebuilds the report of stored runs with
today's rules. The code: bench/e2e/ (plan, worker, run, judge, report); this file is the command line.
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
    ap.add_argument("--site", default="/root/site", help="site-packages holding vLLM")
    ap.add_argument("--plan", default="h200", choices=sorted(plan.PLANS),
                    help="what to run (h200-0.23: the stored 0.23.0 proof)")
    ap.add_argument("--max-minutes", type=float, default=plan.TIME_BUDGET_S / 60,
                    help="start no run whose estimate does not fit in what is left of this")
    ap.add_argument("--resume", action="store_true",
                    help="keep the finished runs of an earlier call with the same --workdir")
    ap.add_argument("--gguf-fixture", default=None, metavar="DIR",
                    help="tests/fixtures/make_glm_dsa_gguf.py --variant h200 output: run its GGUFs")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e_proof.md"))
    ap.add_argument("--apply", action="store_true", help="run apply.py + verify.py on --site first")
    ap.add_argument("--workdir", default=None, help="where to save the tiny checkpoints and dumps")
    ap.add_argument("--only", default=None, help="comma-separated run names (debugging)")
    ap.add_argument("--isolate", action="store_true",
                    help="component isolation runs (eager, with per-layer dumps) instead of the proof")
    ap.add_argument("--no-dump", action="store_true",
                    help="skip the per-layer dumps (and the layer-0 checks) in the default proof")
    ap.add_argument("--parallel", type=int, default=1,
                    help="engines at once for runs without a tok/s measurement (1 = one at a time)")
    ap.add_argument("--rejudge", default=None, metavar="JSON",
                    help="no GPU: rebuild the report of an earlier run from its JSON (runs + dumps) "
                         "with this script's rules, e.g. after a rule change")
    ap.add_argument("--reference-ppl", default=None, metavar="JSON[,JSON]",
                    help="bench/reference_ppl.py's results for the trained reference model: its perplexity "
                         "rules (bench/e2e/quality.py) join the verdict")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from bench.e2e.worker import serve, worker

        serve(worker, args.worker)
    if args.isolate:
        args.plan = "isolate"
    args.isolate = args.plan.startswith("isolate")
    the_plan = plan.PLANS[args.plan]
    if args.rejudge:
        from bench.e2e.report import rejudge

        text, ok = rejudge(args, the_plan)
        Path(args.out).write_text(text)
    else:
        from bench.e2e.run import prove

        text, ok = prove(args, the_plan)
    if args.reference_ppl:
        from bench.e2e.quality import section

        q_ok, q_text = section(args.reference_ppl.split(","))
        text, ok = text + "\n" + q_text, ok and q_ok
        Path(args.out).write_text(text)
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""The end-to-end proof behind bench/e2e_proof.py (the CLI), one module per responsibility:

plan    what runs (models, runs, comparisons, noise floors, thresholds, instrumented entry points)
worker  one vLLM engine in its own process: greedy, teacher-forced logprobs, dumps, tok/s
run     orchestration on the device: patched vLLM, tiny checkpoints, engines in parallel, results
judge   comparisons of two runs, per-layer dumps, kernel-path check, verdict against the noise floor
report  the markdown report, and --rejudge of stored JSON results

Only worker and run import vLLM / transformers / torch (inside functions); plan, judge and report run
anywhere (judge's dump comparison imports torch when called)."""

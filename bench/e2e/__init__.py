"""The end-to-end proof behind bench/e2e_proof.py (the CLI), one module per responsibility:

plan       what runs (models, Run fields and their derived names, named plans in order of value,
           comparisons, noise floors, thresholds, per-run time estimates, instrumented entry points)
worker     one vLLM engine in its own process: greedy, teacher-forced logprobs, dumps, profiler census,
           tok/s; `serve` prints its result and ends the process with os._exit
run        orchestration on the device: patched vLLM, tiny checkpoints / GGUF files, one engine at a
           time within the time budget, results and report rewritten after every run, --resume
judge      comparisons of two runs, per-layer dumps, kernel-path check, verdict against the noise floor
report     the markdown report, its tables for bench/RESULTS.md, --rejudge of stored JSON
reference  float64 references of one layer's indexer and sparse attention, and their comparisons
layerwise  each path against that reference layer by layer (its own CLI, one device call)

Only worker, run and layerwise import vLLM / transformers / torch (inside functions); plan, judge and
report run anywhere (judge's dump comparison imports torch when called); reference needs torch."""

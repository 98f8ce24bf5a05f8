#!/usr/bin/env python3
"""Held-out perplexity of the trained reference model (bench/train_reference.py) through vLLM and transformers.

Issue 17's quality criterion: the same held-out windows (the first --windows non-overlapping --seq-token windows
of the reference's heldout.npy) scored by each vLLM engine from its prompt_logprobs, and by transformers in float32
(the reference); plus greedy continuations (--greedy N x L: N prompts of the first half of a window, L tokens) compared
token by token with the float32 reference's. One engine per process, one at a time (the e2e harness's workers; never
two of these commands side by side: ../shared/FACTS.md, and 4 of 9 engines lost that way on 2026-12-02). The report
ends with the quality rules of bench/e2e/quality.py; `--merge A.json B.json ... --out DIR` joins the results of
several calls (no GPU).

    python bench/reference_ppl.py --ref /root/ref --out $OUT \\
        [--engines upstream:auto,upstream:fp8_ds_mla,triton:auto,triton:fp8_ds_mla] [--gguf BF16=/root/ref/m-BF16.gguf]

Engines: PATH:KV[:graphs], PATH upstream (FLASHMLA_SPARSE + DeepGEMM by name, overlay switch off) or triton
(TRITON_MLA_SPARSE + the Triton indexer); KV auto (bf16) or fp8_ds_mla. --gguf TAG=FILE adds a Triton bf16 engine
serving that file (tokenizer: --ref). --repeats N scores every engine N times and pools the runs (their spread
is in the report). The vLLM on PYTHONPATH is used as it is (apply the overlay first).
Writes $OUT/reference_ppl.md and reference_ppl.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e import quality  # noqa: E402
from bench.e2e.run import finish_worker, start_worker  # noqa: E402
from bench.e2e.worker import serve  # noqa: E402


def windows(ids, seq: int, n: int) -> list[list[int]]:
    """The first `n` non-overlapping `seq`-token windows of `ids` (fewer if it is shorter)."""
    return [list(map(int, ids[i * seq:(i + 1) * seq])) for i in range(min(n, len(ids) // seq))]


def nll_sum(prompt_logprobs, tokens: list[int]) -> tuple[float, int]:
    """(sum of -log p(token t | tokens < t) over t >= 1, count) from vLLM's prompt_logprobs of `tokens` (one dict
    per position, None at position 0, each holding the actual token among its entries)."""
    total = 0.0
    for pos, (d, t) in enumerate(zip(prompt_logprobs[1:], tokens[1:]), start=1):
        entry = None if d is None else d.get(t)
        if entry is None:
            raise ValueError(f"prompt_logprobs at position {pos} lack token {t}")
        lp = getattr(entry, "logprob", entry)
        if not math.isfinite(lp):
            raise ValueError(f"non-finite logprob {lp} at position {pos}")
        total -= lp
    return total, len(tokens) - 1


def ppl(total: float, count: int) -> float:
    return math.exp(total / count)


def reference_scores(ref: str, wins: list[list[int]], prompts: list[list[int]], steps: int,
                     device: str | None = None) -> dict:
    """transformers in float32: the windows' NLL and greedy continuations of `prompts` (`steps` tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).to(dev).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in wins:
            x = torch.tensor([w], device=dev)
            logits = model(input_ids=x).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += len(w) - 1
        greedy, margins = [], []
        for p in prompts:
            x, m = torch.tensor([p], device=dev), []
            for _ in range(steps):
                top = torch.log_softmax(model(input_ids=x).logits[0, -1].double(), -1).topk(2)
                m.append(round(float(top.values[0] - top.values[1]), 5))
                x = torch.cat([x, top.indices[:1].view(1, 1)], dim=1)
            greedy.append(x[0, len(p):].tolist())
            margins.append(m)
    # margins: per greedy step, the float32 logprob gap between its first and second choice (a divergence where it
    # is small is a near-tie that bf16 rounding may flip)
    return dict(nll=total, count=count, greedy=greedy, greedy_margin=margins)


def engine(spec: dict) -> dict:
    """One vLLM engine (worker process): prompt_logprobs of every window, greedy continuations."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["DSA_OVERLAY_PORTABLE"] = "1" if spec["path"] == "triton" else "0"
    os.environ["DSA_OVERLAY_INDEXER"] = "triton" if spec["path"] == "triton" else "auto"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], tokenizer=spec["tokenizer"], skip_tokenizer_init=True, dtype="bfloat16",
                  seed=0, max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["chunk"],
                  gpu_memory_utilization=0.5, kv_cache_dtype=spec["kv"], enable_prefix_caching=False)
    if spec["path"] == "upstream":
        kwargs["attention_backend"] = "FLASHMLA_SPARSE"
    if not spec["graphs"]:
        kwargs["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    res = {"startup_s": round(time.perf_counter() - t0, 1)}
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in spec["windows"]], sp, use_tqdm=False)
    total, count = 0.0, 0
    for o, w in zip(outs, spec["windows"]):
        t, c = nll_sum(o.prompt_logprobs, w)
        total, count = total + t, count + c
    gp = SamplingParams(temperature=0.0, max_tokens=spec["steps"], ignore_eos=True, detokenize=False)
    greedy = [list(o.outputs[0].token_ids) for o in
              llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], gp, use_tqdm=False)]
    res.update(nll=total, count=count, greedy=greedy)
    return res


same_prefix = quality.same_prefix


def report(results: dict, meta: dict) -> str:
    """The report's head and its engines' table (bench/e2e/quality.py's, the one the e2e proof shows too)."""
    return "\n".join([f"### Held-out perplexity of the reference model ({meta['device']}, {meta['how']})", "",
                      f"{meta['windows']} windows of {meta['seq']} tokens ({meta['tokens']} predictions) from "
                      f"heldout.npy; greedy: {meta['greedy']}.", "", quality.table(results)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", help="bench/train_reference.py's --out folder")
    ap.add_argument("--engines", default="upstream:auto,triton:auto,upstream:fp8_ds_mla,triton:fp8_ds_mla")
    ap.add_argument("--gguf", action="append", default=[], metavar="TAG=FILE")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--greedy", default="8x64", help="N x L: N prompts (half a window each), L greedy tokens")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--repeats", type=int, default=1,
                    help="score every engine N times (each pass in the same order) and pool the runs: one run moves by "
                         "up to ~0.1%% on the H200, the BF16 GGUF rule's limit (bench/e2e/quality.py)")
    ap.add_argument("--no-reference", action="store_true", help="skip the transformers float32 reference")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no GPU: merge the reference_ppl.json of several calls into --out (report and verdicts)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        serve(engine, args.worker)
    if args.merge:
        data = quality.merge(args.merge)
        return write_out(Path(args.out), data["meta"], data["results"])

    import numpy as np
    import torch

    ids = np.load(Path(args.ref) / "heldout.npy")
    wins = windows(ids, args.seq, args.windows)
    n_greedy, steps = map(int, args.greedy.lower().split("x"))
    prompts = [w[: args.seq // 2] for w in wins[:n_greedy]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", windows=len(wins),
                seq=args.seq, tokens=sum(len(w) - 1 for w in wins), greedy=f"{len(prompts)} x {steps}",
                how=f"engines {args.engines}; chunk {args.chunk}")
    results: dict = {}

    def write():
        write_out(out, meta, results, quiet=True)

    if not args.no_reference:
        t0 = time.perf_counter()
        results["transformers fp32"] = reference_scores(args.ref, wins, prompts, steps)
        results["transformers fp32"]["startup_s"] = round(time.perf_counter() - t0, 1)
        write()
    todo = [(e, dict(model=args.ref, path=e.split(":")[0], kv=e.split(":")[1], graphs=e.endswith(":graphs")))
            for e in args.engines.split(",") if e]
    todo += [(f"gguf {tag}:triton", dict(model=f, path="triton", kv="auto", graphs=False))
             for tag, f in (g.split("=", 1) for g in args.gguf)]
    for rep in range(args.repeats):
        for name, spec in todo:
            spec.update(tokenizer=args.ref, windows=wins, prompts=prompts, steps=steps, chunk=args.chunk,
                        max_model_len=args.seq + steps)
            t0 = time.perf_counter()
            r = finish_worker(start_worker(spec, os.environ.get("PYTHONPATH", ""), cli=Path(__file__)), t0,
                              args.timeout)
            results[name] = quality.pool(results.get(name), r)
            print(f"[ppl] {name} (run {rep + 1}): "
                  f"{json.dumps({k: v for k, v in r.items() if k not in ('greedy', 'log')})[:800]}", flush=True)
            write()
    return write_out(out, meta, results)


def write_out(out: Path, meta: dict, results: dict, quiet: bool = False) -> int:
    """reference_ppl.json and .md (the engines' table, then the quality rules' verdicts) in `out`; returns 0 (the
    verdicts are the report's: e2e_proof.py --reference-ppl is where they decide an exit status)."""
    out.mkdir(parents=True, exist_ok=True)
    _, verdicts = quality.judge(results)
    text = report(results, meta) + "\n" + verdicts
    (out / "reference_ppl.json").write_text(json.dumps({"meta": meta, "results": results}))
    (out / "reference_ppl.md").write_text(text)
    if not quiet:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

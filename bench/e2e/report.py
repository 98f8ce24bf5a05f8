"""The proof's markdown report, and --rejudge: rebuilding it from stored JSON results (bench/results/)
with the current rules, no GPU needed."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from .judge import compare, judge, kernels_ok
from .plan import (FLOOR_FACTOR, FLOORS, GREEDY_STEPS, LAYER0_ERR_P99, LAYER0_SAME_SET, MIN_IDENTICAL_STEPS,
                   MUST_MATCH, PROMPT_LENS, TPS_BATCH, index_topk)


def report(args, how, log, results, runs, comparisons, dumps, elapsed) -> tuple[str, bool]:
    """-> (markdown, overall pass). args: isolate, device_name; how: which vLLM trees ran; log: the
    apply / verify output; results / dumps: per run name, as run.prove stores them."""
    ok = True
    lines = [f"# E2E proof{' (isolation)' if args.isolate else ''}: TRITON_MLA_SPARSE + Triton "
             f"indexer in vLLM ({time.strftime('%Y-%m-%d')})",
             "", f"Device: {args.device_name}. vLLM: {how}. Total wall time {elapsed:.0f} s.", "",
             "| run | status | wall s | startup s | triton kernel calls | vendor DSA calls | "
             "decode tok/s |", "|---|---|---|---|---|---|---|"]
    for name, model, path, *_ in runs:
        r = results.get(name, {"error": "not run"})
        if "error" in r:
            lines.append(f"| {name} | FAILED: {r['error']} | {r.get('wall_s', '')} | | | | |")
            ok = False
            continue
        good = kernels_ok(path, r)
        ok &= good
        lines.append(f"| {name} | {'ok' if good else 'WRONG KERNELS'} | {r.get('wall_s')} | "
                     f"{r['startup_s']} | {sum(r['triton_calls'].values())} | "
                     f"{sum(r['vendor_calls'].values())} | {r.get('decode_tok_s', '')} |")
    topks = ", ".join(f"{m} {index_topk(m)}" for m in dict.fromkeys(r[1] for r in runs))
    lines += ["", f"Greedy: {GREEDY_STEPS} steps x {len(PROMPT_LENS)} prompts "
              f"({', '.join(map(str, PROMPT_LENS))} tokens). Teacher-forced (TF): prompt_logprobs "
              "at every position of prompt + fixed continuation; split at position index_topk of the "
              f"compared model ({topks}: below it the top-k keeps every position, so the indexer cannot "
              "matter).",
              "", "| comparison | identical greedy steps (min) | TF max / mean abs diff | TF mean "
              "pos<topk / pos>=topk | top-5 overlap | step logprob max / mean | verdict |",
              "|---|---|---|---|---|---|---|"]
    stats = {}
    for cand, ref, _ in comparisons:
        a, b = results.get(cand, {}), results.get(ref, {})
        if "tokens" in a and "tokens" in b:
            stats[cand] = compare(a, b, index_topk(cand))
    floor_names = {f for fs in FLOORS.values() for f in fs}
    for cand, ref, what in comparisons:
        c = stats.get(cand)
        if c is None:
            lines.append(f"| {what} | n/a | | | | | not run |")
            ok &= cand not in MUST_MATCH or args.isolate
            continue
        verdict = "noise floor" if cand in floor_names else "informative"
        if cand in MUST_MATCH and not args.isolate:
            kv = MUST_MATCH[cand]
            same_mode = cand.split("/")[3] == ref.split("/")[3]   # eager/graphs
            good, verdict = judge(c, [stats.get(f) for f in FLOORS[kv]], dumps.get(cand), kv,
                                  same_mode)
            ok &= good
        near = {True: "; divergences at near-ties", False: "; a divergence NOT at a near-tie",
                None: ""}[c["divergences_near_ties"]]
        lines.append(f"| {what} | {c['min_identical_steps']}/{GREEDY_STEPS} "
                     f"({' '.join(map(str, c['identical_steps']))}{near}) | "
                     f"{c['tf_max']:.4f} / {c['tf_mean']:.5f} | {c['tf_mean_short']:.5f} / "
                     f"{c['tf_mean_long']:.5f} | "
                     f"{'n/a' if c['top5_overlap'] is None else format(c['top5_overlap'], '.3f')} | "
                     f"{c['step_max']:.4f} / {c['step_mean']:.5f} | {verdict} |")
    if not args.isolate:
        lines += ["", f"A checked row passes when: TF mean |dlogprob| <= {FLOOR_FACTOR} x the largest "
                  "noise floor of its cache dtype and TF top-5 overlap >= the lowest floor's - 0.02; "
                  "if upstream passes it against itself (every floor), every prompt's first greedy "
                  "divergence is a near-tie (each token in the other run's top-5, vLLM's "
                  f"check_logprobs_close) or comes after {MIN_IDENTICAL_STEPS} steps; and, when both "
                  "runs used the same execution mode (so layer 0 sees the same bits), at layer 0 the "
                  f"top-k sets agree for >= {LAYER0_SAME_SET:.1%} of tokens and the attention "
                  f"output's per-token error p99 is <= {LAYER0_ERR_P99['auto']:.0e} (bf16) / "
                  f"{LAYER0_ERR_P99['fp8_ds_mla']:.0e} (fp8_ds_mla). Why a noise floor and not "
                  "identical greedy tokens: bench/RESULTS.md (upstream against itself "
                  "keeps 1 of 48 greedy steps on this model)."]
    tps = {n: results.get(n, {}).get("decode_tok_s") for n, *_ in runs}
    for kv in ("bf16", "fp8_ds_mla"):
        up, tr = tps.get(f"glm5/upstream/{kv}/graphs"), tps.get(f"glm5/triton/{kv}/graphs")
        if up and tr:
            lines.append(f"\nDecode throughput {kv}, batch {TPS_BATCH}: Triton {tr} tok/s vs "
                         f"upstream {up} tok/s ({tr / up:.2f}x; goal >= 0.90x).")
    if dumps:
        lines += ["", "## Per-layer dumps of the TF pass vs upstream (same inputs at layer 0)", "",
                  "same set = tokens whose top-k set equals upstream's; err = per token max|a-b| / "
                  "max|upstream| of the attention output before W_UV (bf16 rounding: ~4e-3).", "",
                  "| run | layer | positions | tokens | same set | mean overlap | err median | "
                  "err p99 | err max |", "|---|---|---|---|---|---|---|---|---|"]
        for cand, d in dumps.items():
            if "error" in d:
                lines.append(f"| {cand} | {d['error']} | | | | | | | |")
                continue
            for r in d["rows"]:
                lines.append(f"| {cand} | {r['layer']} | {r['span']} | {r['tokens']} | "
                             f"{r['same_set']:.4f} | {r['overlap']:.4f} | {r['err_median']:.2e} | "
                             f"{r['err_p99']:.2e} | {r['err_max']:.2e} |")
    lines += ["", f"Overall: {'PASS' if ok else 'FAIL'}"]
    if log:
        lines += ["", "<details><summary>apply / verify output</summary>", "", "```",
                  *log, "```", "</details>"]
    for name, r in results.items():
        if "error" in r:
            lines += ["", f"<details><summary>{name} log</summary>", "", "```",
                      r.get("log", ""), "```", "</details>"]
    return "\n".join(lines) + "\n", ok


def merge_runs(parts: list[dict]) -> dict:
    """Stored proof runs (same script version: same seeded weights and prompts) as one: the first is
    the base; a later one adds the runs the earlier ones lack and replaces those that failed there."""
    data: dict = {"runs": {}, "dumps": {}}
    for part in parts:
        data.setdefault("meta", part.get("meta", {}))
        for name, r in part["runs"].items():
            have = data["runs"].get(name)
            if have is None or ("error" in have and "error" not in r):
                data["runs"][name] = r
        for name, d in part.get("dumps", {}).items():
            data["dumps"].setdefault(name, d)
    return data


def load_parts(paths: list[str]) -> list[dict]:
    """Stored proof JSONs (plain or gzip-compressed), in order."""
    parts = []
    for path in paths:
        raw = Path(path).read_bytes()
        parts.append(json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw))
    return parts


def rejudge(args, runs: list, comparisons: list) -> tuple[str, bool]:
    """The report of stored runs (args.rejudge: comma-separated JSON paths, merged by merge_runs)."""
    paths = args.rejudge.split(",")
    data = merge_runs(load_parts(paths))
    meta = data.get("meta", {})
    args.device_name = meta.get("device", "see the original report")
    how = (f"{meta.get('how', 'see the original report')}; re-judged from "
           f"{', '.join(Path(x).name for x in paths)}")
    return report(args, how, [], data["runs"], runs, comparisons, data.get("dumps", {}),
                  meta.get("elapsed_s", float("nan")))

"""The proof's markdown report (and its tables for bench/RESULTS.md), and --rejudge: rebuilding it from
stored JSON results (bench/results/) with the current rules, no GPU needed."""

from __future__ import annotations

import gzip
import json
import subprocess
import time
from pathlib import Path

from .judge import compare, judge, kernels_ok
from .plan import (FLOOR_FACTOR, GREEDY_STEPS, LAYER0_ERR_P99, LAYER0_SAME_SET, MIN_IDENTICAL_STEPS, MODELS,
                   TPS_BATCH, index_topk, needed_runs)


def _skipped(r: dict) -> bool:
    return str(r.get("error", "")).startswith("skipped")


def _runs_table(results: dict, runs: list, needed: set | None = None) -> tuple[list[str], bool]:
    """One row per run: status, times, kernel counts (and the profiler census when runs took one).
    Not ok: a run that failed (or ran the wrong kernels), unless `needed` is given and leaves it out
    (it feeds informative rows only)."""
    census = any("census" in results.get(r.name, {}) for r in runs)
    head = ("| run | status | wall s | startup s | triton kernel calls | vendor DSA calls | "
            + ("vendor DSA kernels (profiler) | " if census else "") + "decode tok/s |")
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    ok = True
    for run in runs:
        name = run.name
        r = results.get(name, {"error": "not run"})
        if "error" in r:
            status = r["error"] if _skipped(r) else f"FAILED: {r['error']}"
            lines.append(f"| {name} | {status} | {r.get('wall_s', '')} | | | |{' |' if census else ''} |")
            ok &= _skipped(r) or (needed is not None and name not in needed)
            continue
        good = kernels_ok(run.path, r)
        ok &= good
        cen = (f" {sum(r['census']['vendor'].values())} |" if "census" in r else " |") if census else ""
        lines.append(f"| {name} | {'ok' if good else 'WRONG KERNELS'} | {r.get('wall_s')} | "
                     f"{r['startup_s']} | {sum(r['triton_calls'].values())} | "
                     f"{sum(r['vendor_calls'].values())} |{cen} {r.get('decode_tok_s', '')} |")
    return lines, ok


def _comparisons_table(args, results: dict, runs: list, plan, dumps: dict) -> tuple[list[str], bool]:
    """One row per comparison: greedy steps, TF logprob differences, top-5 overlap, verdict."""
    by_name = {r.name: r for r in plan.runs}
    lines = ["| comparison | identical greedy steps (min) | TF max / mean abs diff | TF mean "
             "pos<topk / pos>=topk | top-5 overlap | step logprob max / mean | verdict |",
             "|---|---|---|---|---|---|---|"]
    ok = True
    stats = {}
    for cand, ref, _ in plan.comparisons:
        a, b = results.get(cand, {}), results.get(ref, {})
        if "tokens" in a and "tokens" in b:
            stats[cand] = compare(a, b, index_topk(cand))
    floor_names = {f for fs in plan.floors.values() for f in fs}
    for cand, ref, what in plan.comparisons:
        c = stats.get(cand)
        if c is None:
            lines.append(f"| {what} | n/a | | | | | not run |")
            skipped = any(_skipped(results.get(n, {})) for n in (cand, ref))
            ok &= cand not in plan.must_match or args.isolate or skipped
            continue
        verdict = "noise floor" if cand in floor_names else "informative"
        if cand in plan.must_match and not args.isolate:
            same_mode = by_name[cand].graphs == by_name[ref].graphs
            good, verdict = judge(c, [stats.get(f) for f in plan.floors[plan.must_match[cand]]],
                                  dumps.get(cand), by_name[cand].kv, same_mode)
            ok &= good
        near = {True: "; divergences at near-ties", False: "; a divergence NOT at a near-tie",
                None: ""}[c["divergences_near_ties"]]
        lines.append(f"| {what} | {c['min_identical_steps']}/{GREEDY_STEPS} "
                     f"({' '.join(map(str, c['identical_steps']))}{near}) | "
                     f"{c['tf_max']:.4f} / {c['tf_mean']:.5f} | {c['tf_mean_short']:.5f} / "
                     f"{c['tf_mean_long']:.5f} | "
                     f"{'n/a' if c['top5_overlap'] is None else format(c['top5_overlap'], '.3f')} | "
                     f"{c['step_max']:.4f} / {c['step_mean']:.5f} | {verdict} |")
    return lines, ok


def _prompts_line(runs: list) -> str:
    models = list(dict.fromkeys(r.model for r in runs))
    lens = list(dict.fromkeys(MODELS[m].prompt_lens for m in models))
    prompt_text = "; ".join(
        f"{len(ls)} prompts ({', '.join(map(str, ls))} tokens)"
        + ("" if len(lens) == 1 else f" for {', '.join(m for m in models if MODELS[m].prompt_lens == ls)}")
        for ls in lens)
    topks = ", ".join(f"{m} {index_topk(m)}" for m in models)
    return (f"Greedy: {GREEDY_STEPS} steps x {prompt_text}. Teacher-forced (TF): prompt_logprobs "
            "at every position of prompt + fixed continuation; split at position index_topk of the "
            f"compared model ({topks}: below it the top-k keeps every position, so the indexer cannot "
            "matter).")


def _throughput(results: dict, runs: list) -> list[str]:
    lines = []
    tps = {r.name: results.get(r.name, {}).get("decode_tok_s") for r in runs}
    for run in runs:
        if not (run.tps and run.path == "upstream"):
            continue
        up, tr = tps.get(run.name), tps.get(run._replace(path="triton").name)
        label = run.name.split("/")[2] + ("" if run.model == "glm5" else f" ({run.model})")
        if up and tr:
            lines.append(f"\nDecode throughput {label}, batch {TPS_BATCH}: Triton {tr} tok/s vs "
                         f"upstream {up} tok/s ({tr / up:.2f}x; goal >= 0.90x).")
    return lines


def _overall(ok: bool, results: dict, runs: list) -> tuple[str, bool]:
    """The last line, and whether the proof passed: every run ran with the right kernels and every
    checked comparison passed. A budget cut that failed nothing is INCOMPLETE, not a pass."""
    skipped = sum(_skipped(results.get(r.name, {})) for r in runs)
    if ok and skipped:
        return f"Overall: INCOMPLETE ({skipped} of {len(runs)} runs skipped; nothing that ran failed)", False
    return f"Overall: {'PASS' if ok else 'FAIL'}", ok


def report(args, how, log, results, runs, plan, dumps, elapsed) -> tuple[str, bool]:
    """-> (markdown, overall pass). args: isolate, device_name; how: which vLLM trees ran; log: the
    apply / verify output; runs: the plan's runs this call covers; results / dumps: per run name, as
    run.prove stores them."""
    lines = [f"# E2E proof{' (isolation)' if args.isolate else ''}: TRITON_MLA_SPARSE + Triton "
             f"indexer in vLLM ({time.strftime('%Y-%m-%d')})",
             "", f"Device: {args.device_name}. vLLM: {how}. Total wall time {elapsed:.0f} s.", ""]
    table, ok = _runs_table(results, runs, None if args.isolate else needed_runs(plan))
    comps, good = _comparisons_table(args, results, runs, plan, dumps)
    ok &= good
    lines += table + ["", _prompts_line(runs), ""] + comps
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
    lines += _throughput(results, runs)
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
    last, ok = _overall(ok, results, runs)
    lines += ["", last]
    if log:
        lines += ["", "<details><summary>apply / verify output</summary>", "", "```",
                  *log, "```", "</details>"]
    for name, r in results.items():
        if "error" in r and not _skipped(r):
            lines += ["", f"<details><summary>{name} log</summary>", "", "```",
                      r.get("log", ""), "```", "</details>"]
    return "\n".join(lines) + "\n", ok


def results_markdown(args, how, results, runs, plan, dumps, elapsed) -> str:
    """The tables for bench/RESULTS.md (no logs, no per-layer dumps): a heading with device, vLLM and
    commit, the runs, the comparisons with verdicts, throughput, the overall line."""
    table, ok = _runs_table(results, runs, None if args.isolate else needed_runs(plan))
    comps, good = _comparisons_table(args, results, runs, plan, dumps)
    lines = [f"### E2E proof on {args.device_name}, {how} ({time.strftime('%Y-%m-%d')}, commit "
             f"{_commit()}, {elapsed:.0f} s)", "", *table, "", _prompts_line(runs), "", *comps,
             *_throughput(results, runs), "",
             _overall(ok and good, results, runs)[0] + " (per-layer dump tables: the full report)"]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                          capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


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


def rejudge(args, plan) -> tuple[str, bool]:
    """The report of stored runs (args.rejudge: comma-separated JSON paths, merged by merge_runs)."""
    paths = args.rejudge.split(",")
    data = merge_runs(load_parts(paths))
    meta = data.get("meta", {})
    args.device_name = meta.get("device", "see the original report")
    how = (f"{meta.get('how', 'see the original report')}; re-judged from "
           f"{', '.join(Path(x).name for x in paths)}")
    return report(args, how, [], data["runs"], plan.runs, plan, data.get("dumps", {}),
                  meta.get("elapsed_s", float("nan")))

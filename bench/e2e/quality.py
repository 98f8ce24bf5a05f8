"""The quality criterion of the e2e proofs (issue 17): held-out perplexity of the trained reference model
(bench/train_reference.py), scored by bench/reference_ppl.py, beside the noise-floor rules of judge.py.

A random tiny model can only show that two paths agree; a trained one shows what a difference costs. Rules, each
on the same held-out windows:
- TRITON_MLA_SPARSE + the Triton indexer within PPL_TRITON_VS_UPSTREAM of upstream (FLASHMLA_SPARSE + DeepGEMM),
  per KV-cache dtype;
- the BF16 GGUF through the overlay within PPL_GGUF_BF16 of the safetensors checkpoint on the same path.
A rule whose two engines were not both measured fails ("not measured"): a proof that skipped them proves nothing.
The quantized GGUFs are reported beside llama.cpp's published figures, not judged (their cost is the format's).

Repeats: vLLM does not score the same windows identically twice (on the H200, 2026-12-02: upstream bf16 22.1323
then 22.1080, 0.11% apart, the same engine, model and windows), so one run per engine cannot resolve a 0.1% rule.
`merge` pools every measurement of an engine (the NLL summed over its runs: the perplexity of all of them), the
table shows each engine's runs and their spread, and the verdicts name the largest spread seen: a limit below it
is below what the instrument resolves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

PPL_TRITON_VS_UPSTREAM = 0.005
PPL_GGUF_BF16 = 0.001
REFERENCE = "transformers fp32"

# llama.cpp's own figures for the types (its quantize tool's quantize.cpp, QUANT_OPTIONS, in the llama.cpp that
# llama-cpp-python 0.3.36 vendors: the one that made these files); absolute perplexity increases on other models.
LLAMA_CPP_PUBLISHED = {
    "BF16": "-0.0050 ppl @ Mistral-7B",
    "Q8_0": "+0.0026 ppl @ Llama-3-8B",
    "Q4_K_M": "+0.1754 ppl @ Llama-3-8B",
    "IQ4_XS": "none (\"4.25 bpw non-linear quantization\")",
    "UD_MIX": "none (a per-tensor mix: attention Q8_0, routed experts IQ4_XS, the rest Q4_K_M)",
}


def ppl(r: dict) -> float | None:
    """Perplexity of one result (None where the engine failed)."""
    if not r or "error" in r or not r.get("count"):
        return None
    return math.exp(r["nll"] / r["count"])


def runs(r: dict) -> list[dict]:
    """The separate measurements pooled in one result ({nll, count, ...} each; a result not merged is one run)."""
    if not r or "error" in r:
        return []
    return r.get("runs") or [{k: r[k] for k in ("nll", "count", "startup_s", "wall_s") if k in r}]


def spread(r: dict) -> float | None:
    """Largest relative difference between the perplexities of one engine's runs (None below two runs)."""
    ps = [math.exp(x["nll"] / x["count"]) for x in runs(r)]
    return max(ps) / min(ps) - 1 if len(ps) > 1 else None


def pool(prev: dict | None, r: dict) -> dict:
    """One engine's result after another measurement `r`: nll and count become the sums over the runs (so ppl() is
    the perplexity over all of them) and "runs" lists each; a failure never replaces a measurement, a measurement
    replaces a failure; the greedy continuations stay the first run's."""
    if prev is None or ("error" in prev and "error" not in r):
        return r
    if "error" in r:
        return prev
    both = runs(prev) + runs(r)
    return dict(prev, runs=both, nll=sum(x["nll"] for x in both), count=sum(x["count"] for x in both))


def merge(paths: list[str | Path]) -> dict:
    """One {"meta", "results"} from several reference_ppl.json of the same reference and windows (the engines of
    several device calls); the measurements of one engine pool (see pool)."""
    meta, results = None, {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        m = {k: data["meta"][k] for k in ("windows", "seq", "tokens") if k in data["meta"]}
        if meta is None:
            meta = dict(data["meta"])
            first = m
        elif m != first:
            raise ValueError(f"{p}: other windows ({m}) than {paths[0]} ({first}): not the same measurement")
        for name, r in data["results"].items():
            results[name] = pool(results.get(name), r)
    if meta is None:
        raise ValueError("no reference_ppl.json given")
    meta["how"] = "merged from " + ", ".join(Path(p).parent.name + "/" + Path(p).name for p in paths)
    return {"meta": meta, "results": results}


def _rel(a: float, b: float) -> float:
    return a / b - 1


def _engines(results: dict, name: str) -> str:
    n = len(runs(results.get(name)))
    return f"{name} ({n} runs)" if n > 1 else name


def rules(results: dict) -> list[dict]:
    """Every rule: name, the two engines, their relative difference, the limit and whether it holds."""
    out = []

    def rule(name, cand, base, limit):
        pc, pb = ppl(results.get(cand)), ppl(results.get(base))
        engines = f"{_engines(results, cand)} vs {_engines(results, base)}"
        if pc is None or pb is None:
            missing = [n for n, v in ((cand, pc), (base, pb)) if v is None]
            out.append(dict(rule=name, cand=cand, base=base, engines=engines, limit=limit, delta=None, ok=False,
                            why="not measured: " + ", ".join(missing)))
            return
        d = _rel(pc, pb)
        out.append(dict(rule=name, cand=cand, base=base, engines=engines, limit=limit, delta=d, ok=abs(d) <= limit,
                        why=f"{100 * d:+.3f}% (limit {100 * limit:.1f}%)"))

    for kv in ("auto", "fp8_ds_mla"):
        rule(f"Triton vs upstream, {kv} cache", f"triton:{kv}", f"upstream:{kv}", PPL_TRITON_VS_UPSTREAM)
    rule("BF16 GGUF vs safetensors (Triton path)", "gguf BF16:triton", "triton:auto", PPL_GGUF_BF16)
    return out


def judge(results: dict) -> tuple[bool, str]:
    """(every rule holds, the rules' verdicts as a markdown table, then the largest run-to-run spread seen)."""
    rs = rules(results)
    ok = all(r["ok"] for r in rs)
    lines = ["| rule | engines | delta | verdict |", "|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {r['rule']} | {r['engines']} | {r['why']} | {'PASS' if r['ok'] else 'FAIL'} |")
    spreads = [(spread(r), name) for name, r in results.items() if spread(r) is not None]
    if spreads:
        s, name = max(spreads)
        lines += ["", f"Largest run-to-run spread of one engine on these windows: {100 * s:.3f}% ({name}, "
                      f"{len(runs(results[name]))} runs); a limit below it is below what one run resolves."]
    return ok, "\n".join(lines) + "\n"


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _greedy(r: dict, ref: dict | None) -> str:
    """Greedy tokens identical to the float32 reference's, and each prompt's first divergence @ the reference's
    top-2 logprob gap there (a divergence at a small gap is a near-tie that bf16 rounding may flip)."""
    if not ref or "greedy" not in ref or "greedy" not in r or r is ref:
        return "-"
    firsts = [same_prefix(a, b) for a, b in zip(r["greedy"], ref["greedy"])]
    same = sum(x == y for a, b in zip(r["greedy"], ref["greedy"]) for x, y in zip(a, b))
    margins = ref.get("greedy_margin")
    at = [f"{n}@{margins[i][n]:.3f}" if margins and n < len(margins[i]) else str(n) for i, n in enumerate(firsts)]
    return f"{same}/{sum(len(b) for b in ref['greedy'])} ({' '.join(at)})"


def table(results: dict) -> str:
    """Perplexity per engine (pooled over its runs, their number and spread), relative to the float32 reference
    and to upstream with the same cache dtype, the GGUF types' increase over the BF16 GGUF beside llama.cpp's
    published figure, greedy continuations against the reference's, startup seconds."""
    from .run import failure_line

    ref_r = results.get(REFERENCE)
    ref, bf16 = ppl(ref_r), ppl(results.get("gguf BF16:triton"))
    lines = ["| engine | perplexity | runs (spread) | vs fp32 | vs upstream, same cache | vs BF16 GGUF | llama.cpp's "
             "published figure for the type | greedy tokens identical to fp32 (first divergence per prompt@fp32's "
             "top-2 logprob gap there) | startup s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        p = ppl(r)
        if p is None:
            lines.append(f"| {name} | not measured ({failure_line(r) if 'error' in r else '?'}) | | | | | | | |")
            continue
        kv = name.split(":")[1] if name.startswith(("triton:", "upstream:")) else "auto"
        up = ppl(results.get(f"upstream:{kv}"))
        tag = name[5:].split(":")[0] if name.startswith("gguf ") else None
        f = lambda a, b: f"{100 * _rel(a, b):+.3f}%" if a is not None and b is not None else "-"  # noqa: E731
        n, s = len(runs(r)), spread(r)
        lines.append(f"| {name} | {p:.4f} | {n}{f' ({100 * s:.3f}%)' if s is not None else ''} | "
                     f"{f(p, ref) if name != REFERENCE else '-'} | "
                     f"{f(p, up) if name != REFERENCE and not name.startswith('upstream:') else '-'} | "
                     f"{f(p, bf16) if tag and tag != 'BF16' else '-'} | "
                     f"{LLAMA_CPP_PUBLISHED.get(tag, '-') if tag else '-'} | {_greedy(r, ref_r)} | "
                     f"{r.get('startup_s', '-')} |")
    return "\n".join(lines) + "\n"


def section(paths: list[str | Path]) -> tuple[bool, str]:
    """The proof report's quality section from reference_ppl.json files."""
    data = merge(paths)
    ok, verdicts = judge(data["results"])
    m = data["meta"]
    head = (f"### Quality criterion: held-out perplexity of the trained reference ({m.get('device', '?')}; "
            f"{m.get('windows')} windows of {m.get('seq')} tokens; {m['how']})\n\n")
    return ok, head + table(data["results"]) + "\n" + verdicts

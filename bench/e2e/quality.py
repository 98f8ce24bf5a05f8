"""The quality criterion of the e2e proofs (issue 17): held-out perplexity of the trained reference model
(bench/train_reference.py), scored by bench/reference_ppl.py, beside the noise-floor rules of judge.py.

A random tiny model can only show that two paths agree; a trained one shows what a difference costs. Rules, each
on the same held-out windows:
- TRITON_MLA_SPARSE + the Triton indexer within PPL_TRITON_VS_UPSTREAM of upstream (FLASHMLA_SPARSE + DeepGEMM),
  per KV-cache dtype;
- the BF16 GGUF through the overlay within PPL_GGUF_BF16 of the safetensors checkpoint on the same path.
A rule whose two engines were not both measured fails ("not measured"): a proof that skipped them proves nothing.
The quantized GGUFs are reported beside llama.cpp's published figures, not judged (their cost is the format's).
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


def merge(paths: list[str | Path]) -> dict:
    """One {"meta", "results"} from several reference_ppl.json of the same reference and windows (e.g. the
    engines of two device calls); a later measurement of an engine replaces an earlier one unless it failed
    where the earlier did not."""
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
            if name in results and "error" in r and "error" not in results[name]:
                continue
            results[name] = r
    if meta is None:
        raise ValueError("no reference_ppl.json given")
    meta["how"] = "merged from " + ", ".join(Path(p).parent.name + "/" + Path(p).name for p in paths)
    return {"meta": meta, "results": results}


def _rel(a: float, b: float) -> float:
    return a / b - 1


def rules(results: dict) -> list[dict]:
    """Every rule: name, the two engines, their relative difference, the limit and whether it holds."""
    out = []

    def rule(name, cand, base, limit):
        pc, pb = ppl(results.get(cand)), ppl(results.get(base))
        if pc is None or pb is None:
            missing = [n for n, v in ((cand, pc), (base, pb)) if v is None]
            out.append(dict(rule=name, cand=cand, base=base, limit=limit, delta=None, ok=False,
                            why="not measured: " + ", ".join(missing)))
            return
        d = _rel(pc, pb)
        out.append(dict(rule=name, cand=cand, base=base, limit=limit, delta=d, ok=abs(d) <= limit,
                        why=f"{100 * d:+.3f}% (limit {100 * limit:.1f}%)"))

    for kv in ("auto", "fp8_ds_mla"):
        rule(f"Triton vs upstream, {kv} cache", f"triton:{kv}", f"upstream:{kv}", PPL_TRITON_VS_UPSTREAM)
    rule("BF16 GGUF vs safetensors (Triton path)", "gguf BF16:triton", "triton:auto", PPL_GGUF_BF16)
    return out


def judge(results: dict) -> tuple[bool, str]:
    """(every rule holds, the rules' verdicts as a markdown table)."""
    rs = rules(results)
    ok = all(r["ok"] for r in rs)
    lines = ["| rule | engines | delta | verdict |", "|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {r['rule']} | {r['cand']} vs {r['base']} | {r['why']} | {'PASS' if r['ok'] else 'FAIL'} |")
    return ok, "\n".join(lines) + "\n"


def table(results: dict) -> str:
    """Perplexity per engine, relative to the float32 reference and to upstream with the same cache dtype, and
    the GGUF types' increase over the BF16 GGUF beside llama.cpp's published figure."""
    ref = ppl(results.get(REFERENCE))
    bf16 = ppl(results.get("gguf BF16:triton"))
    lines = ["| engine | perplexity | vs fp32 | vs upstream, same cache | vs BF16 GGUF | llama.cpp's published "
             "figure for the type |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        p = ppl(r)
        if p is None:
            lines.append(f"| {name} | not measured ({r.get('error', '?')}) | | | | |")
            continue
        kv = name.split(":")[1] if name.startswith(("triton:", "upstream:")) else "auto"
        up = ppl(results.get(f"upstream:{kv}"))
        tag = name[5:].split(":")[0] if name.startswith("gguf ") else None
        f = lambda a, b: f"{100 * _rel(a, b):+.3f}%" if a is not None and b is not None else "-"  # noqa: E731
        lines.append(f"| {name} | {p:.4f} | {f(p, ref) if name != REFERENCE else '-'} | "
                     f"{f(p, up) if name != REFERENCE and not name.startswith('upstream:') else '-'} | "
                     f"{f(p, bf16) if tag and tag != 'BF16' else '-'} | "
                     f"{LLAMA_CPP_PUBLISHED.get(tag, '-') if tag else '-'} |")
    return "\n".join(lines) + "\n"


def section(paths: list[str | Path]) -> tuple[bool, str]:
    """The proof report's quality section from reference_ppl.json files."""
    data = merge(paths)
    ok, verdicts = judge(data["results"])
    m = data["meta"]
    head = (f"### Quality criterion: held-out perplexity of the trained reference ({m.get('device', '?')}; "
            f"{m.get('windows')} windows of {m.get('seq')} tokens; {m['how']})\n\n")
    return ok, head + table(data["results"]) + "\n" + verdicts

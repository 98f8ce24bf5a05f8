"""bench/e2e/quality.py: the perplexity rules of issue 17 (Triton within 0.5% of upstream per cache dtype, the BF16
GGUF within 0.1% of safetensors), merging the reference_ppl.json of several device calls, and the proof's verdict
with --reference-ppl (a rejudge of the stored 0.23.0 runs, which pass on their own)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.e2e import quality

REPO = Path(__file__).resolve().parents[2]
COUNT = 65472


def res(p: float) -> dict:
    """A reference_ppl result row of perplexity `p` over COUNT predictions."""
    return {"nll": math.log(p) * COUNT, "count": COUNT, "greedy": [[1, 2, 3]]}


def passing() -> dict:
    return {"transformers fp32": res(22.0231), "upstream:auto": res(22.0296), "triton:auto": res(22.0296 * 1.004),
            "upstream:fp8_ds_mla": res(22.0105), "triton:fp8_ds_mla": res(22.0105 * 0.996),
            "gguf BF16:triton": res(22.0296 * 1.004 * 1.0009), "gguf Q4_K_M:triton": res(22.0934)}


def test_every_rule_holds_inside_its_limit_and_fails_just_outside():
    ok, text = quality.judge(passing())
    assert ok and text.count("| PASS |") == 3, text
    for name, factor in (("triton:auto", 1.006 / 1.004), ("triton:fp8_ds_mla", 0.994 / 0.996),
                         ("gguf BF16:triton", 1.0011 / 1.0009)):
        r = passing()
        moved = [name] + (["gguf BF16:triton"] if name == "triton:auto" else [])  # the GGUF moves with its base
        for n in moved:
            r[n] = res(math.exp(r[n]["nll"] / COUNT) * factor)
        ok, text = quality.judge(r)
        failed = [x for x in quality.rules(r) if not x["ok"]]
        assert not ok and [x["cand"] for x in failed] == [name], text


def test_an_engine_that_did_not_run_fails_its_rule_as_not_measured():
    r = passing()
    r["triton:auto"] = {"error": "exit 1", "log": "ValueError: No available memory for the cache blocks"}
    del r["gguf BF16:triton"]
    rules = {x["rule"]: x for x in quality.rules(r)}
    assert rules["Triton vs upstream, auto cache"]["why"] == "not measured: triton:auto"
    assert rules["BF16 GGUF vs safetensors (Triton path)"]["why"] == "not measured: gguf BF16:triton, triton:auto"
    assert rules["Triton vs upstream, fp8_ds_mla cache"]["ok"]
    assert not quality.judge(r)[0]
    table = quality.table(r)
    assert "| triton:auto | not measured (exit 1) |" in table
    # a quantized file: its increase over the BF16 GGUF (absent here) and llama.cpp's figure for the type
    assert "| gguf Q4_K_M:triton | 22.0934 | +0.319% | +0.290% | - | +0.1754 ppl @ Llama-3-8B |" in table


def _write(path: Path, results: dict, windows: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200", "windows": windows, "seq": 1024,
                                         "tokens": COUNT, "greedy": "1 x 3", "how": "x"}, "results": results}))
    return path


def test_merging_calls_keeps_a_measurement_over_a_later_failure(tmp_path):
    full = passing()
    a = _write(tmp_path / "a" / "reference_ppl.json", {k: full[k] for k in ("transformers fp32", "upstream:auto",
                                                                         "triton:auto")})
    b = _write(tmp_path / "b" / "reference_ppl.json",
               {"triton:auto": {"error": "exit 1", "log": "x"}, "upstream:fp8_ds_mla": full["upstream:fp8_ds_mla"],
                "triton:fp8_ds_mla": full["triton:fp8_ds_mla"], "gguf BF16:triton": full["gguf BF16:triton"]})
    merged = quality.merge([a, b])
    assert merged["results"]["triton:auto"] == full["triton:auto"] and len(merged["results"]) == 6
    assert quality.judge(merged["results"])[0]
    with pytest.raises(ValueError, match="other windows"):
        quality.merge([a, _write(tmp_path / "c" / "reference_ppl.json", {}, windows=32)])
    # the command line: reference_ppl.py --merge writes the report with the verdicts, no GPU, no vLLM
    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "reference_ppl.py"), "--merge", str(a), str(b),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (out / "reference_ppl.md").read_text()
    assert "merged from a/reference_ppl.json, b/reference_ppl.json" in md and md.count("| PASS |") == 3
    assert json.loads((out / "reference_ppl.json").read_text())["results"] == merged["results"]


@pytest.mark.parametrize("broken", [None, "triton:fp8_ds_mla"])
def test_the_proof_passes_only_when_the_perplexity_rules_hold_too(tmp_path, broken):
    r = passing()
    if broken:
        r[broken] = res(math.exp(r[broken]["nll"] / COUNT) * 1.01)
    ppl_json = _write(tmp_path / "ppl" / "reference_ppl.json", r)
    stored = [REPO / "bench" / "results" / f for f in ("h200-e2e_proof-run2.json.gz", "h200-e2e_proof-run3-odd-fp8.json.gz")]
    out = tmp_path / "proof.md"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "e2e_proof.py"), "--plan", "h200-0.23", "--rejudge",
                           ",".join(map(str, stored)), "--reference-ppl", str(ppl_json), "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    md = out.read_text()
    assert "Overall: PASS" in md and "### Quality criterion: held-out perplexity" in md   # the noise-floor rules
    assert proc.returncode == (1 if broken else 0), proc.stderr[-3000:]
    assert md.count("| FAIL |") == (1 if broken else 0)

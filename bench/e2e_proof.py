"""End-to-end proof on the H200: TRITON_MLA_SPARSE + the Triton indexer inside vLLM 0.23.0 agree
with upstream (FLASHMLA_SPARSE + DeepGEMM) and run with every vendor DSA kernel made to raise.

One command, one device call (vLLM 0.23.0 staged at /root/site, see ../shared/device/README.md):

    . /root/vllm-env.sh && python3 bench/e2e_proof.py --site /root/site --out $OUT/e2e_proof.md

What it does (each vLLM engine in its own subprocess, whole run < 8 minutes):
1. Patched vLLM: with `--apply` (and apply.py present) runs `apply.py --vllm-site-packages SITE`
   then `verify.py`; if SITE already carries the overlay it is used as is; otherwise a private
   patched copy is staged in a temp dir (tests/backend/vllm_stage.py; SITE is never written).
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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 8192
GREEDY_STEPS = 48
MIN_IDENTICAL_STEPS = 32
PROMPT_LENS = (300, 347, 433, 561)
TPS_BATCH = 16
TIME_BUDGET_S = 450  # stop starting new engines after this (the whole run must stay < 8 min)

MODELS = {
    "glm5": dict(num_attention_heads=16, index_n_heads=32, index_topk=256),
    "odd": dict(num_attention_heads=12, index_n_heads=8, index_topk=200),
}

# (name, model, path, kv cache dtype, cuda graphs, measure tokens/s); in priority order
RUNS = [
    ("glm5/upstream/bf16/graphs", "glm5", "upstream", "auto", True, True),
    ("glm5/triton/bf16/graphs", "glm5", "triton", "auto", True, True),
    ("odd/triton/bf16/graphs", "odd", "triton", "auto", True, False),
    ("glm5/upstream/fp8_ds_mla/graphs", "glm5", "upstream", "fp8_ds_mla", True, True),
    ("glm5/triton/fp8_ds_mla/graphs", "glm5", "triton", "fp8_ds_mla", True, True),
    ("glm5/triton/bf16/eager", "glm5", "triton", "auto", False, False),
    ("odd/triton/fp8_ds_mla/graphs", "odd", "triton", "fp8_ds_mla", True, False),
    ("odd/triton/bf16/eager", "odd", "triton", "auto", False, False),
]

# (candidate run, reference run, what the comparison shows)
COMPARISONS = [
    ("glm5/triton/bf16/graphs", "glm5/upstream/bf16/graphs", "Triton vs upstream, bf16 cache"),
    ("glm5/triton/fp8_ds_mla/graphs", "glm5/upstream/fp8_ds_mla/graphs",
     "Triton vs upstream, fp8_ds_mla cache"),
    ("glm5/triton/bf16/eager", "glm5/upstream/bf16/graphs", "Triton eager vs upstream graphs"),
    ("odd/triton/bf16/graphs", "odd/triton/bf16/eager", "topk 200 / 8 index heads: graphs vs eager"),
    ("odd/triton/fp8_ds_mla/graphs", "odd/triton/bf16/graphs",
     "topk 200 / 8 index heads: fp8_ds_mla vs bf16 (quantization, informative)"),
]
MUST_MATCH = {COMPARISONS[0][0], COMPARISONS[1][0], COMPARISONS[2][0], COMPARISONS[3][0]}

VENDOR_ENTRY_POINTS = {
    "vllm.utils.deep_gemm": ["fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                             "get_paged_mqa_logits_metadata", "fp8_mqa_logits",
                             "fp8_paged_mqa_logits"],
    "vllm.model_executor.layers.sparse_attn_indexer": ["fp8_fp4_mqa_logits",
                                                       "fp8_fp4_paged_mqa_logits",
                                                       "fp8_mqa_logits", "fp8_paged_mqa_logits"],
    "vllm.v1.attention.backends.mla.indexer": ["get_paged_mqa_logits_metadata"],
    "vllm.v1.attention.ops.flashmla": ["flash_mla_sparse_fwd", "flash_mla_with_kvcache",
                                       "get_mla_metadata"],
    "vllm.v1.attention.backends.mla.flashmla_sparse": ["flash_mla_sparse_fwd",
                                                       "flash_mla_with_kvcache",
                                                       "get_mla_metadata"],
}
TRITON_ENTRY_POINTS = {
    "vllm._dsa_overlay.kernels.sparse_mla": ["sparse_mla_attention"],
    "vllm._dsa_overlay.kernels.indexer": ["fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
                                          "fp8_mqa_logits", "fp8_paged_mqa_logits"],
}


# ----------------------------------------------------------------------------- worker side


def _instrument(modules: dict, counts: dict, raise_on_call: bool):
    import importlib

    for mod_name, names in modules.items():
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:  # noqa: BLE001
            counts[f"{mod_name} (import failed: {type(e).__name__})"] = 0
            continue
        for name in names:
            fn = getattr(mod, name, None)
            if fn is None:
                continue
            key = f"{mod_name.rsplit('.', 1)[-1]}.{name}"
            counts.setdefault(key, 0)

            def wrapper(*args, __fn=fn, __key=key, **kwargs):
                counts[__key] += 1
                if raise_on_call:
                    raise RuntimeError(f"vendor kernel {__key} called on the portable path")
                return __fn(*args, **kwargs)

            setattr(mod, name, wrapper)


def worker(spec: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: patches apply
    os.environ["DSA_OVERLAY_PORTABLE"] = "1" if spec["path"] == "triton" else "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vendor_calls: dict = {}
    triton_calls: dict = {}
    _instrument(VENDOR_ENTRY_POINTS, vendor_calls, raise_on_call=spec["path"] == "triton")
    _instrument(TRITON_ENTRY_POINTS, triton_calls, raise_on_call=False)

    kwargs = dict(
        model=spec["model_dir"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        max_model_len=1024, max_num_seqs=TPS_BATCH, max_num_batched_tokens=256,
        gpu_memory_utilization=0.5, kv_cache_dtype=spec["kv"], enable_prefix_caching=False,
    )
    if spec["path"] == "upstream" and spec["explicit_upstream"]:
        kwargs["attention_backend"] = "FLASHMLA_SPARSE"
    if spec["graphs"]:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    else:
        kwargs["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result = {"startup_s": round(time.perf_counter() - t0, 1)}

    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True,
                            logprobs=0, detokenize=False)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    result["step_logprobs"] = [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outs
    ]

    tf = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, detokenize=False)
    tf_outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in spec["tf_sequences"]], tf,
                           use_tqdm=False)
    result["tf_logprobs"], result["tf_top5"] = [], []
    for o, seq in zip(tf_outs, spec["tf_sequences"]):
        pl = o.prompt_logprobs[1:]
        result["tf_logprobs"].append([d[t].logprob for d, t in zip(pl, seq[1:])])
        result["tf_top5"].append([sorted(d, key=lambda k: -d[k].logprob)[:5] for d in pl])

    if spec["tps"]:
        batch = [TokensPrompt(prompt_token_ids=p) for p in spec["tps_prompts"]]

        def timed(n):
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            t = time.perf_counter()
            llm.generate(batch, sp, use_tqdm=False)
            return time.perf_counter() - t

        timed(8)  # warm-up
        short, long_ = min(timed(8) for _ in range(2)), min(timed(72) for _ in range(2))
        result["decode_tok_s"] = round(TPS_BATCH * 64 / max(long_ - short, 1e-9), 1)
    result["vendor_calls"] = vendor_calls
    result["triton_calls"] = triton_calls
    return result


# ------------------------------------------------------------------------------- main side


def make_model(out_dir: Path, overrides: dict) -> None:
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=2, first_k_dense_replace=1, num_key_value_heads=overrides[
            "num_attention_heads"], n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=512, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_head_dim=128,
        max_position_embeddings=4096, initializer_range=0.1, bos_token_id=0, eos_token_id=1,
        **overrides,
    )
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    # vLLM builds gate.e_score_correction_bias only for topk_method == "noaux_tc" (FACTS.md)
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data.update(topk_method="noaux_tc", scoring_func="sigmoid", torch_dtype="bfloat16")
    path.write_text(json.dumps(data, indent=2))


def prepare_vllm(args, log) -> tuple[str, str, str]:
    """-> (PYTHONPATH for patched runs, PYTHONPATH for upstream runs, how)."""
    site = Path(args.site)
    base = os.environ.get("PYTHONPATH", "")
    join = lambda *p: os.pathsep.join(x for x in p if x)  # noqa: E731
    if args.apply and (REPO / "apply.py").exists():
        for cmd in (["apply.py", "--vllm-site-packages", str(site)],
                    ["verify.py", "--vllm-site-packages", str(site)]):
            proc = subprocess.run([sys.executable, str(REPO / cmd[0]), *cmd[1:]], cwd=REPO,
                                  capture_output=True, text=True)
            log.append(f"$ python {' '.join(cmd)}  (exit {proc.returncode})\n"
                       f"{(proc.stdout + proc.stderr)[-6000:]}")
            if proc.returncode:
                raise SystemExit(f"{cmd[0]} failed; see the log in the report")
    if (site / "vllm" / "_dsa_overlay").is_dir():
        return base, base, f"overlay applied in {site} (upstream runs: switch off, FLASHMLA_SPARSE)"
    sys.path.insert(0, str(REPO))
    from tests.backend import vllm_stage

    version = next(site.glob("vllm-*.dist-info")).name.split("-")[1].removesuffix(".dist-info")
    dest = Path(tempfile.mkdtemp(prefix="dsa_stage_"))
    vllm_stage.stage(site, version, dest)
    return join(str(dest), base), base, f"private patched copy {dest} over pristine {site}"


def run_worker(spec: dict, pythonpath: str, timeout: int) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                else (e.stdout or ""))[-1500:]
        return {"error": f"timeout after {timeout}s", "log": tail}
    wall = round(time.perf_counter() - t0, 1)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["wall_s"] = wall
            return res
    return {"error": f"exit {proc.returncode}", "log": (proc.stdout + proc.stderr)[-3000:],
            "wall_s": wall}


def compare(a: dict, b: dict) -> dict:
    common = []
    for ta, tb in zip(a["tokens"], b["tokens"]):
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        common.append(n)
    deltas = [abs(x - y) for sa, sb in zip(a["tf_logprobs"], b["tf_logprobs"])
              for x, y in zip(sa, sb)]
    overlap = [len(set(x) & set(y)) / max(len(x), 1) for sa, sb in zip(a["tf_top5"], b["tf_top5"])
               for x, y in zip(sa, sb)]
    step = [abs(x - y) for sa, sb, n in zip(a["step_logprobs"], b["step_logprobs"], common)
            for x, y in zip(sa[:n], sb[:n])]
    return {
        "min_identical_steps": min(common),
        "tf_max": max(deltas), "tf_mean": sum(deltas) / len(deltas),
        "top5_overlap": sum(overlap) / len(overlap),
        "step_max": max(step) if step else float("nan"),
        "step_mean": sum(step) / len(step) if step else float("nan"),
        "positions": len(deltas),
    }


def report(args, how, log, results, models, elapsed) -> tuple[str, bool]:
    ok = True
    lines = [f"# E2E proof: TRITON_MLA_SPARSE + Triton indexer in vLLM ({time.strftime('%Y-%m-%d')})",
             "", f"Device: {args.device_name}. vLLM: {how}. Total wall time {elapsed:.0f} s.", "",
             "| run | status | startup s | triton kernel calls | vendor DSA calls | decode tok/s |",
             "|---|---|---|---|---|---|"]
    for name, model, path, *_ in RUNS:
        r = results.get(name, {"error": "not run"})
        if "error" in r:
            lines.append(f"| {name} | FAILED: {r['error']} | | | | |")
            ok = False
            continue
        tc = sum(r["triton_calls"].values())
        vc = sum(r["vendor_calls"].values())
        good = (tc > 0 and vc == 0) if path == "triton" else (vc > 0 and tc == 0)
        ok &= good
        lines.append(f"| {name} | {'ok' if good else 'WRONG KERNELS'} | {r['startup_s']} | {tc} | "
                     f"{vc} | {r.get('decode_tok_s', '')} |")
    lines += ["", f"Greedy: {GREEDY_STEPS} steps x {len(PROMPT_LENS)} prompts "
              f"({', '.join(map(str, PROMPT_LENS))} tokens). Teacher-forced: prompt_logprobs at "
              "every position of prompt + fixed continuation.", "",
              "| comparison | identical greedy steps (min) | TF logprob max / mean abs diff | "
              "top-5 overlap | step logprob max / mean | verdict |", "|---|---|---|---|---|---|"]
    for cand, ref, what in COMPARISONS:
        a, b = results.get(cand, {}), results.get(ref, {})
        if "tokens" not in a or "tokens" not in b:
            lines.append(f"| {what} | n/a | | | | not run |")
            ok &= cand not in MUST_MATCH
            continue
        c = compare(a, b)
        verdict = "informative"
        if cand in MUST_MATCH:
            good = c["min_identical_steps"] >= MIN_IDENTICAL_STEPS
            verdict = "PASS" if good else f"FAIL (< {MIN_IDENTICAL_STEPS} identical steps)"
            ok &= good
        lines.append(f"| {what} | {c['min_identical_steps']}/{GREEDY_STEPS} | "
                     f"{c['tf_max']:.4f} / {c['tf_mean']:.5f} | {c['top5_overlap']:.3f} | "
                     f"{c['step_max']:.4f} / {c['step_mean']:.5f} | {verdict} |")
    tps = {n: results.get(n, {}).get("decode_tok_s") for n, *_ in RUNS}
    for kv in ("bf16", "fp8_ds_mla"):
        up, tr = tps.get(f"glm5/upstream/{kv}/graphs"), tps.get(f"glm5/triton/{kv}/graphs")
        if up and tr:
            lines.append(f"\nDecode throughput {kv}, batch {TPS_BATCH}: Triton {tr} tok/s vs "
                         f"upstream {up} tok/s ({tr / up:.2f}x; goal >= 0.90x).")
    lines += ["", f"Overall: {'PASS' if ok else 'FAIL'}"]
    if log:
        lines += ["", "<details><summary>apply / verify output</summary>", "", "```",
                  *log, "```", "</details>"]
    for name, r in results.items():
        if "error" in r:
            lines += ["", f"<details><summary>{name} log</summary>", "", "```",
                      r.get("log", ""), "```", "</details>"]
    return "\n".join(lines) + "\n", ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", default="/root/site", help="site-packages holding vLLM 0.23.0")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "e2e_proof.md"))
    ap.add_argument("--apply", action="store_true", help="run apply.py + verify.py on --site first")
    ap.add_argument("--workdir", default=None, help="where to save the tiny checkpoints")
    ap.add_argument("--only", default=None, help="comma-separated run names (debugging)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    t_start = time.perf_counter()
    import torch

    args.device_name = (f"{torch.cuda.get_device_name()} (cc "
                        f"{'.'.join(map(str, torch.cuda.get_device_capability()))})"
                        if torch.cuda.is_available() else "no GPU")
    log: list[str] = []
    patched_pp, upstream_pp, how = prepare_vllm(args, log)
    explicit_upstream = patched_pp == upstream_pp  # same tree: ask for FLASHMLA_SPARSE by name
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dsa_proof_"))
    model_dirs = {}
    for name, overrides in MODELS.items():
        model_dirs[name] = work / name
        if not (model_dirs[name] / "config.json").exists():
            make_model(model_dirs[name], overrides)

    g = torch.Generator().manual_seed(1234)
    rand = lambda n: torch.randint(2, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(n) for n in PROMPT_LENS]
    tf_sequences = [p + rand(GREEDY_STEPS) for p in prompts]
    tps_prompts = [rand(300 + 7 * i) for i in range(TPS_BATCH)]

    only = set(args.only.split(",")) if args.only else None
    results = {}
    for name, model, path, kv, graphs, tps in RUNS:
        if only and name not in only:
            continue
        left = TIME_BUDGET_S - (time.perf_counter() - t_start)
        if left < 40:
            results[name] = {"error": "skipped: time budget spent"}
            continue
        spec = dict(model_dir=str(model_dirs[model]), path=path, kv=kv, graphs=graphs, tps=tps,
                    prompts=prompts, tf_sequences=tf_sequences, tps_prompts=tps_prompts,
                    explicit_upstream=explicit_upstream)
        pp = patched_pp if path == "triton" else upstream_pp
        results[name] = run_worker(spec, pp, timeout=int(min(left, 180)))
        print(f"{name}: {results[name].get('error', 'ok')} ({results[name].get('wall_s')} s)",
              flush=True)

    text, ok = report(args, how, log, results, model_dirs, time.perf_counter() - t_start)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk not in ("tf_top5",)} for k, v in results.items()}))
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

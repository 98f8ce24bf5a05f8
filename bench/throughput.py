#!/usr/bin/env python3
"""End-to-end prefill and decode tokens/s on a GLM-5-shaped model: the vendor path against the Triton path.

The model is GLM-5's layer shapes (hidden 6144, 64 heads, q_lora 2048, kv_lora 512, qk_nope 192, rope 64,
v_head 256, 32 index heads of 128, index top-k 2048, vocabulary 154880) cut to --layers layers (default 8:
3 dense, 5 MoE) and --experts routed experts (default 16 of 2048 wide, top-8 per token as in GLM-5: the
same work per token, fewer weights), with vLLM's dummy weights (``load_format="dummy"``: only config.json is
written). Each run is one engine in its own process, one at a time (../shared/FACTS.md), prefix caching off,
CUDA graphs on (capture sizes up to the batch), prefill chunks of --chunk tokens:

- prefill: --prompts random prompts of --prompt-len tokens, max_tokens=1; prefill tokens/s = prompt tokens
  / wall time (best of --repeats; the first token's sampling is in it, as in any TTFT);
- decode: the same prompts generating 1 and then 1 + --decode-steps tokens; decode tokens/s = prompts x
  decode steps / (difference of the two wall times) (best of --repeats each): the prefill, identical in
  both, cancels.

Runs (``--runs``, comma separated ``path:cache``): path ``upstream`` = FLASHMLA_SPARSE + DeepGEMM (asked
for by name), ``triton`` = DSA_OVERLAY_PORTABLE=1 (TRITON_MLA_SPARSE + the Triton indexer; a vendor DSA
entry point raises), ``triton_pdl`` = the same with DSA_OVERLAY_PDL=1 (programmatic dependent launch); cache
``bf16`` or ``fp8_ds_mla``. The vLLM on PYTHONPATH is used as it is (apply the
overlay first). Results go to throughput.json in the --out folder after every run (a later call with the
same --out adds to them), the table to throughput.md beside it:

    python3 bench/throughput.py --out $OUT [--runs upstream:bf16,triton:bf16,upstream:fp8_ds_mla,triton:fp8_ds_mla]

``--rounds N``: the whole run list N times, forwards in odd rounds and backwards in even ones (a drift of the
machine over the session falls on every path alike); the table then shows each run's median over the rounds, and a
second table pairs each path with the vendor path of the same round (ratio per round, their median) beside the
vendor path's own spread over the rounds: the noise floor a ratio has to clear. A later call into the same --out
replaces the rounds of the runs it makes.

``--profile``: after the timed calls, one prefill call and one prefill + decode call again under torch.profiler
(CPU and CUDA activity: kernels launched from CUDA graphs included); the difference of the two is, per decode step,
each kernel's GPU time, each host op's and CUDA runtime call's self CPU time (cudaLaunchKernel: a kernel launched
outside a CUDA graph) and the wall time, listed per run under the table (where the decode gap is: GPU or host).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e.plan import ATTENTION_BACKEND, VENDOR_ENTRY_POINTS  # noqa: E402

PATHS = ("upstream", "triton", "triton_pdl")
CACHES = {"bf16": "auto", "fp8_ds_mla": "fp8_ds_mla"}
DEFAULT_RUNS = "upstream:bf16,triton:bf16,upstream:fp8_ds_mla,triton:fp8_ds_mla"

# GLM-5's attention, indexer and expert shapes (transformers' GlmMoeDsaConfig defaults, zai-org/GLM-5).
GLM5_SHAPE = dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
    num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
    qk_rope_head_dim=64, qk_head_dim=256, v_head_dim=256, head_dim=64, index_topk=2048, index_head_dim=128,
    index_n_heads=32, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, first_k_dense_replace=3, hidden_act="silu", rms_norm_eps=1e-5,
    max_position_embeddings=202752, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False, initializer_range=0.02,
    bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=True, mlp_bias=False,
)


def model_config(layers: int = 8, experts: int = 16) -> dict:
    """config.json of the GLM-5-shaped model: GLM-5's shapes, `layers` layers (the first 3 dense, as in
    GLM-5), `experts` routed experts (top-8 of them per token)."""
    if layers < 1 or experts < GLM5_SHAPE["num_experts_per_tok"]:
        raise ValueError(f"need >= 1 layer and >= {GLM5_SHAPE['num_experts_per_tok']} experts "
                         f"(got {layers}, {experts})")
    dense = min(GLM5_SHAPE["first_k_dense_replace"], layers)
    return dict(
        GLM5_SHAPE, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", torch_dtype="bfloat16",
        num_hidden_layers=layers, n_routed_experts=experts, first_k_dense_replace=dense,
        mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
        indexer_types=["full"] * layers, layer_types=["deepseek_sparse_attention"] * layers,
        # vLLM builds gate.e_score_correction_bias only for topk_method == "noaux_tc" (as bench/e2e/run.py)
        topk_method="noaux_tc", scoring_func="sigmoid",
    )


def write_model(path: Path, layers: int, experts: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config(layers, experts), indent=2))
    return path


def prompts(n: int, length: int, vocab: int, seed: int = 1234) -> list[list[int]]:
    """n seeded random prompts of `length` token ids (ids 0 and 1 are bos / eos: left out)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def parse_runs(text: str) -> list[tuple[str, str]]:
    runs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        path, _, cache = item.partition(":")
        if path not in PATHS or cache not in CACHES:
            raise SystemExit(f"bad run {item!r}: expected path:cache with path in {PATHS} and cache in "
                             f"{tuple(CACHES)}")
        runs.append((path, cache))
    return runs


def measure(generate, batch, decode_steps: int, repeats: int) -> dict:
    """Time `generate(batch, max_tokens)` (one call = one llm.generate over the whole batch): prefill
    (max_tokens 1) and decode (1 + decode_steps minus 1), best of `repeats` each, after one warm-up call of
    1 + decode_steps tokens.
    -> prefill/decode tokens/s and the wall times they come from."""
    def timed(max_tokens):
        t = time.perf_counter()
        generate(batch, max_tokens)
        return time.perf_counter() - t

    # warm-up: one whole prefill + decode call (on the H200 the first such call of an engine took 1.0-2.2 s longer
    # than the later ones after a max_tokens=2 warm-up: bench/RESULTS.md, stop 28)
    timed(1 + decode_steps)
    short = [timed(1) for _ in range(repeats)]
    long_ = [timed(1 + decode_steps) for _ in range(repeats)]
    prompt_tokens = sum(len(p) for p in batch)
    dt = min(long_) - min(short)
    return dict(prefill_tok_s=round(prompt_tokens / min(short), 1),
                decode_tok_s=round(len(batch) * decode_steps / dt, 1) if dt > 0 else None,
                prefill_s=[round(x, 4) for x in short], generate_s=[round(x, 4) for x in long_],
                prompt_tokens=prompt_tokens, decode_tokens=len(batch) * decode_steps)


def kernel_times(fn) -> dict:
    """What `fn()` ran (torch.profiler, CPU and CUDA activity): {"gpu": {kernel name: [GPU us, launches]}
    (kernels launched from CUDA graphs included), "host": {host op or CUDA runtime call: [self CPU us, calls]},
    "wall_s": wall time of the call under the profiler}."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    gpu: dict = {}
    host: dict = {}
    for evt in prof.key_averages():
        # A host op's own device time is its kernels' time again: kernels are counted from their GPU events only.
        if evt.device_type == DeviceType.CUDA:
            us, into = getattr(evt, "self_device_time_total", None), gpu
            if us is None:  # torch < 2.4
                us = evt.self_cuda_time_total
        else:
            us, into = evt.self_cpu_time_total, host
        if us > 0:
            t = into.setdefault(evt.key, [0.0, 0])
            t[0] += us
            t[1] += evt.count
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id())
             for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    busy_us, streams = gpu_busy(spans)
    return {"gpu": gpu, "host": host, "wall_s": wall, "busy_us": busy_us, "streams": streams}


def gpu_busy(spans) -> tuple[float, dict]:
    """(us during which at least one GPU activity ran, {stream: us of activity on it}) of (start ns, end ns,
    stream) spans: where the busy time is less than the streams' sum, work ran on several streams at once."""
    busy, end = 0, None
    streams: dict = {}
    for start, stop, stream in sorted(spans):
        streams[str(stream)] = streams.get(str(stream), 0.0) + (stop - start) / 1e3
        if end is None or start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e3, streams


def per_step(short: dict, long_: dict, steps: int, top: int = 20) -> dict:
    """Per decode step, from the {name: [us, count]} of a prefill call (`short`) and of a prefill + `steps` decode
    steps call (`long_`): {"total_us": us per step, "rows": [[name, us per step, count per step], ...]} for the
    `top` names by time (positive differences only: the prefill, identical in both calls, cancels)."""
    rows = []
    for name, (us, n) in long_.items():
        s_us, s_n = short.get(name, (0.0, 0))
        d = (us - s_us) / steps
        if d > 0:
            rows.append([name, round(d, 2), round((n - s_n) / steps, 2)])
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return {"total_us": round(total, 1), "rows": rows[:top]}


def decode_profile(short: dict, long_: dict, steps: int) -> dict:
    """The decode step from two kernel_times: GPU kernels, host ops (self CPU time; CUDA runtime calls such as
    cudaGraphLaunch / cudaLaunchKernel among them: kernels launched outside a CUDA graph) and the wall time per
    step under the profiler, whose excess over the GPU time is when the GPU waited for the host."""
    gpu = per_step(short["gpu"], long_["gpu"], steps)
    host = per_step(short["host"], long_["host"], steps, top=15)
    wall_us = round((long_["wall_s"] - short["wall_s"]) * 1e6 / steps, 1)
    busy_us = round((long_.get("busy_us", 0.0) - short.get("busy_us", 0.0)) / steps, 1)
    streams = per_step(*({k: [us, 0] for k, us in c.get("streams", {}).items()} for c in (short, long_)), steps)
    streams = {k: us for k, us, _ in streams["rows"]}
    return {"gpu": gpu, "host": host, "wall_us": wall_us, "busy_us": busy_us, "streams_us": streams}


def worker(spec: dict) -> dict:
    """One engine (this process): the spec's run, measured. vLLM is imported here only."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    portable = spec["path"] in ("triton", "triton_pdl")
    os.environ["DSA_OVERLAY_PORTABLE"] = "1" if portable else "0"
    os.environ["DSA_OVERLAY_PDL"] = "1" if spec["path"] == "triton_pdl" else "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vendor_calls: dict = {}
    if portable:   # proof that no vendor DSA kernel serves this run: any call raises
        from bench.e2e.worker import _instrument

        _instrument(VENDOR_ENTRY_POINTS, vendor_calls, raise_on_call=True)
    n = spec["prompts"]
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s < n] + [n]
    kwargs = dict(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  seed=0, max_model_len=spec["prompt_len"] + spec["decode_steps"] + 8, max_num_seqs=n,
                  max_num_batched_tokens=spec["chunk"], gpu_memory_utilization=spec.get("mem", 0.6),
                  kv_cache_dtype=CACHES[spec["cache"]], enable_prefix_caching=False,
                  compilation_config={"cudagraph_capture_sizes": sizes})
    if spec["path"] in ATTENTION_BACKEND:
        kwargs["attention_backend"] = ATTENTION_BACKEND[spec["path"]]
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = round(time.perf_counter() - t0, 1)
    batch = prompts(n, spec["prompt_len"], GLM5_SHAPE["vocab_size"])

    def generate(b, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in b], sp, use_tqdm=False)
        got = {len(o.outputs[0].token_ids) for o in outs}
        if got != {max_tokens}:
            raise RuntimeError(f"asked for {max_tokens} tokens per prompt, got {sorted(got)}")

    res = measure(generate, batch, spec["decode_steps"], spec["repeats"])
    import torch

    if spec.get("profile"):
        short = kernel_times(lambda: generate(batch, 1))
        long_ = kernel_times(lambda: generate(batch, 1 + spec["decode_steps"]))
        res["decode_profile"] = decode_profile(short, long_, spec["decode_steps"])
    res.update(startup_s=startup, vendor_calls=vendor_calls, device=torch.cuda.get_device_name())
    return res


def run_name(path: str, cache: str) -> str:
    return f"{path}/{cache}"


def round_order(runs: list[tuple[str, str]], rounds: int):
    """(round, path, cache) in the order the engines run: the run list forwards in rounds 0, 2, ..., backwards in
    rounds 1, 3, ... (no engine runs twice in a row at a round's edge)."""
    for r in range(rounds):
        for path, cache in (runs if r % 2 == 0 else runs[::-1]):
            yield r, path, cache


def over_rounds(rounds: dict) -> dict:
    """Per run name, its rounds' median prefill and decode tok/s (failed rounds left out; a run whose every round
    failed keeps the last failure)."""
    out = {}
    for name, results in rounds.items():
        if not results:
            continue
        ok = [r for r in results if "error" not in r]
        if not ok:
            out[name] = results[-1]
            continue
        out[name] = {**ok[-1], **{k: statistics.median([r[k] for r in ok]) for k in ("prefill_tok_s", "decode_tok_s")}}
    return out


def paired_rows(rounds: dict) -> list[str]:
    """Markdown rows pairing each non-vendor run with the vendor run of the same cache and round: decode tok/s per
    round, the ratio per round and its median, and the vendor path's spread over those rounds ((max - min) / median)."""
    rows = []
    for path in PATHS[1:]:
        for cache in CACHES:
            up, tr = rounds.get(run_name("upstream", cache)), rounds.get(run_name(path, cache))
            if not up or not tr:
                continue
            pairs = [(a["decode_tok_s"], b["decode_tok_s"]) for a, b in zip(up, tr)
                     if "error" not in a and "error" not in b and a.get("decode_tok_s") and b.get("decode_tok_s")]
            if not pairs:
                continue
            ups = [a for a, _ in pairs]
            ratios = [b / a for a, b in pairs]
            spread = (max(ups) - min(ups)) / statistics.median(ups)
            rows.append(f"| {path} / upstream, {cache} | {' / '.join(f'{a:.0f}' for a in ups)} | "
                        f"{' / '.join(f'{b:.0f}' for _, b in pairs)} | {' / '.join(f'{x:.3f}' for x in ratios)} | "
                        f"{statistics.median(ratios):.3f}x | {100 * spread:.1f}% |")
    return rows


def report(results: dict, meta: dict, rounds: dict | None = None) -> str:
    """Markdown: one row per cache format, upstream and Triton side by side, ratio Triton / upstream. With `rounds`
    (run name -> its result per round) of more than one round: medians over the rounds, and the paired table."""
    many = bool(rounds) and max(len(v) for v in rounds.values()) > 1
    table = {**results, **over_rounds(rounds)} if many else results
    lines = [
        "# End-to-end throughput: GLM-5-shaped model, vendor path vs Triton path", "",
        f"{meta.get('how', '')}", "",
        f"Model: GLM-5 shapes, {meta['layers']} layers, {meta['experts']} routed experts (top-8), dummy weights; "
        f"{meta['prompts']} prompts x {meta['prompt_len']} tokens, prefill chunk {meta['chunk']}, decode "
        f"{meta['decode_steps']} steps at batch {meta['prompts']}, CUDA graphs on, prefix caching off, best of "
        f"{meta['repeats']}" + (", median over the rounds" if many else "") + ". upstream = FLASHMLA_SPARSE + "
        "DeepGEMM; triton = DSA_OVERLAY_PORTABLE=1; triton_pdl = the same with DSA_OVERLAY_PDL=1 (programmatic "
        "dependent launch).", "",
        "| cache | prefill tok/s upstream | prefill tok/s triton | ratio | decode tok/s upstream | "
        "decode tok/s triton | ratio |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(res, key):
        if res is None:
            return "-"
        if "error" in res:
            return "failed"
        return f"{res[key]:.0f}" if res.get(key) is not None else "-"

    def ratio(a, b, key):
        if not a or not b or "error" in a or "error" in b or not a.get(key) or not b.get(key):
            return "-"
        return f"{b[key] / a[key]:.2f}x"

    for cache, path in ((c, p) for p in PATHS[1:] for c in CACHES):
        up, tr = table.get(run_name("upstream", cache)), table.get(run_name(path, cache))
        if tr is None and (up is None or path != "triton"):
            continue
        label = cache if path == "triton" else f"{cache} ({path})"
        lines.append(f"| {label} | {cell(up, 'prefill_tok_s')} | {cell(tr, 'prefill_tok_s')} | "
                     f"{ratio(up, tr, 'prefill_tok_s')} | {cell(up, 'decode_tok_s')} | {cell(tr, 'decode_tok_s')} | "
                     f"{ratio(up, tr, 'decode_tok_s')} |")
    if many:
        lines += ["", "Decode paired by round (the engine order alternates between rounds; ratio = that path / "
                      "upstream of the same round; spread = the vendor path's (max - min) / median over its rounds):",
                  "", "| runs | upstream tok/s per round | that path tok/s per round | ratio per round | "
                      "median ratio | upstream spread |", "|---|---|---|---|---|---|"]
        lines += paired_rows(rounds)
    lines += ["", "Per run (wall times in s: prefill calls, prefill + decode calls; with rounds, the last round):",
              ""]
    for name, res in results.items():
        if "error" in res:
            lines.append(f"- {name}: {res['error']}: {res.get('log', '')[-400:]!r}")
        else:
            vendor = (f"vendor DSA entry points called: {sum(res['vendor_calls'].values())} (any call raises)"
                      if res.get("vendor_calls") else "vendor calls not counted (the vendor path)")
            lines.append(f"- {name}: startup {res.get('startup_s')} s, prefill {res['prefill_s']}, generate "
                         f"{res['generate_s']}, {vendor}, engine process {res.get('wall_s')} s")
    for name, res in results.items():
        prof = res.get("decode_profile")
        if not prof:
            continue
        gpu, host = prof["gpu"], prof["host"]
        lines += ["", f"Decode step, {name} (torch.profiler, CPU and CUDA activity, the prefill call subtracted): "
                      f"wall {prof['wall_us']:.1f} us under the profiler, GPU kernels {gpu['total_us']:.1f} us, "
                      f"host ops {host['total_us']:.1f} us (self CPU time); the GPU busy (any stream) "
                      f"{prof.get('busy_us', 0.0):.1f} us, by stream: "
                      + (", ".join(f"{k} {v:.1f} us" for k, v in prof.get("streams_us", {}).items()) or "-"), "",
                  "| kernel | GPU us / step | launches / step |", "|---|---|---|"]
        lines += [f"| `{k[:100]}` | {us:.1f} | {n:g} |" for k, us, n in gpu["rows"]]
        lines += ["", "| host op or CUDA runtime call | self CPU us / step | calls / step |", "|---|---|---|"]
        lines += [f"| `{k[:100]}` | {us:.1f} | {n:g} |" for k, us, n in host["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="path:cache, comma separated (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole list this many times, the order alternating (paired ratios per round)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per engine process")
    ap.add_argument("--out", default=os.environ.get("OUT", "throughput_out"))
    ap.add_argument("--profile", action="store_true",
                    help="GPU kernels, host ops and wall time per decode step (torch.profiler)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        from bench.e2e.worker import serve

        serve(worker, args.worker)   # never returns
    from bench.e2e.run import failure_line, finish_worker, start_worker

    runs = parse_runs(args.runs)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1 (got {args.rounds})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "throughput.json"
    data = json.loads(store.read_text()) if store.exists() else {"results": {}}
    meta = dict(layers=args.layers, experts=args.experts, prompts=args.prompts, prompt_len=args.prompt_len,
                decode_steps=args.decode_steps, chunk=args.chunk, repeats=args.repeats)
    old = {k: v for k, v in data.get("meta", meta).items() if k != "how"}
    if data["results"] and old != meta:
        raise SystemExit(f"{store} holds runs of another setup ({old}); use another --out")
    model_dir = write_model(Path(tempfile.mkdtemp(prefix="dsa_tput_")), args.layers, args.experts)
    try:
        import vllm  # noqa: F401 - version only, in this (parent) process
        how = f"vLLM {vllm.__version__}"
    except Exception as e:  # noqa: BLE001
        how = f"vLLM not importable here ({type(e).__name__})"
    data["meta"] = {**meta, "how": how}
    rounds = data.setdefault("rounds", {})
    for name in {run_name(p, c) for p, c in runs}:
        rounds[name] = []            # this call's rounds replace an earlier call's for the runs it makes
    for r, path, cache in round_order(runs, args.rounds):
        spec = dict(path=path, cache=cache, model_dir=str(model_dir), **{k: meta[k] for k in (
            "prompts", "prompt_len", "decode_steps", "chunk", "repeats")}, profile=args.profile and r == 0)
        t0 = time.perf_counter()
        proc = start_worker(spec, os.environ.get("PYTHONPATH", ""), cli=Path(__file__).resolve())
        res = finish_worker(proc, t0, args.timeout)
        name = run_name(path, cache)
        rounds[name].append(res)
        if r > 0 and "decode_profile" in data["results"].get(name, {}):
            res = {**res, "decode_profile": data["results"][name]["decode_profile"]}   # round 0's profile stays
        data["results"][name] = res
        print(f"{name}" + (f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else "") + ": "
              + (failure_line(res) if "error" in res else
                 f"prefill {res['prefill_tok_s']} tok/s, decode {res['decode_tok_s']} tok/s ({res['wall_s']} s)"),
              flush=True)
        store.write_text(json.dumps(data, indent=1))
        (out / "throughput.md").write_text(report(data["results"], data["meta"], rounds))
    return 0 if all("error" not in r for r in data["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

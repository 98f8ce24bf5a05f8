#!/usr/bin/env python3
"""Where does a GGUF engine's first non-finite value come from? One vLLM engine per process (H200).

Serves one file of the GGUF fixture (tests/fixtures/make_glm_dsa_gguf.py --variant h200) with the e2e proof's
teacher-forced sequences (bench/e2e: seeded prompts of 300-561 tokens + 48 fixed tokens, prompt_logprobs) and
prefill chunks of --chunk tokens. With --hooks (torch.compile off, so that module hooks run) every module's
forward is watched: a module whose inputs are all finite and whose output is not is an *origin*; the first
origins are listed (module, class, forward step, tokens in the step, the GGUF quant type of its weight) and
the first one's inputs, output and weight are saved for an offline check (dequantize + float64 matmul).

    python bench/gguf_nan_probe.py --fixture .fixtures/h200 --out $OUT [--gguf Q8_0] [--configs ...]

runs each config of --configs (`chunk:compile`, e.g. 256:off,512:off,256:on) in its own process, one at a time,
and writes $OUT/nan_probe.md (+ nan_probe.json, origin-<config>.pt). The vLLM on PYTHONPATH is used as it is
(apply the overlay first for the Triton path; --path upstream asks for FLASHMLA_SPARSE + DeepGEMM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e.plan import MODELS  # noqa: E402
from bench.e2e.run import failure_line, finish_worker, make_prompts, start_worker  # noqa: E402
from bench.e2e.worker import serve  # noqa: E402

MAX_ORIGINS = 12
SAVE_LIMIT = 15 * 2**20  # bytes of tensors in one origin file (a call brings files of <= 16 MB back)


def _tensors(x):
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _finite(x) -> bool:
    import torch

    return all(bool(torch.isfinite(t).all()) for t in _tensors(x)
               if t.is_floating_point() and t.numel() and t.element_size() > 1)  # (no isfinite for fp8)


class Watch:
    """Forward hooks on every module of the model: origins of non-finite values, per forward step."""

    def __init__(self, save_path: str | None):
        self.step = 0
        self.tokens = 0
        self.origins: list = []
        self.nonfinite_steps: list = []
        self.save_path = save_path
        self.saved = None
        self.inputs: dict = {}

    def install(self, model):
        import torch

        def pre_root(module, args, kwargs):
            self.step += 1
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.tokens = int(ids.shape[0]) if isinstance(ids, torch.Tensor) else -1

        def post_root(module, args, kwargs, output):
            if not _finite(output):
                self.nonfinite_steps.append([self.step, self.tokens])

        model.register_forward_pre_hook(pre_root, with_kwargs=True)
        model.register_forward_hook(post_root, with_kwargs=True)
        for name, mod in model.named_modules():
            if mod is not model:
                mod.register_forward_pre_hook(self._pre(mod), with_kwargs=True)
                mod.register_forward_hook(self._post(name), with_kwargs=True)
        return len(list(model.named_modules()))

    def _pre(self, mod):
        """Inputs as the module gets them (it may change them in place: fused add + RMSNorm)."""
        def pre(module, args, kwargs):
            if len(self.origins) >= MAX_ORIGINS:
                return
            finite = _finite(args) and _finite(kwargs)
            kept = [t.detach().clone() for t in _tensors((args, kwargs))] if finite and self.saved is None else None
            self.inputs.setdefault(id(module), []).append((finite, kept))
        return pre

    def _post(self, name):
        def post(module, args, kwargs, output):
            stack = self.inputs.get(id(module))
            if not stack:
                return
            finite_in, kept = stack.pop()
            if not finite_in or _finite(output):
                return  # fine, or carried in from an input
            import torch

            qt = getattr(module, "qweight_type", None)
            qtype = int(qt.reshape(-1)[0]) if isinstance(qt, torch.Tensor) and qt.numel() else None
            outs = [t for t in _tensors(output) if t.is_floating_point() and t.element_size() > 1]
            origin = dict(module=name, cls=type(module).__name__, step=self.step, tokens=self.tokens,
                          qweight_type=qtype, in_shapes=[list(t.shape) for t in kept or []],
                          out_shapes=[list(t.shape) for t in outs],
                          nonfinite_out=[int((~torch.isfinite(t)).sum()) for t in outs])
            self.origins.append(origin)
            if self.saved is None and self.save_path and kept is not None:
                self._save(name, module, kept, outs, origin)
        return post

    def _save(self, name, module, inputs, outputs, origin):
        import torch

        blob = {"origin": origin, "args": [t.cpu() for t in inputs], "output": [t.detach().cpu() for t in outputs],
                "state": {k: v.detach().cpu() for k, v in list(module.named_parameters(recurse=False))
                          + list(module.named_buffers(recurse=False))}}
        size = sum(t.numel() * t.element_size() for t in blob["args"] + blob["output"]
                   + list(blob["state"].values()))
        if size > SAVE_LIMIT:
            blob["state"] = {k: v for k, v in blob["state"].items() if v.numel() * v.element_size() < 2**20}
            blob["state_dropped"] = True
        torch.save(blob, self.save_path)
        self.saved = name


def probe(cfg: dict) -> dict:
    """One engine: cfg = dict(model, tokenizer, chunk, compile, hooks, path, save)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["DSA_OVERLAY_PORTABLE"] = "1" if cfg["path"] == "triton" else "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    seqs = make_prompts(MODELS["gguf_q8_0"], cfg["vocab"])["tf_sequences"]
    kwargs = dict(model=cfg["model"], tokenizer=cfg["tokenizer"], skip_tokenizer_init=True, dtype="bfloat16",
                  seed=0, max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=cfg["chunk"],
                  gpu_memory_utilization=0.5, enable_prefix_caching=False, enforce_eager=True)
    if cfg["path"] == "upstream":
        kwargs["attention_backend"] = "FLASHMLA_SPARSE"
    if not cfg["compile"]:
        kwargs["compilation_config"] = {"mode": 0}
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except (TypeError, ValueError) as e:
        if "compilation_config" not in kwargs or "mode" not in str(e):
            raise
        kwargs["compilation_config"] = {"level": 0}  # releases before CompilationConfig.mode
        llm = LLM(**kwargs)
    res = {"startup_s": round(time.perf_counter() - t0, 1)}
    watch = Watch(cfg.get("save"))
    if cfg["hooks"]:
        res["modules_watched"] = llm.apply_model(watch.install)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], sp, use_tqdm=False)
    nan_pos = []
    for o, s in zip(outs, seqs):
        lps = [d[t].logprob if d and t in d else None for d, t in zip(o.prompt_logprobs[1:], s[1:])]
        bad = [i + 1 for i, v in enumerate(lps) if v is None or v != v or v in (float("inf"), float("-inf"))]
        nan_pos.append(dict(len=len(s), nonfinite=len(bad), first=bad[:1], last=bad[-1:]))
    res.update(sequences=nan_pos, origins=watch.origins, nonfinite_steps=watch.nonfinite_steps[:40],
               steps=watch.step, saved=watch.saved)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", help="the GGUF fixture folder (fixture.json)")
    ap.add_argument("--gguf", default="Q8_0", help="fixture.json gguf tag (BF16, Q8_0, Q4_K_M)")
    ap.add_argument("--configs", default="256:off,512:off,256:on",
                    help="CHUNK:COMPILE[:PATH] list; compile off = hooks on (PATH upstream or triton)")
    ap.add_argument("--path", default="upstream", choices=("upstream", "triton"))
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out", default="nan_probe_out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        serve(probe, args.worker)
    fx = Path(args.fixture)
    info = json.loads((fx / "fixture.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for item in args.configs.split(","):
        parts = item.split(":")
        chunk, comp = int(parts[0]), parts[1] == "on"
        path = parts[2] if len(parts) > 2 else args.path
        tag = f"{args.gguf}-c{chunk}-{'compile' if comp else 'eager-hooks'}-{path}"
        cfg = dict(model=str(fx / info["gguf"][args.gguf]), tokenizer=str(fx / info["hf"]), chunk=chunk,
                   compile=comp, hooks=not comp, path=path, vocab=int(info["config"]["vocab_size"]),
                   save=str(out / f"origin-{tag}.pt") if not comp else None)
        t0 = time.perf_counter()
        res = finish_worker(start_worker(cfg, os.environ.get("PYTHONPATH", ""), cli=Path(__file__)), t0, args.timeout)
        results[tag] = res
        print(f"[probe] {tag}: {json.dumps(res)[:1500]}", flush=True)
        (out / "nan_probe.json").write_text(json.dumps(results, indent=1))
        (out / "nan_probe.md").write_text(report(results))
    return 0


def report(results: dict) -> str:
    lines = ["# GGUF non-finite probe", "", "| config | startup s | sequences: non-finite prompt logprobs (of len) "
             "| first origin (module, class, step, tokens, quant type) | origins |", "|---|---|---|---|---|"]
    for tag, r in results.items():
        if "error" in r:
            lines.append(f"| {tag} | {r['error']} | {failure_line(r)} | | |")
            continue
        seqs = ", ".join(f"{s['nonfinite']}/{s['len']}" for s in r["sequences"])
        o = r["origins"][0] if r.get("origins") else None
        first = (f"{o['module']} ({o['cls']}), step {o['step']}, {o['tokens']} tokens, type {o['qweight_type']}"
                 if o else "-")
        lines.append(f"| {tag} | {r['startup_s']} | {seqs} | {first} | {len(r.get('origins', []))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

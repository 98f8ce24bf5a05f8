"""Layer by layer: each path's indexer and sparse attention against a float64 reference of that same
layer computed from that path's own inputs (bench/e2e/reference.py). Decides whether a path's distance
from upstream on a model (the DeepSeek-V3.2-shaped one: 2.4x upstream's noise floor on vLLM 0.23.0) is
rounding or a defect.

One command, one device call (vLLM staged at /root/site, the overlay applied; ~1 min per engine):

    . /root/vllm-env.sh && python3 bench/e2e/layerwise.py --site /root/site --out $OUT/layerwise.md

Options: --model (plan.MODELS; default dsv32), --kv auto,fp8_ds_mla, --paths upstream,triton (also
attn_triton, idx_triton), --rows (sampled query rows per kernel call, default 4). Each (kv, path) is one
engine in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, eager, so the hooks run in-process), one at
a time; the worker ends with os._exit. It runs the teacher-forced pass of the proof's prompts (prompt
lengths of the model: 2600-3500 for dsv32, longer than its top-k 2048) with these hooks:

* indexer: DeepGEMM's `fp8_fp4_mqa_logits` / `fp8_mqa_logits` (vllm.utils.deep_gemm) and the overlay's
  (vllm._dsa_overlay.kernels.indexer), as the overlay's dispatcher (overlay/indexer_ops.py) calls them;
  the layer is the indexer op's (`SparseAttnIndexer.forward_cuda`, its k_cache prefix). For up to --rows
  rows per call that select (more keys than top-k): the reference logits from the call's own fp8 q / k /
  scales / weights, the path's logits, and then, at that layer's attention, the top-k the path chose
  (`topk_indices_buffer`, request-local positions);
* attention: FlashMLA's `flash_mla_sparse_fwd` / `flash_mla_with_kvcache` (as the FLASHMLA_SPARSE backend
  module calls them) and the overlay's `sparse_mla_attention` (overlay/triton_mla_sparse_ops.py calls it
  through vllm._dsa_overlay.kernels.sparse_mla): for up to --rows rows per call, the reference attention
  over the slots the kernel was given, from its own q and cache.

Only statistics leave the engine (per layer: top-k set agreement with the reference, differing picks
and how many are near-ties, i.e. within the path's own logits error of the reference's k-th score;
attention error median / p99 / max). Writes the table to --out and the raw JSON beside it.
Verdict per path: "rounding" when every differing top-k pick is a near-tie and the attention error p99
stays within the cache dtype's bound (plan.LAYER0_ERR_P99) at every layer, else "DEFECT" naming the
layer and the kernel; and per cache dtype, whether the Triton path is as close to its reference as
upstream is to its own (`against_upstream`: a cause both share, e.g. vLLM's top-k op, is not ours).
The references start at each kernel's inputs: if both paths are rounding there and the proof still
shows the distance, the next suspects are the inputs' preparation (the indexer's fp8 q / k
quantization, the cache writes), which `e2e_proof.py --plan isolate-dsv32` pins on a component.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.e2e import reference as REF  # noqa: E402
from bench.e2e.plan import ATTENTION_BACKEND, LAYER0_ERR_P99, MODELS, VOCAB  # noqa: E402
from bench.e2e.worker import spec_arg  # noqa: E402

INDEXER_HOOKS = {  # module -> logits functions whose arguments are (q, (k, k_scale), weights, ks, ke)
    "vllm.model_executor.layers.sparse_attn_indexer": ["fp8_fp4_mqa_logits", "fp8_mqa_logits"],
    "vllm.utils.deep_gemm": ["fp8_fp4_mqa_logits", "fp8_mqa_logits"],
    "vllm._dsa_overlay.kernels.indexer": ["fp8_fp4_mqa_logits", "fp8_mqa_logits"],
}
ATTENTION_HOOKS = {
    "vllm.v1.attention.backends.mla.flashmla_sparse": ["flash_mla_sparse_fwd", "flash_mla_with_kvcache"],
    "vllm._dsa_overlay.kernels.sparse_mla": ["sparse_mla_attention"],
}
IMPL_CLASSES = (("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl"),
                ("vllm._dsa_overlay.triton_mla_sparse", "TritonMLASparseImpl"))


def layer_index(name) -> int | None:
    m = re.search(r"layers\.(\d+)\.", str(name or ""))
    return int(m.group(1)) if m else None


def verdict(layers: dict, kv: str) -> str:
    """One path's verdict from its per-layer summaries (reference.summarize)."""
    if not layers:
        return "no data: no hooked kernel call was captured"
    bad = []
    limit = LAYER0_ERR_P99["fp8_ds_mla" if kv == "fp8_ds_mla" else "auto"]
    for name, s in sorted(layers.items(), key=lambda kv_: (layer_index(kv_[0]) or 0, kv_[0])):
        if s.get("differ") and s.get("near_ties", 0) < s["differ"]:
            bad.append(f"{name}: top-k, {s['differ'] - s['near_ties']} of {s['differ']} differing picks "
                       "beyond the path's own logits error")
        if s.get("attn_err_p99") is not None and s["attn_err_p99"] > limit:
            bad.append(f"{name}: attention error p99 {s['attn_err_p99']:.2e} > {limit:.0e}")
    if bad:
        return "DEFECT: " + "; ".join(bad)
    return (f"rounding: every differing top-k pick is a near-tie and attention error p99 <= {limit:.0e} "
            "at every layer")


def against_upstream(ours: dict, upstream: dict, factor: float = 1.5) -> str:
    """Ours and upstream, each against its own reference, layer by layer: is ours as close to exact as
    upstream (within `factor` on the attention error p99, no more top-k picks beyond tolerance than
    upstream + 1 per 1000 selecting rows)? Catches a shared cause (e.g. an approximate top-k op both
    paths use) that would make both verdicts say DEFECT."""
    if not ours or not upstream:
        return "not compared: a path has no data"
    worse = []
    for name in sorted(set(ours) & set(upstream), key=lambda n: (layer_index(n) or 0, n)):
        o, u = ours[name], upstream[name]
        beyond = lambda s: s.get("differ", 0) - s.get("near_ties", 0)  # noqa: E731
        slack = max(1, o.get("topk_rows", 0) // 1000)
        if beyond(o) > beyond(u) + slack:
            worse.append(f"{name}: {beyond(o)} top-k picks beyond tolerance vs upstream's {beyond(u)}")
        if None not in (o.get("attn_err_p99"), u.get("attn_err_p99")) and \
                o["attn_err_p99"] > factor * u["attn_err_p99"]:
            worse.append(f"{name}: attention error p99 {o['attn_err_p99']:.2e} vs upstream's "
                         f"{u['attn_err_p99']:.2e}")
    if worse:
        return "further from the reference than upstream: " + "; ".join(worse)
    return f"as close to the reference as upstream at every layer (attention p99 within {factor}x)"


class Capture:
    """The hooks' state inside one engine process."""

    def __init__(self, topk: int, rows: int):
        import torch

        self.torch = torch
        self.topk, self.rows = topk, rows
        self.on = False
        self.busy = False                # an outer hooked call is running: inner ones are the same call
        self.indexer_layer = None        # set by the indexer op's forward
        self.heads = None                # set by forward_mqa (padded heads of FlashMLA are cut off)
        self.row_offset: dict = {}       # indexer layer -> rows of its calls so far in this step
        self.pending: list = []          # indexer samples waiting for their layer's chosen top-k
        self.stale = 0                   # samples of steps whose attention did not run forward_mqa
        self.topk_rows: dict = {}        # layer -> compare_topk rows
        self.attn_errs: dict = {}        # layer -> attention errors
        self.calls: dict = {}            # hooked function -> calls captured
        self.layer = None

    def _count(self, key):
        self.calls[key] = self.calls.get(key, 0) + 1

    def _sample(self, candidates):
        """Up to self.rows indices spread over `candidates` (a 1-D tensor), the last one included."""
        n = candidates.numel()
        if n <= self.rows:
            return candidates
        pick = self.torch.linspace(0, n - 1, self.rows).round().long().to(candidates.device)
        return candidates[pick]

    # --- indexer ---------------------------------------------------------------------------------
    def indexer(self, key, fn):
        cap = self

        def hooked(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, *args, **kwargs):
            if not cap.on or cap.busy:   # off, or called from a hooked caller (the overlay's dispatcher)
                return fn(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, *args, **kwargs)
            cap.busy = True
            try:
                logits = fn(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, *args, **kwargs)
                cap._indexer_sample(key, q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, logits)
            finally:
                cap.busy = False
            return logits

        return hooked

    def _indexer_sample(self, key, q, kv, weights, ks, ke, logits):
        torch = self.torch
        if isinstance(q, tuple):
            q, q_scale = q
            if q_scale is not None:      # fp4 query: not covered by the reference
                self._count(f"{key} (fp4, skipped)")
                return
        k, k_scale = kv
        layer = self.indexer_layer
        offset = self.row_offset.get(layer, 0)
        self.row_offset[layer] = offset + q.shape[0]
        n = (ke.long() - ks.long())
        sel = self._sample(torch.nonzero(n > self.topk).flatten())
        self._count(key)
        if sel.numel() == 0:
            return
        ref = REF.indexer_logits_ref(q[sel], k, k_scale.reshape(-1), weights[sel], ks[sel], ke[sel])
        self.pending.append(dict(layer=layer, rows=(sel + offset), ref=ref, path=logits[sel].float(),
                                 ks=ks[sel], ke=ke[sel]))

    def indexer_op(self, fn):
        cap = self

        def forward_cuda(op, *args, **kwargs):
            # a new step of this layer: its rows count from 0 again, and samples of an earlier step that
            # no forward_mqa paired (vLLM 0.26 sends prefills no longer than top-k to dense MHA) are dropped
            layer = cap.indexer_layer = getattr(getattr(op, "k_cache", None), "prefix", None)
            cap.row_offset[layer] = 0
            stale = [p for p in cap.pending if p["layer"] == layer]
            if stale:
                cap.stale += len(stale)
                cap.pending = [p for p in cap.pending if p["layer"] != layer]
            return fn(op, *args, **kwargs)

        return forward_cuda

    # --- attention -------------------------------------------------------------------------------
    def forward_mqa(self, fn):
        cap = self

        def forward_mqa(impl, q, kv_cache, attn_metadata, layer):
            cap.layer = str(getattr(layer, "layer_name", "?"))
            cap.heads = getattr(impl, "num_heads", None)
            out = fn(impl, q, kv_cache, attn_metadata, layer)
            if cap.on:
                cap._chosen_topk(impl)
            return out

        return forward_mqa

    def _chosen_topk(self, impl):
        """Pair the indexer samples of this layer with the top-k it chose; the step's rows restart."""
        li = layer_index(self.layer)
        mine = [p for p in self.pending if layer_index(p["layer"]) in (li, None)]
        self.pending = [p for p in self.pending if layer_index(p["layer"]) not in (li, None)]
        self.row_offset.clear()
        buf = getattr(impl, "topk_indices_buffer", None)
        if buf is None:
            return
        for p in mine:
            if int(p["rows"].max()) >= buf.shape[0]:   # rows this buffer cannot hold: not this step's
                self.stale += 1
                continue
            chosen = buf[p["rows"], :self.topk]
            rows = REF.compare_topk(chosen.cpu(), p["ref"].cpu(), p["ks"].cpu(), p["ke"].cpu(),
                                    self.topk, path_logits=p["path"].cpu())
            self.topk_rows.setdefault(self.layer, []).extend(rows)

    def attention(self, key, fn):
        import inspect

        cap = self
        sig = inspect.signature(fn)

        def hooked(*args, **kwargs):
            if not cap.on or cap.busy:
                return fn(*args, **kwargs)
            cap.busy = True
            try:
                res = fn(*args, **kwargs)
                cap._attention_sample(key, sig.bind(*args, **kwargs).arguments, res)
            finally:
                cap.busy = False
            return res

        return hooked

    def _attention_sample(self, key, a, res):
        torch = self.torch
        out = res[0] if isinstance(res, (tuple, list)) else res  # flash_mla_sparse_fwd (0.26): a list
        if a.get("extra_k_cache") is not None or a.get("attn_sink") is not None:
            self._count(f"{key} (extra cache / sink, skipped)")
            return
        q = a["q"]
        kv = a.get("kv", a.get("k_cache", a.get("kv_cache")))
        idx = a["indices"]
        scale = a.get("sm_scale", a.get("softmax_scale"))
        if scale is None:
            scale = q.shape[-1] ** -0.5
        length = a.get("topk_length")
        # flatten FlashMLA's [B, s_q, H, D] / [s_q, h_kv, topk] shapes to rows
        q = q.reshape(-1, q.shape[-2], q.shape[-1])
        out = out.reshape(-1, out.shape[-2], out.shape[-1])
        bt, rid = a.get("block_table"), a.get("req_id")
        if bt is not None and rid is not None:
            # request-local positions in a fixed-address buffer (rows past T unread) that the kernel
            # converts itself (the overlay's backend from 0.26 on): the slots it reads
            idx = idx.reshape(-1, idx.shape[-1])[: q.shape[0]]
            idx = REF.local_to_slots(idx, rid[: q.shape[0]], bt, kv.shape[1])
        else:
            idx = idx.reshape(q.shape[0], -1)
        if length is not None:
            length = length.reshape(-1)
        heads = min(self.heads or q.shape[1], q.shape[1])
        sel = self._sample(torch.arange(q.shape[0], device=q.device))
        self._count(key)
        rows, valid = REF.gather_kv(kv, idx[sel], None if length is None else length[sel])
        ref, _ = REF.sparse_attention_ref(q[sel, :heads], rows, valid, float(scale))
        err = REF.attention_error(out[sel, :heads], ref)
        self.attn_errs.setdefault(self.layer, []).extend(err.cpu().tolist())

    def summary(self) -> dict:
        layers = sorted(set(self.topk_rows) | set(self.attn_errs), key=lambda n: (layer_index(n) or 0, n))
        return {n: REF.summarize(self.topk_rows.get(n, []), self.attn_errs.get(n, [])) for n in layers}


def install(cap: Capture) -> list[str]:
    """Wrap the hooked functions and classes; -> what could not be hooked (release differences)."""
    import importlib

    missing = []
    for table, make in ((INDEXER_HOOKS, cap.indexer), (ATTENTION_HOOKS, cap.attention)):
        for mod_name, names in table.items():
            try:
                mod = importlib.import_module(mod_name)
            except Exception as e:  # noqa: BLE001
                missing.append(f"{mod_name} ({type(e).__name__})")
                continue
            for name in names:
                if hasattr(mod, name):
                    setattr(mod, name, make(f"{mod_name.rsplit('.', 1)[-1]}.{name}", getattr(mod, name)))
    for mod_name, cls_name in IMPL_CLASSES:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except Exception as e:  # noqa: BLE001
            missing.append(f"{mod_name}.{cls_name} ({type(e).__name__})")
            continue
        cls.forward_mqa = cap.forward_mqa(cls.forward_mqa)
    try:
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

        SparseAttnIndexer.forward_cuda = cap.indexer_op(SparseAttnIndexer.forward_cuda)
    except Exception as e:  # noqa: BLE001
        missing.append(f"SparseAttnIndexer.forward_cuda ({type(e).__name__}): layers by order")
    return missing


def worker(spec: dict) -> dict:
    path = spec["path"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # engine in this process: the hooks apply
    os.environ["DSA_OVERLAY_PORTABLE"] = "1" if path == "triton" else "0"
    os.environ["DSA_OVERLAY_INDEXER"] = "triton" if path == "idx_triton" else "auto"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cap = Capture(spec["topk"], spec["rows"])
    missing = install(cap)
    kwargs = dict(model=spec["model_dir"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  max_model_len=spec["max_model_len"], max_num_seqs=4, max_num_batched_tokens=256,
                  gpu_memory_utilization=0.5, kv_cache_dtype=spec["kv"], enable_prefix_caching=False,
                  enforce_eager=True)
    if path in ATTENTION_BACKEND:
        kwargs["attention_backend"] = ATTENTION_BACKEND[path]
    llm = LLM(**kwargs)
    tf = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    cap.on = True
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=s) for s in spec["sequences"]], tf, use_tqdm=False)
    cap.on = False
    return {"layers": cap.summary(), "calls": cap.calls, "not_hooked": missing,
            "unpaired_indexer_samples": len(cap.pending) + cap.stale, "tf_s": round(time.perf_counter() - t0, 1)}


def _fmt(x, spec=".2e"):
    return "" if x is None else format(x, spec)


def table(results: dict, kv_paths: list) -> list[str]:
    lines = ["| cache | path | layer | top-k rows | same set | mean overlap | differing picks | near-ties | "
             "max gap / max score | logits err max | attn rows | attn err median | p99 | max |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for kv, path in kv_paths:
        r = results.get(f"{kv}/{path}", {})
        if "error" in r:
            lines.append(f"| {kv} | {path} | FAILED: {r['error']} |" + " |" * 11)
            continue
        for name, s in r.get("layers", {}).items():
            lines.append(f"| {kv} | {path} | {name} | {s['topk_rows']} | {_fmt(s['same_set'], '.4f')} | "
                         f"{_fmt(s['overlap'], '.4f')} | {s['differ']} | {s['near_ties']} | "
                         f"{_fmt(s['gap_max'])} | {_fmt(s['logit_err_max'])} | {s['attn_rows']} | "
                         f"{_fmt(s['attn_err_median'])} | {_fmt(s['attn_err_p99'])} | {_fmt(s['attn_err_max'])} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", default="/root/site", help="site-packages holding vLLM with the overlay")
    ap.add_argument("--model", default="dsv32", choices=[m for m, s in MODELS.items() if not s.gguf])
    ap.add_argument("--kv", default="auto,fp8_ds_mla", help="comma-separated kv cache dtypes")
    ap.add_argument("--paths", default="upstream,triton", help="comma-separated paths (bench/e2e/plan.py)")
    ap.add_argument("--rows", type=int, default=4, help="sampled query rows per hooked kernel call")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is saved (reused)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per engine")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "layerwise.md"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from bench.e2e.worker import serve

        serve(worker, args.worker)

    from bench.e2e.run import finish_worker, make_model, make_prompts

    t_start = time.perf_counter()
    model = MODELS[args.model]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dsa_layerwise_"))
    mdir = work / args.model
    if not (mdir / "config.json").exists():
        make_model(mdir, model)
    sequences = make_prompts(model, VOCAB)["tf_sequences"]
    kv_paths = [(kv, p) for kv in args.kv.split(",") for p in args.paths.split(",")]
    results = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), args.site) if x))
    for kv, path in kv_paths:
        spec = dict(model_dir=str(mdir), path=path, kv=kv, topk=model.config["index_topk"], rows=args.rows,
                    max_model_len=model.max_model_len, sequences=sequences)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", spec_arg(spec)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        results[f"{kv}/{path}"] = finish_worker(proc, t0, args.timeout)
        print(f"{kv}/{path}: {results[f'{kv}/{path}'].get('error', 'ok')}", flush=True)
    lines = [f"## Layer by layer vs a float64 reference: {args.model} ({time.strftime('%Y-%m-%d')}, "
             f"{time.perf_counter() - t_start:.0f} s)", "",
             f"Model {args.model}: {model.config}, {model.json or ''}; teacher-forced prompts of "
             f"{', '.join(str(len(s)) for s in sequences)} tokens, 256-token prefill chunks, eager; "
             f"{args.rows} sampled rows per kernel call. Top-k rows: sampled indexer rows that select "
             "(more keys than top-k); same set / overlap against the reference's top-k of that path's own "
             "inputs; a differing pick is a near-tie when its reference score is within 2 x the path's "
             "logits error (plus 1e-6 relative) of the reference's k-th score. Attention error: per token "
             "max |out - ref| / max |ref| over the slots the kernel was given.", "",
             *table(results, kv_paths), ""]
    for kv, path in kv_paths:
        r = results[f"{kv}/{path}"]
        v = verdict(r.get("layers", {}), kv) if "error" not in r else "FAILED (log below)"
        lines.append(f"- {kv} / {path}: {v}. Calls: {r.get('calls', {})}; not hooked: "
                     f"{r.get('not_hooked', [])}; unpaired indexer samples: {r.get('unpaired_indexer_samples')}")
    for kv in args.kv.split(","):
        up, tri = results.get(f"{kv}/upstream", {}), results.get(f"{kv}/triton", {})
        if "layers" in up and "layers" in tri:
            lines.append(f"- {kv}, Triton vs upstream: {against_upstream(tri['layers'], up['layers'])}")
    for key, r in results.items():
        if "error" in r:
            lines += ["", f"<details><summary>{key} log</summary>", "", "```", r.get("log", ""), "```",
                      "</details>"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results))
    print("\n".join(lines))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

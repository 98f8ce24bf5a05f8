"""One vLLM engine, in its own process (bench/e2e_proof.py --worker SPEC): greedy steps, teacher-forced
prompt_logprobs (with per-layer dumps of the indexer's top-k and the attention output), decode tokens/s;
every vendor DSA entry point and every Triton kernel entry point counted (vendor ones raise on the
portable path). Returns one JSON-able dict; imports vLLM only inside worker()."""

from __future__ import annotations

import json
import os
import sys
import time

from .plan import (ATTENTION_BACKEND, GREEDY_STEPS, TPS_BATCH, TRITON_ENTRY_POINTS, VENDOR_ENTRY_POINTS,
                   vendor_kernel)


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


class _Dumper:
    """Records, per attention call of the teacher-forced pass, the indexer's top-k rows (request-local
    positions, before any slot conversion), the attention output handed to W_UV and each token's KV slot
    (the same token in two engines: the scheduler, not the backend, allocates blocks)."""

    def __init__(self):
        self.on = False
        self.calls: list = []

    def wrap(self, cls):
        orig = cls.forward_mqa
        dumper = self

        def forward_mqa(impl, q, kv_cache, attn_metadata, layer):
            out, lse = orig(impl, q, kv_cache, attn_metadata, layer)
            if dumper.on:
                n = out.shape[0]
                dumper.calls.append({
                    "layer": str(getattr(layer, "layer_name", "?")),
                    "topk": impl.topk_indices_buffer[:n].to("cpu", copy=True),
                    "slots": attn_metadata.slot_mapping[:n].to("cpu", copy=True),  # token identity
                    "out": out[:n].to("cpu", copy=True),
                })
            return out, lse

        cls.forward_mqa = forward_mqa


def _count_forward_mha() -> dict:
    """Calls of each sparse impl's forward_mha (vLLM 0.26+: prefills no longer than top-k go to dense MHA
    when the layer has a prefill backend), so a run says which path its short prefills took."""
    import importlib

    counts: dict = {}
    for mod_name, cls_name in (("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl"),
                               ("vllm.v1.attention.backends.mla.flashattn_mla_sparse", "FlashAttnMLASparseImpl"),
                               ("vllm._dsa_overlay.triton_mla_sparse", "TritonMLASparseImpl")):
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except Exception:  # noqa: BLE001 - not in this release / tree
            continue
        orig = getattr(cls, "forward_mha", None)
        if orig is None:
            continue
        counts[cls_name] = 0

        def forward_mha(impl, *args, __orig=orig, __name=cls_name, **kwargs):
            counts[__name] += 1
            return __orig(impl, *args, **kwargs)

        cls.forward_mha = forward_mha
    return counts


def _census(fn):
    """(fn(), the CUDA kernels it launched: how many distinct, the vendor DSA ones by name with their
    counts, the 12 most launched) from torch.profiler (the engine runs in this process)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
    names = collections.Counter(e.name for e in prof.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA)
    return out, {"kernels": len(names),
                 "vendor": {k[:160]: v for k, v in names.items() if vendor_kernel(k)},
                 "top": [[k[:160], v] for k, v in names.most_common(12)]}


def _top5(logprobs: dict) -> list:
    """The five most likely token ids of one position of vLLM's logprobs output."""
    return sorted(logprobs, key=lambda k: -logprobs[k].logprob)[:5]


def worker(spec: dict) -> dict:
    path = spec["path"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: patches apply
    os.environ["DSA_OVERLAY_PORTABLE"] = "1" if path == "triton" else "0"
    os.environ["DSA_OVERLAY_INDEXER"] = "triton" if path == "idx_triton" else "auto"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vendor_calls: dict = {}
    triton_calls: dict = {}
    _instrument(VENDOR_ENTRY_POINTS, vendor_calls, raise_on_call=path == "triton")
    _instrument(TRITON_ENTRY_POINTS, triton_calls, raise_on_call=False)
    mha_calls = _count_forward_mha()
    dumper = _Dumper()
    if spec.get("dump_path"):
        from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

        dumper.wrap(FlashMLASparseImpl)
        try:
            from vllm._dsa_overlay.triton_mla_sparse import TritonMLASparseImpl

            dumper.wrap(TritonMLASparseImpl)
        except ImportError:  # an upstream-only tree
            pass

    kwargs = dict(
        model=spec["model_dir"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        max_model_len=spec.get("max_model_len", 1024), max_num_seqs=TPS_BATCH, max_num_batched_tokens=spec.get("chunk", 256),
        gpu_memory_utilization=spec.get("mem", 0.5), kv_cache_dtype=spec["kv"],
        enable_prefix_caching=False,
    )
    if spec.get("tokenizer"):   # a GGUF file: its fixture's tokenizer folder
        kwargs["tokenizer"] = spec["tokenizer"]
    # upstream is asked for FLASHMLA_SPARSE by name (vLLM 0.26.0 would pick FLASH_ATTN_MLA_SPARSE)
    if path in ATTENTION_BACKEND:
        kwargs["attention_backend"] = ATTENTION_BACKEND[path]
    result_extra = {}
    if spec.get("force_mqa"):
        # vLLM 0.26+ sends prefills no longer than top-k to dense MHA, by each backend's own batch split:
        # with the switch on, every token of the teacher-forced pass goes through forward_mqa in every engine
        try:
            from vllm.config import AttentionConfig
        except ImportError:  # releases before the attention config
            AttentionConfig = None
        if "sparse_mla_force_mqa" in getattr(AttentionConfig, "__dataclass_fields__", {}):
            kwargs["attention_config"] = {"sparse_mla_force_mqa": True}
            result_extra["force_mqa"] = True
    if spec["graphs"]:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    else:
        kwargs["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result = {"startup_s": round(time.perf_counter() - t0, 1), **result_extra}

    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True,
                            logprobs=5, detokenize=False)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    result["step_logprobs"] = [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outs
    ]
    result["step_top5"] = [[_top5(d) for d in o.outputs[0].logprobs] for o in outs]

    tf = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, detokenize=False)
    dumper.on = bool(spec.get("dump_path"))
    def tf_pass():
        return llm.generate([TokensPrompt(prompt_token_ids=s) for s in spec["tf_sequences"]], tf,
                            use_tqdm=False)

    if spec.get("census"):
        tf_outs, result["census"] = _census(tf_pass)
    else:
        tf_outs = tf_pass()
    dumper.on = False
    if spec.get("dump_path"):
        import torch

        torch.save(dumper.calls, spec["dump_path"])
        result["dump_calls"] = len(dumper.calls)
    result["tf_logprobs"], result["tf_top5"] = [], []
    for o, seq in zip(tf_outs, spec["tf_sequences"]):
        pl = o.prompt_logprobs[1:]
        result["tf_logprobs"].append([d[t].logprob for d, t in zip(pl, seq[1:])])
        result["tf_top5"].append([_top5(d) for d in pl])

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
    result["forward_mha_calls"] = dict(mha_calls)
    result["vendor_calls"] = vendor_calls
    result["triton_calls"] = triton_calls
    return result


def spec_arg(spec: dict) -> str:
    """The --worker argument for `spec`: the path of a JSON file holding it (a spec with the prompts of
    long-context models is far beyond the kernel's 128 KiB limit on one argv string)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="dsa_spec_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    return path


def serve(fn, spec_path: str):
    """A worker process's whole life: fn(the spec in file `spec_path`, see spec_arg) printed as one RESULT
    line, or its traceback; then os._exit (0 / 1), since a vLLM 0.26.0 engine keeps the process alive
    after generate (../shared/FACTS.md)."""
    try:
        with open(spec_path) as f:
            spec = json.load(f)
        os.unlink(spec_path)
        print("RESULT " + json.dumps(fn(spec)), flush=True)
        code = 0
    except BaseException:  # noqa: BLE001 - the traceback is the parent's log; the process must end
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

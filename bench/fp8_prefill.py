#!/usr/bin/env python3
"""fp8_ds_mla prefill attention: straight from the fp8 cache against a bf16 copy of the context (the workspace).

One prefill step as the end-to-end bench (bench/throughput.py) schedules it: --requests fresh prompts of
--prompt-len tokens in one chunk, 64 heads (GLM-5), index top-k 2048 with causal lists (token p: a random
min(p + 1, 2048) of positions 0..p, -1 after), each request's blocks scattered over a 262144-slot paged cache.
Rows, each timed as the kernel benches time (bench/timing.py: graph, eager, launch; L2 flushed before a call):

- fp8 direct: `triton_mla_sparse_ops.sparse_mla_forward` on the fp8_ds_mla cache (the fp8 tile);
- fp8 workspace: the same call with the step's plan (`plan_fp8_prefill`): up-convert the requests' blocks, then
  the bf16 tile over the copy (what TRITON_MLA_SPARSE runs for such a step);
- up-convert alone (overlay/kernels/fp8_workspace.py);
- bf16 direct: the bf16 tile on a bf16 cache of the same values;
- FlashMLA bf16 sparse prefill (`flash_mla_sparse_fwd`, heads padded as vLLM does) on the same slots: the kernel
  FLASHMLA_SPARSE runs for an fp8_ds_mla prefill after its own up-conversion (64+ heads), and FlashMLA's fp8
  decode kernel on the whole step as one sequence (its mixed-batch mode), when vLLM's FlashMLA imports.

--mma-sync adds our rows built for mma.sync (DISABLE_MMA_V3=1, own TRITON_CACHE_DIR, DSA_OVERLAY_GLUON=0: the
mma.sync GPUs have no Gluon tile). Errors: the workspace path against the direct one, and both against a float32
reference on a sample of tokens. `--cpu-smoke` runs a tiny step in Triton's interpreter (numbers meaningless).

    python3 bench/fp8_prefill.py --out $OUT/fp8_prefill.md [--mma-sync]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.timing import Timer, add_timing_args, mma_sync_column, write_child_json  # noqa: E402

TOPK = 2048
HEADS = 64
POOL_BLOCKS = 4096  # x 64 = 262144 slots, as bench_sparse_mla.py
BLOCK = 64


def causal_topk(torch, L, topk, g, device):
    """[L, topk] request-local positions: row p a random min(p + 1, topk) of 0..p, -1 after."""
    scores = torch.rand(L, L, generator=g, device=device)
    pos = torch.arange(L, device=device)
    scores = scores.masked_fill(pos[None, :] > pos[:, None], -1.0)
    k = min(topk, L)
    val, idx = scores.topk(k, dim=1)
    idx = torch.where(val >= 0, idx, -1).to(torch.int32)
    if k < topk:
        idx = torch.cat([idx, torch.full((L, topk - k), -1, dtype=torch.int32, device=device)], 1)
    return idx


def build(args, device):
    import torch

    from tools.fp8_ds_mla_codec import quantize_fp8_ds_mla

    g = torch.Generator(device=device).manual_seed(args.seed)
    R, L, H, topk, bs = args.requests, args.prompt_len, args.heads, args.topk, args.block
    nb_req = -(-L // bs)
    pool = max(args.pool_blocks, R * nb_req + 1)
    perm = torch.randperm(pool, generator=g, device=device)[: R * nb_req].to(torch.int32)
    bt = perm.view(R, nb_req).contiguous()
    fp8 = torch.empty(pool, bs, 656, dtype=torch.uint8, device=device)
    bf16 = torch.empty(pool, bs, 576, dtype=torch.bfloat16, device=device)
    step = max(1, 32768 // bs)
    for i in range(0, pool, step):
        x = torch.randn(min(step, pool - i) * bs, 576, generator=g, device=device)
        rows, exact = quantize_fp8_ds_mla(x)
        fp8[i:i + step] = rows.view(-1, bs, 656)
        bf16[i:i + step] = exact.view(-1, bs, 576).to(torch.bfloat16)
    local = torch.cat([causal_topk(torch, L, topk, g, device) for _ in range(R)])
    req_id = torch.arange(R, dtype=torch.int32, device=device).repeat_interleave(L)
    q = (torch.randn(R * L, H, 576, generator=g, device=device) * 0.5).to(torch.bfloat16)
    return dict(bt=bt, fp8=fp8, bf16=bf16, local=local, req_id=req_id, q=q, R=R, L=L, H=H)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=HEADS)
    ap.add_argument("--topk", type=int, default=TOPK)
    ap.add_argument("--block", type=int, default=BLOCK)
    ap.add_argument("--pool-blocks", type=int, default=POOL_BLOCKS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in Triton's interpreter")
    ap.add_argument("--out", default=None, help="markdown report (and .json beside it)")
    add_timing_args(ap, reps=5)
    args = ap.parse_args()
    if args.mma_sync_child:  # the mma.sync GPUs run no Gluon tile: time what they run
        os.environ["DSA_OVERLAY_GLUON"] = "0"
    if args.cpu_smoke:
        import tools.triton_interp  # noqa: F401  (TRITON_INTERPRET=1 before triton is imported)
        tools.triton_interp.numpy24_fix()
        args.requests, args.prompt_len, args.heads, args.topk, args.block, args.pool_blocks = 2, 40, 3, 16, 16, 8
        args.reps, args.replays, args.launch_calls = 1, 1, 1
    mma, mma_note = mma_sync_column(args, __file__)

    import torch

    from overlay import triton_mla_sparse_ops as ops
    from overlay.kernels import sparse_mla as SM
    from overlay.kernels.fp8_workspace import upconvert_blocks

    device = "cpu" if args.cpu_smoke else "cuda"
    s = build(args, device)
    R, L, H = s["R"], s["L"], s["H"]
    scale = 576 ** -0.5
    qsl = torch.arange(R + 1, dtype=torch.int32) * L
    plan = ops.plan_fp8_prefill(qsl, torch.full((R,), L), args.block, capacity_blocks=10 ** 9, device=device,
                                min_query=1)
    assert plan is not None and all(p.ws_blocks for p in plan), "the step must take the workspace"
    qpair = (s["q"][..., :512], s["q"][..., 512:])
    ws = ops.fp8_workspace(plan[0].ws_blocks, args.block, device)[: plan[0].ws_blocks]

    def fwd(cache, fmt, segments=None):
        return lambda: ops.sparse_mla_forward(qpair, cache, s["local"], s["req_id"], s["bt"], args.block, scale, fmt,
                                              segments=segments)

    rows = {
        "fp8 direct": fwd(s["fp8"], "fp8_ds_mla"),
        "fp8 workspace": fwd(s["fp8"], "fp8_ds_mla", plan),
        "up-convert alone": lambda: upconvert_blocks(s["fp8"], s["bt"], 0, plan[0].block_table, ws),
        "bf16 direct": fwd(s["bf16"], "bf16"),
    }
    slots = ops.convert_req_index_to_global(s["req_id"], s["bt"], s["local"], args.block)
    vendor_note = "no FlashMLA (bare image or CPU)"
    if not args.cpu_smoke and not args.mma_sync_child:
        try:
            from bench.bench_sparse_mla import flashmla_call, load_flashmla
            import bench.bench_sparse_mla as B

            F, why = load_flashmla()
            if F is None:
                vendor_note = why
            else:
                rows["FlashMLA bf16 sparse prefill"] = flashmla_call(F, "bf16", s["q"], s["bf16"], slots, scale)
                B.NUM_SLOTS = s["fp8"].shape[0] * args.block  # its fp8 call's cache_seqlens
                rows["FlashMLA fp8 decode kernel, one sequence"] = flashmla_call(F, "fp8_ds_mla", s["q"], s["fp8"],
                                                                                 slots, scale, one_sequence=True)
                vendor_note = "FlashMLA of the vLLM on PYTHONPATH, same process"
        except Exception as e:  # noqa: BLE001
            vendor_note = f"FlashMLA failed: {type(e).__name__}: {str(e)[:120]}"

    # correctness first (poisoned outputs: every path allocates its own; the workspace is poisoned)
    ws.fill_(float("nan"))
    direct, _ = rows["fp8 direct"]()
    via_ws, _ = rows["fp8 workspace"]()
    sample = torch.cat([torch.arange(0, min(8, R * L)), torch.arange(max(0, L - 8), min(L + 8, R * L)),
                        torch.arange(max(0, R * L - 8), R * L)]).to(device)
    ref, _ = SM.sparse_mla_reference(s["q"][sample], s["fp8"], slots[sample], scale, "fp8_ds_mla")

    def rel(a, b):
        a, b = a.float(), b.float()
        return ((a - b).abs().max() / b.abs().max()).item()

    errs = {"workspace vs direct": rel(via_ws, direct), "direct vs float32": rel(direct[sample], ref),
            "workspace vs float32": rel(via_ws[sample], ref), "nan": bool(via_ws.isnan().any() or direct.isnan().any())}
    for name, fn in list(rows.items()):
        if name.startswith("FlashMLA"):
            o = fn()
            errs[name + " vs float32"] = rel(o[sample], ref)

    timer = Timer(device=device, reps=args.reps, replays=args.replays, launch_calls=args.launch_calls)
    times = {}
    for name, fn in rows.items():
        if args.mma_sync_child and name.startswith("FlashMLA"):
            continue
        t = timer.measure(fn, graph=not args.cpu_smoke)
        times[name] = t
        print(f"[fp8_prefill] {name}: {t}", file=sys.stderr, flush=True)
    if args.mma_sync_child:
        write_child_json(args.mma_sync_child, {k: v.graph_us for k, v in times.items()})
        return

    def f(x):
        return "-" if x is None else f"{x:.1f}"

    lines = [f"# fp8_ds_mla prefill step: {R} prompts x {L} tokens, {H} heads, top-k {args.topk} (causal lists), "
             f"block {args.block}, {s['fp8'].shape[0] * args.block} slots",
             "", f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU (interpreter)'}; "
             f"{vendor_note}; {mma_note or 'no mma.sync column'}", "",
             "| path | graph us | eager us | launch us | mma.sync graph us |", "|---|---|---|---|---|"]
    for name, t in times.items():
        lines.append(f"| {name} | {f(t.graph_us) if not t.note else t.note} | {f(t.eager_us)} | {f(t.launch_us)} | "
                     f"{f(mma.get(name))} |")
    lines += ["", "errors (max abs difference / max abs of the second): " + json.dumps(errs)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"times": {k: [v.graph_us, v.eager_us, v.launch_us] for k, v in times.items()}, "mma_sync": mma,
             "errors": errs, "vendor": vendor_note}, indent=1))


if __name__ == "__main__":
    main()

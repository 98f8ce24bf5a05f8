#!/usr/bin/env python3
"""Sparse-MLA attention at small decode batches on sm_90: which tile wins at each (token, 64-head) row count.

choose_config has three sm_90 tiles for 64+ heads: the 16-head latency tile (latency regime: T x ceil(H / 16) <=
sm_count / 8; fp8_ds_mla also at most _LATENCY_MAX_ROWS64 (token, 64-head) rows), the Triton throughput tile, and
the Gluon tile (sparse_mla_sm90.py) from GLUON_MIN_ROWS[format] (token, 64-head group) rows. Decode batches of 1-24
requests are what one user or a few run all day, so this bench times all three at every T of --batches, H in
--heads, both cache formats, each with choose_config's split rule, beside FlashMLA's kernel in the same process
(vLLM's heads-padded call) and reports which tile is fastest per row count, the pick choose_config makes now, and
the smallest row count from which the Gluon tile is fastest at every larger measured count (`suggest_min_rows`: the
value GLUON_MIN_ROWS should hold).

Every tile is timed as the backend calls it (request-local positions through a block table, the conversion inline
or in its own launch as the plan decides) and on slot ids alone. Columns (bench/timing.py): graph us for every
tile; eager and launch us for the pick; the mma.sync build's time of the Triton pick (`--mma-sync`:
DISABLE_MMA_V3=1, own TRITON_CACHE_DIR; the sm_80-sm_120 GPUs have no Gluon tile). A tile whose output is off the
float32 reference by > 2e-2 is shown as an error, never timed. `--cpu-smoke` runs two tiny shapes in Triton's
interpreter (no Gluon there; eager wall times stand in for graph times; numbers meaningless).

    python3 bench/small_batch.py --out $OUT/small_batch.md [--mma-sync]     # ~2 min on an H200
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

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

from bench.timing import Timer, add_timing_args, mma_sync_column, rank_us, write_child_json  # noqa: E402

TILES = ("latency", "triton", "gluon")
ERR_LIMIT = 2e-2


def suggest_min_rows(times: dict[int, dict[str, float | None]]) -> int | None:
    """{rows: {tile: graph us or None}} -> the smallest measured row count from which the Gluon tile is the
    fastest (strictly) at that count and at every larger one; None when it is not fastest at the largest."""
    best = None
    for rows in sorted(times, reverse=True):
        t = times[rows]
        g = t.get("gluon")
        others = [v for k, v in t.items() if k != "gluon" and v is not None]
        if g is None or (others and g >= min(others)):
            break
        best = rows
    return best


def tile_configs(SM, T, H, topk, fmt, sm_count):
    """{tile name: config with choose_config's split rule} for the sm_90 tables (latency, Triton, Gluon)."""
    lat = SM._LATENCY_TUNING[("sm90", fmt)]
    thr = SM._THROUGHPUT_TUNING[("sm90", fmt, 64)]
    glu = SM._GLUON_TUNING.get(("sm90", fmt, 64))
    out = {}
    for name, entry in (("latency", lat), ("triton", thr), ("gluon", glu)):
        if entry is None:
            continue
        s = SM.split_count(T, H, topk, entry.config, entry.programs_per_sm, sm_count)
        out[name] = SM.SparseMLAConfig.from_tile(entry.config.tile, s)
    return out


def fmt_us(x):
    return "-" if x is None else f"{x:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="-")
    ap.add_argument("--formats", default="bf16,fp8_ds_mla")
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--batches", default="1,2,3,4,5,6,7,8,10,12,14,16,20,24,32")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    add_timing_args(ap, reps=20)
    args = ap.parse_args(argv)
    child = args.mma_sync_child is not None

    import torch

    from bench import bench_sparse_mla as B
    from overlay.kernels import sparse_mla as SM

    mma, mma_note = mma_sync_column(args, __file__)
    t0 = time.time()
    if SMOKE:
        from tools.triton_interp import numpy24_fix

        numpy24_fix()
        B.NUM_SLOTS, flush = 1024, 1 << 20
        args.reps, args.replays, args.launch_calls, args.topk = 1, 1, 1, 128
        args.batches, args.heads = "1,2", "64"
        device, cap, sm_count, dev_name, flash, flash_err = "cpu", (9, 0), 132, "CPU (interpreter smoke)", None, "-"
    else:
        device, flush = "cuda", B.FLUSH_BYTES
        props = torch.cuda.get_device_properties(0)
        cap, sm_count, dev_name = (props.major, props.minor), props.multi_processor_count, props.name
        flash, flash_err = (None, "not timed in the mma.sync child") if child else B.load_flashmla()
    B.DEVICE = device
    pools = B.make_pools(args.seed)
    timer = Timer(device, args.reps, args.replays, args.launch_calls, flush_bytes=flush)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    results, child_times = [], {}
    for fmt in args.formats.split(","):
        for H in (int(h) for h in args.heads.split(",")):
            for T in (int(t) for t in args.batches.split(",")):
                label = f"{fmt} T={T} H={H}"
                cache = pools[fmt]
                q = torch.randn(T, H, 576, generator=g, device=device).to(torch.bfloat16)
                idx = torch.randint(0, B.NUM_SLOTS, (T, args.topk), generator=g, device=device, dtype=torch.int32)
                idx[T // 2, ::3] = -1  # a row with invalid entries
                scale = 576 ** -0.5
                # one request whose block table maps position p to slot p: the backend call reads the same rows
                table = torch.arange(B.NUM_SLOTS // B.BLOCK_SIZE, dtype=torch.int32, device=device).view(1, -1)
                req = torch.zeros(T, dtype=torch.int32, device=device)
                out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
                lse = torch.empty(T, H, dtype=torch.float32, device=device)

                def call(cfg):
                    return lambda: SM.sparse_mla_attention(q, cache, idx, scale, fmt, out=out, lse=lse, config=cfg)

                def backend(cfg):  # as TRITON_MLA_SPARSE calls it: (q_nope, q_pe) views, request-local positions
                    return lambda: SM.sparse_mla_attention((q[..., :512], q[..., 512:]), cache, idx, scale, fmt,
                                                           out=out, lse=lse, config=cfg, block_table=table, req_id=req)

                if child:  # mma.sync build: the Triton pick (no Gluon on sm_80-sm_120)
                    pick = SM.choose_config(T, H, args.topk, fmt, sm_count=sm_count, capability=cap, gluon=False)
                    child_times[label] = rank_us(timer.measure(backend(pick), eager=SMOKE, launch=False))
                    continue
                ref, _ = SM.sparse_mla_reference(q, cache, idx, scale, fmt)
                pick = SM.choose_config(T, H, args.topk, fmt, sm_count=sm_count, capability=cap)
                row = {"fmt": fmt, "T": T, "H": H, "rows": SM.rows_of_64_heads(T, H), "pick": str(pick), "tiles": {}, "raw": {},
                       "configs": {}, "errors": {}}
                for name, cfg in tile_configs(SM, T, H, args.topk, fmt, sm_count).items():
                    row["configs"][name] = str(cfg)
                    if cfg.gluon and not SM.GLUON_DEFAULT:
                        row["errors"][name] = "no Gluon here"
                        continue
                    try:  # slot ids, then the backend call: each checked on a poisoned output, then timed
                        for where, make, what in (("raw", call, ""), ("tiles", backend, "backend call ")):
                            out.fill_(float("nan"))
                            make(cfg)()
                            err = B.rel_err(out, ref)
                            if not err < ERR_LIMIT:
                                row["errors"][name] = f"{what}err {err:.1e}"
                                break
                            row[where][name] = rank_us(timer.measure(make(cfg), eager=SMOKE, launch=False))
                    except Exception as e:  # noqa: BLE001 - said in the table
                        row["errors"][name] = f"{type(e).__name__}: {str(e)[:80]}"
                t = timer.measure(backend(pick))
                row["pick_timing"] = [t.graph_us, t.eager_us, t.launch_us]
                row["flashmla"] = None
                if flash is not None:
                    try:
                        run = B.flashmla_call(flash, fmt, q, cache, idx, scale)
                        row["flashmla"] = rank_us(timer.measure(run, eager=False, launch=False))
                    except Exception as e:  # noqa: BLE001
                        row["errors"]["flashmla"] = f"{type(e).__name__}: {str(e)[:80]}"
                row["mma_sync"] = mma.get(label)
                results.append(row)
                print(f"[{time.time() - t0:5.0f}s] {label}: pick {pick} "
                      f"{fmt_us(t.graph_us)} us, tiles {row['tiles']}", file=sys.stderr, flush=True)
    if child:
        write_child_json(args.mma_sync_child, child_times)
        return 0
    lines = [f"# Small decode batches on {dev_name}: latency / Triton / Gluon tile per row count\n",
             f"torch {torch.__version__}; top-k {args.topk}, random slots of a {B.NUM_SLOTS}-slot pool, one row per "
             "batch with every third entry invalid; graph us unless said (bench/timing.py, L2 flushed before "
             f"each call); GLUON_MIN_ROWS in this tree: {SM.GLUON_MIN_ROWS}. {mma_note}\n",
             "Each tile cell: backend call (what TRITON_MLA_SPARSE launches: q as (q_nope, q_pe) views, request-local "
             "positions through a block table; the latency regime's 16/32-head tiles convert them inline, the others "
             "in one small launch first) / the same tile on slot ids alone. fastest, the pick's columns, mma.sync "
             "and vs FlashMLA: backend call.\n",
             "| format | H | T | rows | latency us | Triton us | Gluon us | fastest | pick (choose_config) | "
             "pick graph / eager / launch us | mma.sync us (Triton pick) | FlashMLA us | vs FlashMLA | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    suggestions = {}
    for row in results:
        tl = row["tiles"]
        fastest = min(tl, key=tl.get) if tl else "-"
        g_us = row["pick_timing"][0]
        vs = f"{row['flashmla'] / g_us:.2f}" if row["flashmla"] and g_us else "-"
        notes = "; ".join(f"{k}: {v}" for k, v in row["errors"].items())
        lines.append(f"| {row['fmt']} | {row['H']} | {row['T']} | {row['rows']} | "
                     + " | ".join(f"{fmt_us(tl.get(k))} / {fmt_us(row['raw'].get(k))}" for k in TILES)
                     + f" | {fastest} | {row['pick']} | {' / '.join(fmt_us(x) for x in row['pick_timing'])} | "
                     f"{fmt_us(row['mma_sync'])} | {fmt_us(row['flashmla'])} | {vs} | {notes} |")
        suggestions.setdefault(row["fmt"], {}).setdefault(row["rows"], {})
        for k, v in tl.items():  # the same row count at two head counts: keep the slower (safer) time
            old = suggestions[row["fmt"]][row["rows"]].get(k)
            suggestions[row["fmt"]][row["rows"]][k] = v if old is None else max(old, v)
    lines.append("")
    for fmt, by_rows in suggestions.items():
        lines.append(f"- {fmt}: Gluon fastest from {suggest_min_rows(by_rows)} (token, 64-head) rows up "
                     f"(suggest_min_rows over every measured count)")
    lines.append(f"\nWall time {time.time() - t0:.0f} s.\n")
    text = "\n".join(lines)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The attention kernel's main loop, instruction by instruction, as a GPU family's build emits it: no GPU needed.

Cross-compiles the sparse-MLA forward kernel's heuristic pick (`sparse_mla.choose_config`, the Triton tile: the sm_90
Gluon tiles are left out) for each --cc, cache format, head count and token count, disassembles the cubin with the
nvdisasm Triton ships (`triton.knobs.nvidia.nvdisasm`), finds the main loop (the longest backward branch) and counts
its instructions per KV row: the loop body times the warps of a program over the rows one iteration gathers (block_n),
times the programs that share a row (head groups x value halves). Classes: HMMA (tensor core, mma.sync), conversion
(F2FP / F2F / I2F / F2I / PRMT: the e4m3 decode and the bf16 packing), shared memory (LDS / LDSM / STS / LDGSTS),
local memory (LDL / STL: register spills), everything else.

What it is for: a kernel whose time does not scale like its math is often issue-bound on the instructions around the
MMAs. On the mma.sync build the fp8_ds_mla cache's decode (e4m3 -> bf16, per-tile scales) costs the same per KV row at
any head count while the MMA work grows with the heads; the table shows how much of each loop that is (bench/RESULTS.md,
stop 44). A static count, not a time: it says what each row costs to issue, not how well it overlaps with memory.

    python3 bench/sass_mix.py --cc 89,80 --heads 16,64 --tokens 128 [--out FILE]
    python3 bench/sass_mix.py --cc 89 --heads 16 --formats fp8_ds_mla --tiles h16n32s1w4p2,h16n32s1w4p2f  # + tiles
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests" / "kernels"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

HMMA = ("HMMA", "QMMA")   # tensor core, mma.sync (QMMA: fp8 operands, sm_89 / sm_12x)
CONVERSION = ("F2FP", "F2F", "I2F", "F2I", "PRMT", "I2FP", "F2IP")
SHARED = ("LDS", "LDSM", "STS", "LDGSTS")
LOCAL = ("LDL", "STL")   # register spills

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)\S*\s*([^;]*);")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")


def _loops(sass: str) -> tuple[list[str], list[tuple[int, int]]]:
    """(opcodes, [(first, last) instruction index of each loop]) of nvdisasm -c output: a loop runs from a label to
    the last branch back to it."""
    ins, labels, spans = [], {}, {}
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = _INSN.search(line)
        if m:
            ins.append((m.group(2), m.group(3)))
    for i, (op, args) in enumerate(ins):
        t = re.search(r"\b(L_x_\d+)\b", args) if op == "BRA" else None
        if t and labels.get(t.group(1), i + 1) <= i:
            start = labels[t.group(1)]
            spans[start] = max(spans.get(start, i), i)
    return [op for op, _ in ins], sorted(spans.items())


def main_loop(sass: str) -> collections.Counter:
    """Opcode counts of the longest loop in nvdisasm -c output: from a label to the last branch back to it."""
    ops, spans = _loops(sass)
    if not spans:
        raise ValueError("no loop in this SASS (no branch back to an earlier label)")
    a, b = max(spans, key=lambda s: s[1] - s[0])
    return collections.Counter(ops[a:b + 1])


def mma_loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of every loop that issues MMAs, innermost (shortest) first: a nested walk's inner loop is the
    first, main_loop above is its outer one."""
    ops, spans = _loops(sass)
    loops = [collections.Counter(ops[a:b + 1]) for a, b in sorted(spans, key=lambda s: s[1] - s[0])]
    return [c for c in loops if any(c[o] for o in HMMA)]


def classify(ops: collections.Counter) -> dict:
    """{hmma, conversion, shared, spills, other, total} of a loop's opcode counts."""
    hmma = sum(ops[o] for o in HMMA)
    conv = sum(ops[o] for o in CONVERSION)
    shared = sum(ops[o] for o in SHARED)
    spills = sum(ops[o] for o in LOCAL)
    total = sum(ops.values())
    return dict(hmma=hmma, conversion=conv, shared=shared, spills=spills, other=total - hmma - conv - shared - spills,
                total=total)


def min_hmma_per_row(block_h: int, dv_split: int) -> float:
    """The fewest m16n8k16 MMAs per KV row one program can issue for its block_h heads: scores (576 columns) plus
    its share of P.V (512 / dv_split columns)."""
    return (block_h / 16) * (576 / 16 / 8 + (512 // dv_split) / 8 / 16)


def disassemble(cubin: bytes, cc: int) -> str:
    """nvdisasm -c of a cubin, with the nvdisasm Triton ships; RuntimeError where it cannot read the target."""
    import triton.knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", path], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on the sm_{cc} cubin: {res.stderr.strip()[:300]}")
    return res.stdout


def loop_of(cc: int, fmt: str, tokens: int, heads: int, topk: int = 2048, tile: str | None = None) -> dict:
    """Cross-compile the pick for (tokens, heads, fmt) on sm_<cc> (or `tile`, a config string such as
    'h16n32s1w4p2f') and count its main loop per KV row."""
    from _sparse_mla_args import DIVISIBLE, FLOATS, fwd_pointer_types
    from _xcompile import cross_compile, signature

    from overlay.kernels import sparse_mla as M

    if tile is None:
        cfg = M.choose_config(tokens, heads, topk, fmt, capability=(cc // 10, cc % 10), gluon=False)
    elif (cfg := M.SparseMLAConfig.from_string(tile)).gluon:
        raise SystemExit(f"sass_mix.py: {tile} is a Gluon tile (sm_90 only); give a Triton tile")
    split = cfg.num_splits > 1
    consts = dict(IS_FP8=fmt == "fp8_ds_mla", FP8_NATIVE=cc >= 89, SPLIT=split, DOT_F32=False,
                  BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DV_SPLIT=cfg.dv_split,
                  FP8_POST=bool(cfg.fp8_post_scale) and fmt == "fp8_ds_mla", PAGED=False,
                  PREFETCH=int(cfg.fp8_prefetch) if fmt == "fp8_ds_mla" else 0)
    sig = signature(M._sparse_mla_fwd_kernel, fwd_pointer_types(fmt, split), FLOATS)
    c = cross_compile(M._sparse_mla_fwd_kernel, sig, consts, cc, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      divisible_by_16=DIVISIBLE)
    counts = classify(main_loop(disassemble(c.cubin, cc)))
    programs = -(-heads // cfg.block_h) * cfg.dv_split     # programs that read the same KV row
    per_row = {key: v * cfg.num_warps / cfg.block_n * programs for key, v in counts.items()}
    return dict(cc=cc, fmt=fmt, tokens=tokens, heads=heads, tile=str(cfg), pick=tile is None, warps=cfg.num_warps,
                programs=programs, loop=counts, per_row=per_row,
                min_hmma_per_row=min_hmma_per_row(cfg.block_h, cfg.dv_split) * programs)


def indexer_loop_of(cc: int, kernel: str, heads: int, next_n: int = 1, overrides: dict | None = None) -> dict:
    """Cross-compile the indexer's pick on sm_<cc> (kernel "decode": fp8_paged_mqa_logits' Triton kernel at batch 128,
    ctx 16K; "prefill": fp8_mqa_logits), with `overrides` (config fields) applied, and count its innermost MMA loop
    per key (decode: per key of the T tokens a program scores together; prefill: per key and query token)."""
    import dataclasses

    from _xcompile import cross_compile
    from test_indexer_xcompile import VLLM_BLOCK_SIZE, _signature

    from overlay.kernels import indexer as ix

    cap = (cc // 10, cc % 10)
    if kernel == "decode":
        cfg = ix.decode_config(cap, heads, next_n, 128, 16384, 132, gluon=False)
        fn = ix._paged_mqa_logits_kernel
    else:
        cfg = ix.prefill_config(cap, heads)
        fn = ix._mqa_logits_kernel
    cfg = dataclasses.replace(cfg, **(overrides or {}))
    sig, div = _signature(fn, cfg.DOT_MODE, ix.DOT_FP8)
    consts = dict(cfg.constexprs(), D=ix.HEAD_DIM)
    if kernel == "decode":
        consts["BS"] = VLLM_BLOCK_SIZE if cfg.CONST_BS else 0
    c = cross_compile(fn, sig, consts, cc, num_warps=cfg.num_warps, num_stages=cfg.num_stages, divisible_by_16=div)
    counts = classify(mma_loops(disassemble(c.cubin, cc))[0])
    keys = cfg.BLOCK_N * (cfg.BT if kernel == "prefill" else 1)
    return dict(cc=cc, kernel=kernel, heads=heads, next_n=next_n, overrides=overrides or {},
                cfg={k: v for k, v in dataclasses.asdict(cfg).items() if v is not None}, loop=counts,
                per_key={k: v * cfg.num_warps / keys for k, v in counts.items()}, registers=c.registers,
                spills=c.spills, shared=c.shared)


def indexer_report(rows: list[dict]) -> str:
    lines = ["| sm | kernel | heads x next_n | config (overrides) | warp instructions per key | MMA | conversion | "
             "shared memory | other | registers | spill bytes |", "|" + "---|" * 11]
    for r in rows:
        c, p = r["cfg"], r["per_key"]
        what = (f"BLOCK_N {c['BLOCK_N']}, {c['num_warps']} warps" + (f", T {c['T']}" if "T" in c else f", BT {c['BT']}")
                + (", nested" if c.get("NESTED") else "") + (", K_AHEAD" if c.get("K_AHEAD") else ""))
        over = f" ({', '.join(f'{k}={v}' for k, v in r['overrides'].items())})" if r["overrides"] else " (pick)"
        lines.append(f"| {r['cc']} | {r['kernel']} | {r['heads']} x {r['next_n']} | {what}{over} | {p['total']:.1f} | "
                     f"{p['hmma']:.1f} | {p['conversion']:.1f} | {p['shared']:.1f} | {p['other']:.1f} | "
                     f"{r['registers']} | {r['spills']} |")
    return "\n".join(lines) + "\n"


def report(rows: list[dict]) -> str:
    lines = ["| sm | heads x tokens | cache | tile | warp instructions per KV row | HMMA (fewest possible) | "
             "conversion | shared memory | spills | other | fp8 / bf16 (all) |", "|" + "---|" * 11]
    by = {(r["cc"], r["heads"], r["tokens"], r["fmt"]): r for r in rows if r.get("pick", True)}
    for r in rows:
        bf = by.get((r["cc"], r["heads"], r["tokens"], "bf16"))
        ratio = f"{r['per_row']['total'] / bf['per_row']['total']:.2f}x" if bf and r["fmt"] != "bf16" else ""
        p, tag = r["per_row"], " (pick)" if r.get("pick", True) else ""
        lines.append(f"| {r['cc']} | {r['heads']} x {r['tokens']} | {r['fmt']} | {r['tile']}{tag} | {p['total']:.0f} | "
                     f"{p['hmma']:.1f} ({r['min_hmma_per_row']:.1f}) | {p['conversion']:.1f} | {p['shared']:.1f} | "
                     f"{p['spills']:.1f} | {p['other']:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="89,80", help="compute capabilities, e.g. 80,86,89,120 (default: %(default)s)")
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--formats", default="bf16,fp8_ds_mla")
    ap.add_argument("--tiles", default=None,
                    help="comma-separated config strings (e.g. h16n32s1w4p2f) to count besides each pick")
    ap.add_argument("--out", default=None, help="markdown file (default: stdout); a .json beside it")
    ap.add_argument("--indexer", choices=("decode", "prefill"), default=None,
                    help="count the indexer kernel's innermost MMA loop instead (its pick per --cc x --heads x "
                         "--next-n, then each --variants override)")
    ap.add_argument("--next-n", default="1", help="--indexer decode: query tokens per request, e.g. 1,2")
    ap.add_argument("--variants", default=None,
                    help="--indexer: JSON list of config overrides counted beside each pick, e.g. "
                         "'[{\"K_AHEAD\": false, \"num_warps\": 8}]'")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("sass_mix.py compiles for real targets: run it without TRITON_INTERPRET")
    rows = []
    if args.indexer:
        variants = [None] + (json.loads(args.variants) if args.variants else [])
        next_ns = [int(n) for n in args.next_n.split(",")] if args.indexer == "decode" else [1]
        for cc in (int(c) for c in args.cc.split(",")):
            for heads in (int(h) for h in args.heads.split(",")):
                for nn in next_ns:
                    for over in variants:
                        rows.append(indexer_loop_of(cc, args.indexer, heads, nn, over))
                        r = rows[-1]
                        print(f"sm_{cc} indexer {args.indexer} {heads} heads x {nn}: {r['cfg']}, {over or 'pick'}: "
                              f"{r['per_key']['total']:.1f} warp instructions per key", file=sys.stderr, flush=True)
        return _write(indexer_report(rows), rows, args.out)
    for cc in (int(c) for c in args.cc.split(",")):
        for heads in (int(h) for h in args.heads.split(",")):
            for fmt in args.formats.split(","):
                for tile in [None] + (args.tiles.split(",") if args.tiles else []):
                    rows.append(loop_of(cc, fmt, args.tokens, heads, tile=tile))
                    r = rows[-1]
                    print(f"sm_{cc} {heads} heads x {args.tokens} {fmt}: {r['tile']}{'' if tile else ' (pick)'}, "
                          f"{r['per_row']['total']:.0f} warp instructions per KV row", file=sys.stderr, flush=True)
    return _write(report(rows), rows, args.out)


def _write(text: str, rows: list[dict], out: str | None) -> int:
    """The markdown report to `out` with the rows as JSON beside it, or to stdout."""
    if out:
        Path(out).write_text(text)
        Path(out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

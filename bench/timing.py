"""One way to time a kernel call, for every kernel bench in bench/ (bench_sparse_mla.py, bench_indexer.py).

Three numbers per call, each a column of the benches' tables:

graph   GPU time per call by CUDA-graph replay: what a step under vLLM's CUDA graphs pays (decode).
        R (flush, call) pairs are captured in one graph and R flushes alone in another; per call =
        (median replay time of the first - median replay time of the second) / R.
eager   one plain call, no graph: flush, synchronize, CUDA event, call, CUDA event, synchronize; the
        median over the repetitions. The events see the stream from before the launch to after the
        last kernel, so this is host launch work plus GPU time as an idle GPU sees one call: what vLLM
        pays where attention runs outside its graphs (prefill, mixed batches, batches beyond the
        capture sizes).
launch  host time to launch one call: wall time of N back-to-back calls with no flush and no sync
        between them (one synchronize before the first), divided by N. A launcher that synchronises
        (a `.item()`, a host copy) shows it here.

L2 policy, the same for both benches: every timed call of the graph and eager columns follows a write of
FLUSH_BYTES (256 MiB; the H200's L2 is 50 MB), so each call reads its operands from HBM as a layer of a
real model does. In the graph column the flush is inside the graph and subtracted, rather than done
outside a one-call graph: one replay per call would put the graph launch gap (microseconds) into every
call, R calls per replay amortise it, and the flush-only graph removes the flush exactly as it was
added. The launch column does not flush (a flush would add its own launch).

On a CPU (the benches' --cpu-smoke, Triton's interpreter) there is no graph column; eager and launch
are wall times. Those numbers mean nothing; the path checks the scripts.

The mma.sync column: `--mma-sync` makes a bench re-run itself in a child process with DISABLE_MMA_V3=1
and a fresh TRITON_CACHE_DIR (Triton on sm_90 then emits mma.sync, not wgmma: the closest measure
available on the H200 of the code sm_80/86/89/120 run), time only our kernel's default config there
(graph column) and merge those times into its own tables (`run_mma_sync_child`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

FLUSH_BYTES = 256 << 20
MMA_SYNC_ENV = {"DISABLE_MMA_V3": "1"}


@dataclass(frozen=True)
class Timing:
    """Microseconds per call; None where a column was not measured (`note` says why when it failed)."""

    graph_us: float | None = None
    eager_us: float | None = None
    launch_us: float | None = None
    note: str = ""

    def cells(self, fmt: Callable[[float | None], str]) -> list[str]:
        """[graph, eager, launch] formatted by `fmt` (which renders None as the table's blank); a graph
        column that failed shows why."""
        graph = self.note if self.graph_us is None and self.note else fmt(self.graph_us)
        return [graph, fmt(self.eager_us), fmt(self.launch_us)]


def rank_us(t: Timing) -> float | None:
    """The time configs are ranked and vendors compared by: graph (eager where there is no graph column:
    a CPU, or a call that could not be captured)."""
    return t.graph_us if t.graph_us is not None else t.eager_us


def per_call_us(with_calls_ms: list[float], flush_only_ms: list[float], calls: int) -> float:
    """Graph column arithmetic: (median replay of R (flush, call) pairs - median replay of R flushes)
    / R, in microseconds, never below 0 (a call faster than the replay noise)."""
    if calls < 1 or not with_calls_ms or not flush_only_ms:
        raise ValueError("per_call_us needs replay times of both graphs and calls >= 1")
    return max(0.0, (statistics.median(with_calls_ms) - statistics.median(flush_only_ms)) * 1e3 / calls)


def launch_us_per_call(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    """Launch column arithmetic: wall time (clock, seconds) of `calls` back-to-back calls / calls, in us."""
    if calls < 1:
        raise ValueError("launch_us_per_call needs calls >= 1")
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls * 1e6


class Timer:
    """graph / eager / launch times of zero-argument callables on `device` ("cuda" or "cpu").

    reps: calls per graph and eager repetitions; replays: graph replays (median); launch_calls: N of
    the launch column. `clock` is the host clock (seconds) of the launch column and of CPU timings."""

    def __init__(self, device: str = "cuda", reps: int = 20, replays: int = 5, launch_calls: int = 50,
                 flush_bytes: int = FLUSH_BYTES, clock: Callable[[], float] = time.perf_counter):
        import torch

        self.torch = torch
        self.cuda = device != "cpu"
        self.reps, self.replays, self.launch_calls, self.clock = reps, replays, launch_calls, clock
        self.flush_buf = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if self.cuda else None
        self._flush_ms: dict[int, list[float]] = {}

    # -------------------------------------------------------------------------------------- pieces
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def flush(self) -> None:
        if self.cuda:
            self.flush_buf.fill_(1)

    def _capture(self, fn, reps: int):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up on the capture stream (allocator pools, lazy inits)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                self.flush()
                fn()
        return g

    def _replays_ms(self, g) -> list[float]:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.replays):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    def _flush_only_ms(self, reps: int) -> list[float]:
        if reps not in self._flush_ms:
            g = self._capture(lambda: None, reps)
            self._flush_ms[reps] = self._replays_ms(g)
            del g
        return self._flush_ms[reps]

    # ------------------------------------------------------------------------------------- columns
    def graph_us(self, fn, reps: int | None = None) -> float:
        """GPU time per call by CUDA-graph replay (see the module docstring). Raises on a CPU and
        when `fn` cannot be captured."""
        if not self.cuda:
            raise RuntimeError("no CUDA graphs on a CPU")
        reps = reps or self.reps
        g = self._capture(fn, reps)
        try:
            return per_call_us(self._replays_ms(g), self._flush_only_ms(reps), reps)
        finally:
            del g

    def eager_us(self, fn, reps: int | None = None) -> float:
        """Median time of one plain call after a flush (CUDA events; wall clock on a CPU)."""
        reps = reps or self.reps
        times = []
        if not self.cuda:
            for _ in range(reps):
                times.append(launch_us_per_call(fn, 1, self.clock))
            return statistics.median(times)
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            self.flush()
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def launch_us(self, fn, calls: int | None = None) -> float:
        """Host wall time per call of `calls` back-to-back calls, no sync between them."""
        self.sync()
        us = launch_us_per_call(fn, calls or self.launch_calls, self.clock)
        self.sync()
        return us

    def measure(self, fn, reps: int | None = None, *, graph: bool = True, eager: bool = True,
                launch: bool = True) -> Timing:
        """The chosen columns for one callable, after one warm-up call. A graph capture that fails
        leaves that column None with the reason in `note`; other failures raise."""
        fn()
        self.sync()
        g_us, note = None, ""
        if graph and self.cuda:
            try:
                g_us = self.graph_us(fn, reps)
            except Exception as e:  # noqa: BLE001 - not capturable: said in the table
                note = f"not capturable ({type(e).__name__})"
                self.torch.cuda.synchronize()
        e_us = self.eager_us(fn, reps) if eager else None
        l_us = self.launch_us(fn) if launch else None
        return Timing(g_us, e_us, l_us, note)


# ---------------------------------------------------------------------------------- mma.sync child


def add_timing_args(ap, reps: int) -> None:
    """The timing options every kernel bench takes (argparse parser `ap`)."""
    ap.add_argument("--reps", type=int, default=reps,
                    help="(flush, call) pairs per CUDA graph; eager repetitions")
    ap.add_argument("--replays", type=int, default=5, help="graph replays (median)")
    ap.add_argument("--launch-calls", type=int, default=50, help="back-to-back calls of the launch column")
    ap.add_argument("--mma-sync", action="store_true",
                    help="add a column with our kernel built for mma.sync (this script re-run in a child "
                         "process with DISABLE_MMA_V3=1 and its own TRITON_CACHE_DIR; bench/timing.py)")
    ap.add_argument("--mma-sync-child", default=None, help=argparse.SUPPRESS)


def mma_sync_column(args, script: str) -> tuple[dict, str]:
    """With --mma-sync: run the child (run_mma_sync_child) before the bench's own timings, so both do
    not share the GPU. -> ({case label: us}, note); ({}, "") without --mma-sync."""
    if not args.mma_sync:
        return {}, ""
    t0 = time.time()
    times, note = run_mma_sync_child(os.path.abspath(script), sys.argv[1:], timeout_s=400)
    note += f", {time.time() - t0:.0f} s"
    print(f"[mma.sync] {note}", file=sys.stderr, flush=True)
    return times, note


def child_argv(argv: list[str], json_path: str) -> list[str]:
    """The bench's own arguments for its mma.sync child: without --mma-sync and --out (the child
    writes no report), with --mma-sync-child JSON_PATH."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--mma-sync" or a.startswith("--out="):
            continue
        if a == "--out":
            skip = True
            continue
        out.append(a)
    return out + ["--mma-sync-child", json_path]


def run_mma_sync_child(script: str, argv: list[str], timeout_s: float) -> tuple[dict, str]:
    """Run `script` again in a child process built for mma.sync (DISABLE_MMA_V3=1, its own empty
    TRITON_CACHE_DIR, so no wgmma binary of the parent's cache is reused). -> ({case label: graph us of
    our default config}, a note for the report: how it ran or why it failed)."""
    with tempfile.TemporaryDirectory(prefix="dsa_mma_sync_") as tmp:
        json_path = os.path.join(tmp, "mma_sync.json")
        env = dict(os.environ, **MMA_SYNC_ENV, TRITON_CACHE_DIR=os.path.join(tmp, "triton_cache"))
        cmd = [sys.executable, script, *child_argv(argv, json_path)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {}, f"mma.sync child timed out after {timeout_s:.0f} s"
        if proc.returncode != 0 or not os.path.exists(json_path):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            return {}, f"mma.sync child failed (exit {proc.returncode}): {tail[0][:160]}"
        with open(json_path) as f:
            times = json.load(f)
        return times, (f"mma.sync column: the same script re-run with DISABLE_MMA_V3=1 and its own "
                       f"TRITON_CACHE_DIR, our default config, graph time ({len(times)} cases)")


def write_child_json(path: str, times: dict) -> None:
    """The child's half of run_mma_sync_child: {case label: graph us} as JSON."""
    with open(path, "w") as f:
        json.dump(times, f)

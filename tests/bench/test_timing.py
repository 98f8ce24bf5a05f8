"""bench/timing.py: the arithmetic of the three columns, the CPU path, the mma.sync child; the CUDA path
on a GPU (`gpu` marker)."""

import json
import os
import sys

import pytest
import torch

from bench import timing as T


class FakeClock:
    """Host clock in seconds that only moves when a fake call says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def costly(clock, costs_us):
    """A call that advances `clock` by the next of `costs_us` (cycling) and counts its calls."""
    state = {"calls": 0}

    def fn():
        clock.now += costs_us[state["calls"] % len(costs_us)] * 1e-6
        state["calls"] += 1

    return fn, state


def test_per_call_us_subtracts_the_flush_graph_and_divides_by_the_calls():
    # medians 11.0 and 4.5 ms over 20 calls: (11.0 - 4.5) ms / 20 = 325 us
    assert T.per_call_us([10.0, 12.0, 11.0], [4.0, 5.0, 4.5], 20) == pytest.approx(325.0)
    # one outlier replay does not move a median of five
    assert T.per_call_us([2.0, 2.0, 2.0, 2.0, 90.0], [1.0] * 5, 4) == pytest.approx(250.0)
    # a call faster than the replay noise reads 0, never negative
    assert T.per_call_us([4.0], [4.2], 10) == 0.0
    with pytest.raises(ValueError):
        T.per_call_us([1.0], [0.5], 0)
    with pytest.raises(ValueError):
        T.per_call_us([], [0.5], 3)


def test_launch_us_is_the_wall_time_of_back_to_back_calls_over_their_number():
    clock = FakeClock()
    fn, state = costly(clock, [5.0, 9.0])
    assert T.launch_us_per_call(fn, 10, clock) == pytest.approx(7.0)
    assert state["calls"] == 10
    with pytest.raises(ValueError):
        T.launch_us_per_call(fn, 0, clock)


def test_cpu_timer_has_no_graph_column_and_times_eager_and_launch_by_the_host_clock():
    clock = FakeClock()
    # warm-up 50 us, then eager calls 3, 400, 5 (median 5), then launch calls 8, 8, 8, 8
    fn, state = costly(clock, [50.0, 3.0, 400.0, 5.0, 8.0, 8.0, 8.0, 8.0])
    t = T.Timer("cpu", reps=3, launch_calls=4, clock=clock).measure(fn)
    assert t.graph_us is None and t.note == ""
    assert t.eager_us == pytest.approx(5.0)
    assert t.launch_us == pytest.approx(8.0)
    assert state["calls"] == 1 + 3 + 4
    with pytest.raises(RuntimeError):
        T.Timer("cpu").graph_us(fn)
    only = T.Timer("cpu", reps=2, clock=clock).measure(fn, eager=False, launch=False)
    assert only == T.Timing()


def test_cells_and_rank_follow_the_graph_column_and_say_why_it_is_missing():
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    assert T.Timing(12.34, 70.0, 40.0).cells(fmt) == ["12.3", "70.0", "40.0"]
    assert T.Timing(None, 70.0, None, "not capturable (RuntimeError)").cells(fmt) == [
        "not capturable (RuntimeError)", "70.0", "-"]
    assert T.rank_us(T.Timing(12.0, 70.0)) == 12.0
    assert T.rank_us(T.Timing(None, 70.0)) == 70.0
    assert T.rank_us(T.Timing()) is None


def test_child_argv_drops_the_switch_and_the_report_path():
    argv = ["--focus", "--mma-sync", "--out", "r.md", "--reps", "3", "--out=x.md", "--formats", "bf16"]
    assert T.child_argv(argv, "/tmp/j.json") == ["--focus", "--reps", "3", "--formats", "bf16",
                                                 "--mma-sync-child", "/tmp/j.json"]


CHILD = r'''
import json, os, sys
args = sys.argv[1:]
if "--fail" in args:
    print("first line"); print("boom: the last line", file=sys.stderr); sys.exit(3)
path = args[args.index("--mma-sync-child") + 1]
json.dump({"env": os.environ.get("DISABLE_MMA_V3"), "cache": os.environ.get("TRITON_CACHE_DIR"),
           "args": args}, open(path, "w"))
'''


def test_mma_sync_child_runs_with_its_own_build_env_and_returns_its_json(tmp_path, monkeypatch):
    script = tmp_path / "bench_x.py"
    script.write_text(CHILD)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "parent_cache"))
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    got, note = T.run_mma_sync_child(str(script), ["--focus", "--mma-sync", "--out", "r.md"], 60)
    assert got["env"] == "1"
    assert got["cache"] and got["cache"] != str(tmp_path / "parent_cache")
    assert got["args"][:1] == ["--focus"] and "--out" not in got["args"] and "--mma-sync" not in got["args"]
    assert "DISABLE_MMA_V3=1" in note
    assert os.environ.get("DISABLE_MMA_V3") is None            # the parent's build is untouched
    got, note = T.run_mma_sync_child(str(script), ["--fail"], 60)
    assert got == {} and "exit 3" in note and "boom: the last line" in note


def test_write_child_json_round_trips(tmp_path):
    T.write_child_json(str(tmp_path / "c.json"), {"bf16 T=1 H=64": 12.5})
    assert json.loads((tmp_path / "c.json").read_text()) == {"bf16 T=1 H=64": 12.5}


@pytest.mark.gpu
def test_cuda_columns_on_a_copy_kernel():
    """A 256 MiB device copy: graph time near bytes / bandwidth, eager at least the GPU time, and the
    host launch of one copy far below its GPU time."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").fill_(3)
    dst = torch.empty_like(src)
    t = T.Timer("cuda", reps=5, replays=3, launch_calls=20).measure(lambda: dst.copy_(src))
    assert t.note == "" and t.graph_us is not None
    assert 20.0 < t.graph_us < 5000.0            # 512 MiB moved at 0.1-25 TB/s
    assert t.eager_us >= 0.8 * t.graph_us
    assert t.launch_us < t.graph_us
    assert torch.equal(dst[:16].cpu(), torch.full((16,), 3, dtype=torch.uint8))

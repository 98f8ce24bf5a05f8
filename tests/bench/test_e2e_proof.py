"""The end-to-end proof's pure logic (bench/e2e/: plan, judge, report, run orchestration) on CPU, and
--rejudge of the stored H200 runs in bench/results/."""

import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench.e2e import judge as J
from bench.e2e import plan as P
from bench.e2e import report as R
from bench.e2e import run as RUN

REPO = Path(__file__).resolve().parents[2]
STORED = [REPO / "bench" / "results" / "h200-e2e_proof-run2.json.gz",
          REPO / "bench" / "results" / "h200-e2e_proof-run3-odd-fp8.json.gz"]


def _dump(path, calls):
    torch.save(calls, path)
    return str(path)


def test_compare_dumps_splits_layers_and_positions(tmp_path):
    g = torch.Generator().manual_seed(0)
    topk = 4
    out = torch.randn(3, 2, 512, generator=g).to(torch.bfloat16)
    # token 0: 2 valid (pos < topk); tokens 1, 2: full rows (pos >= topk)
    idx = torch.tensor([[0, 1, -1, -1], [5, 2, 7, 1], [3, 4, 8, 9]], dtype=torch.int32)
    ref = [{"layer": "l0", "topk": idx, "out": out}, {"layer": "l1", "topk": idx, "out": out}]
    cand_idx = idx.clone()
    cand_idx[2, 0] = 6                      # layer 1, token 2: one different position
    cand_out = out.clone()
    cand_out[1] = cand_out[1] * 1.5          # layer 1, token 1: wrong output
    cand = [{"layer": "l0", "topk": idx[:, [1, 0, 2, 3]], "out": out},   # order does not matter
            {"layer": "l1", "topk": cand_idx, "out": cand_out}]
    d = J.compare_dumps(_dump(tmp_path / "c.pt", cand), _dump(tmp_path / "r.pt", ref), topk)
    rows = {(r["layer"], r["span"]): r for r in d["rows"]}
    assert rows["l0", "pos<topk"]["same_set"] == 1.0 and rows["l0", "pos>=topk"]["err_max"] == 0
    assert rows["l1", "pos>=topk"]["same_set"] == 0.5
    assert abs(rows["l1", "pos>=topk"]["overlap"] - 0.875) < 1e-9
    assert abs(rows["l1", "pos>=topk"]["err_max"] - 0.5) < 1e-2
    short = J.compare_dumps(_dump(tmp_path / "s.pt", cand[:1]), str(tmp_path / "r.pt"), topk)
    assert "schedules differ" in short["error"]


def test_compare_dumps_matches_tokens_by_kv_slot_whatever_each_engine_ordered_its_batch(tmp_path):
    g = torch.Generator().manual_seed(1)
    topk = 4
    out = torch.randn(5, 2, 512, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 50, (5, topk), generator=g, dtype=torch.int32)
    slots = torch.tensor([130, 7, 64, 65, 8])
    ref = [{"layer": "l0", "topk": idx, "out": out, "slots": slots}]
    perm = [3, 0, 4, 1, 2]                       # the candidate ran the same tokens in another order
    cand = [{"layer": "l0", "topk": idx[perm], "out": out[perm].clone(), "slots": slots[perm]}]
    d = J.compare_dumps(_dump(tmp_path / "c.pt", cand), _dump(tmp_path / "r.pt", ref), topk)
    assert d["rows"][0]["same_set"] == 1.0 and d["rows"][0]["err_max"] == 0
    # row order alone (the old matching) would have compared other tokens
    plain = [{k: v for k, v in c.items() if k != "slots"} for c in cand]
    d = J.compare_dumps(_dump(tmp_path / "p.pt", plain), str(tmp_path / "r.pt"), topk)
    assert d["rows"][0]["same_set"] < 1.0 and d["rows"][0]["err_max"] > 0.5
    # a wrong output on one token is seen on that token only
    cand[0]["out"][0] *= 2.0                     # slot 65
    d = J.compare_dumps(_dump(tmp_path / "w.pt", cand), str(tmp_path / "r.pt"), topk)
    assert abs(d["rows"][0]["err_max"] - 1.0) < 1e-2 and d["rows"][0]["err_median"] == 0
    # other tokens in one run: not compared
    other = [dict(cand[0], slots=torch.tensor([65, 130, 9, 7, 64]))]
    d = J.compare_dumps(_dump(tmp_path / "o.pt", other), str(tmp_path / "r.pt"), topk)
    assert "tokens differ" in d["error"]


def test_backends_a_release_does_not_have_are_found_in_its_registry_file():
    """FLASH_ATTN_MLA_SPARSE is new in vLLM 0.25.0: on 0.20.0 the informative second-upstream run failed at
    engine start (H200); the proof now marks it absent from the release's own registry file."""
    import os

    from tools import patchset
    names = {"FLASHMLA_SPARSE", "FLASH_ATTN_MLA_SPARSE"}
    old, new = patchset.fetch("0.20.0", quiet=True), patchset.fetch("0.26.0", quiet=True)
    assert RUN.backends_absent(os.pathsep.join(["/nonexistent", str(old)]), names) == {"FLASH_ATTN_MLA_SPARSE"}
    assert RUN.backends_absent(str(new), names) == set()
    assert RUN.backends_absent("/nonexistent", names) == set()


def test_run_names_are_derived_from_their_fields_and_every_plan_is_consistent():
    assert P.Run("glm5", "upstream").name == "glm5/upstream/bf16/eager"
    assert P.Run("glm5", "upstream", chunk=512).name == "glm5/upstream/bf16/eager/c512"
    assert P.Run("odd", "triton", "fp8_ds_mla", graphs=True, tps=True).name == "odd/triton/fp8_ds_mla/graphs"
    for name, plan in P.PLANS.items():
        assert P.plan_errors(plan) == [], name
        assert all(r.path in P.PATHS and r.model in P.MODELS for r in plan.runs)
    # the stored 0.23.0 proof's names, which its JSON results are keyed by
    assert [r.name for r in P.PLANS["h200-0.23"].runs] == [
        "glm5/upstream/bf16/eager", "glm5/triton/bf16/eager", "glm5/upstream/bf16/eager/c512",
        "glm5/upstream/fp8_ds_mla/eager", "glm5/triton/fp8_ds_mla/eager", "odd/triton/bf16/eager",
        "odd/triton/bf16/graphs", "odd/triton/fp8_ds_mla/graphs", "glm5/upstream/bf16/graphs",
        "glm5/triton/bf16/graphs", "glm5/upstream/fp8_ds_mla/graphs", "glm5/triton/fp8_ds_mla/graphs"]


def test_the_h200_plan_orders_runs_so_a_budget_cut_leaves_whole_verdicts():
    """Each checked comparison needs its candidate, its reference and its floors' runs; all of them
    come at most one run after the candidate (the 512-chunk floor right behind it), and the first
    verdicts are the bf16 eager ones of the three safetensors models."""
    plan = P.PLANS["h200"]
    pos = {r.name: i for i, r in enumerate(plan.runs)}
    comps = {c: r for c, r, _ in plan.comparisons}
    for cand, key in plan.must_match.items():
        need = {cand, comps[cand]} | {n for f in plan.floors[key] for n in (f, comps[f])}
        assert max(pos[n] for n in need) <= pos[cand] + 1, cand
    first = [c for c in sorted(plan.must_match, key=pos.get)][:3]
    assert first == ["glm5/triton/bf16/eager", "dsv32/triton/bf16/eager", "glm52/triton/bf16/eager"]
    # the shapes the issue asks for
    dsv32, glm52 = P.MODELS["dsv32"], P.MODELS["glm52"]
    assert (dsv32.config["index_n_heads"], dsv32.config["index_topk"], dsv32.config["qk_nope_head_dim"],
            dsv32.config["v_head_dim"], dsv32.json["model_type"]) == (64, 2048, 128, 128, "deepseek_v32")
    assert min(dsv32.prompt_lens) > 2048 and max(dsv32.prompt_lens) + P.GREEDY_STEPS <= dsv32.max_model_len
    assert glm52.json["index_topk_freq"] > 1
    kinds = {(r.model, r.kv, r.graphs) for r in plan.runs if r.path == "triton"}
    assert {("glm5", "auto", True), ("glm5", "fp8_ds_mla", True), ("glm5", "fp8_ds_mla", False),
            ("gguf_q4_k_m", "auto", False), ("gguf_q8_0", "auto", False)} <= kinds
    assert any(r.path == "upstream_fa" for r in plan.runs)


def _glm52_skips(layer, freq=2, offset=1):
    """vLLM 0.26.0 deepseek_v2.py's rule (index_topk_pattern unset): does `layer` reuse the top-k?"""
    return max(layer - offset + 1, 0) % freq != 0


def test_the_glm52_model_has_layers_without_an_indexer_under_vllms_rule():
    m = P.MODELS["glm52"]
    layers = range(m.config["num_hidden_layers"])
    skips = [_glm52_skips(i, m.json["index_topk_freq"], m.json["index_skip_topk_offset"]) for i in layers]
    assert skips == [False, True, False, True]


def test_estimates_follow_the_stored_h200_logs():
    """plan.estimate_s against the wall times of the stored 0.23.0 runs (4 engines at once there,
    alone here: the estimate must not be below what an engine took in the stored logs' median)."""
    data = R.merge_runs(R.load_parts([str(p) for p in STORED]))
    by_name = {r.name: r for r in P.PLANS["h200-0.23"].runs}
    for name, r in data["runs"].items():
        if "wall_s" in r and "error" not in r:
            run = by_name[name]
            assert P.estimate_s(run) >= 0.8 * r["wall_s"] or run.graphs, (name, r["wall_s"])
    assert P.estimate_s(P.Run("dsv32", "triton")) > P.estimate_s(P.Run("glm5", "triton"))
    assert P.estimate_s(P.Run("glm5", "triton", graphs=True, tps=True)) > P.estimate_s(
        P.Run("glm5", "triton", graphs=True))


def test_kernels_ok_per_path():
    r = {"vendor_calls": {"flashmla.flash_mla_sparse_fwd": 3, "deep_gemm.fp8_fp4_mqa_logits": 2,
                          "deep_gemm.get_paged_mqa_logits_metadata": 1},
         "triton_calls": {"sparse_mla.sparse_mla_attention": 0, "indexer.fp8_fp4_mqa_logits": 0}}
    assert J.kernels_ok("upstream", r) and not J.kernels_ok("triton", r)
    mix = {"vendor_calls": {"flashmla.flash_mla_sparse_fwd": 0, "deep_gemm.fp8_fp4_mqa_logits": 2,
                            "deep_gemm.get_paged_mqa_logits_metadata": 1},
           "triton_calls": {"sparse_mla.sparse_mla_attention": 4, "indexer.fp8_fp4_mqa_logits": 0}}
    assert J.kernels_ok("attn_triton", mix) and not J.kernels_ok("idx_triton", mix)
    # the Triton path's decode builder may still be counted calling DeepGEMM's metadata: never
    tri = {"vendor_calls": {"deep_gemm.get_paged_mqa_logits_metadata": 1},
           "triton_calls": {"sparse_mla.sparse_mla_attention": 4, "indexer.fp8_fp4_mqa_logits": 2}}
    assert not J.kernels_ok("triton", tri)
    fa = {"vendor_calls": {"flashattn_mla_sparse.flash_attn_varlen_func": 4,
                           "deep_gemm.fp8_fp4_mqa_logits": 2, "flashmla.flash_mla_sparse_fwd": 0},
          "triton_calls": {"sparse_mla.sparse_mla_attention": 0, "indexer.fp8_fp4_mqa_logits": 0}}
    assert J.kernels_ok("upstream_fa", fa) and not J.kernels_ok("upstream", fa)
    # the profiler census: a vendor kernel on the Triton path fails it; upstream must show some
    clean = {"vendor_calls": {}, "triton_calls": tri["triton_calls"]}
    assert J.kernels_ok("triton", dict(clean, census={"vendor": {}}))
    assert not J.kernels_ok("triton", dict(clean, census={"vendor": {"deep_gemm::sm90_fp8_mqa_logits": 1}}))
    assert not J.kernels_ok("upstream", dict(r, census={"vendor": {}}))        # census blind
    assert J.kernels_ok("upstream", dict(r, census={"vendor": {"flash_fwd_splitkv_mla_kernel": 2}}))


def test_vendor_kernel_names_and_the_overlays_triton_kernels():
    for ours in P.TRITON_KERNEL_NAMES:
        assert not P.vendor_kernel(ours)
    assert not P.vendor_kernel("_sparse_mla_combine_kernel_0d1d2d")
    assert P.vendor_kernel("void deep_gemm::sm90_fp8_paged_mqa_logits<64u, 128u>(...)")
    assert P.vendor_kernel("void flash::flash_fwd_splitkv_mla_kernel<...>")
    assert not P.vendor_kernel("void at::native::vectorized_elementwise_kernel<4, ...>")
    # source of the names: the overlay's jit functions
    src = (REPO / "overlay" / "kernels" / "indexer.py").read_text() + (
        REPO / "overlay" / "kernels" / "sparse_mla.py").read_text()
    for ours in P.TRITON_KERNEL_NAMES:
        assert f"@triton.jit\ndef {ours}(" in src


def test_run_all_order_parallelism_and_memory_race_retry(monkeypatch):
    """Shared runs start `parallel` at a time with a small memory share; tok/s runs run alone with
    0.5; a run that lost a memory race is retried alone."""
    started, live, peak = [], [0], [0]
    tried = {}

    class Proc:
        def __init__(self, spec):
            self.spec = spec
            live[0] += 1
            peak[0] = max(peak[0], live[0])

    def start(spec, pp):
        started.append((spec["name"], spec["mem"], live[0]))
        return Proc(spec)

    def finish(proc, t0, timeout):
        live[0] -= 1
        name = proc.spec["name"]
        tried[name] = tried.get(name, 0) + 1
        if name == "b/triton/bf16/eager" and tried[name] == 1:
            return {"error": "exit 1", "log": "Error in memory profiling. Initial free memory"}
        return {"tokens": [], "wall_s": 1.0}

    monkeypatch.setattr(RUN, "start_worker", start)
    monkeypatch.setattr(RUN, "finish_worker", finish)
    monkeypatch.setattr(RUN.time, "sleep", lambda s: None)
    monkeypatch.setattr(RUN, "estimate_s", lambda run: 1.0)
    runs = [P.Run(m, "triton") for m in "abc"] + [P.Run("t", "upstream", graphs=True, tps=True)]
    seen = []
    res = RUN.run_all(runs, lambda run, mem: {"name": run.name, "mem": mem}, lambda run: "",
                      RUN.time.perf_counter(), parallel=2, on_result=lambda r: seen.append(len(r)))
    assert [s[0][0] for s in started] == ["a", "b", "c", "t", "b"]
    assert peak[0] == 2
    assert [s[1] for s in started] == [0.4, 0.4, 0.4, 0.5, 0.5]
    assert started[3][2] == 0 and started[4][2] == 0          # alone on the GPU
    assert all("error" not in r for r in res.values())
    assert seen == [1, 2, 3, 4, 4]                             # results written after every run


def test_run_all_stops_at_the_first_run_that_does_not_fit_and_keeps_resumed_results(monkeypatch):
    started = []
    monkeypatch.setattr(RUN, "start_worker", lambda spec, pp: started.append(spec["name"]) or spec)
    monkeypatch.setattr(RUN, "finish_worker", lambda proc, t0, timeout: {"tokens": [], "wall_s": 1.0})
    est = {"a": 10.0, "b": 50.0, "c": 1.0, "d": 1.0}
    monkeypatch.setattr(RUN, "estimate_s", lambda run: est[run.model])
    runs = [P.Run(m, "triton") for m in "dabc"]
    done = {"d/triton/bf16/eager": {"tokens": [9]}}
    res = RUN.run_all(runs, lambda run, mem: {"name": run.name}, lambda run: "",
                      RUN.time.perf_counter(), budget_s=30.0, done=done)
    assert started == ["a/triton/bf16/eager"]                  # d resumed; b does not fit: stop
    assert res["d/triton/bf16/eager"] == {"tokens": [9]}
    assert res["b/triton/bf16/eager"]["error"].startswith("skipped: time budget spent")
    assert res["c/triton/bf16/eager"]["error"].startswith("skipped")   # after the cut, even if small


def test_finish_worker_keeps_the_result_of_a_worker_that_does_not_exit():
    """vLLM 0.26.0's engine keeps its process alive after generate: the result line counts."""
    hang = subprocess.Popen([sys.executable, "-c", "import time; print('RESULT {\"x\": 1}', flush=True); "
                             "time.sleep(120)"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    res = RUN.finish_worker(hang, RUN.time.perf_counter(), timeout=3)
    assert res["x"] == 1 and res["ended"].startswith("killed at timeout") and hang.returncode is not None
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert RUN.finish_worker(silent, RUN.time.perf_counter(), timeout=2)["error"].startswith("timeout")


def test_finish_worker_returns_when_the_worker_exits_though_a_leftover_child_holds_its_output(tmp_path):
    """A worker that printed its result and exited, leaving a child (e.g. a compile worker) that keeps
    the output pipe open: finish_worker returns at the worker's exit, not at the timeout, and the
    leftover is killed with the worker's session."""
    pidfile = tmp_path / "child.pid"
    code = (f"import subprocess, sys, os; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); print('RESULT {{\"y\": 2}}', flush=True); os._exit(0)")
    worker = RUN.subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
    res = RUN.finish_worker(worker, RUN.time.perf_counter(), timeout=60)
    assert res["y"] == 2 and res["ended"] == "exited"
    child = int(pidfile.read_text())

    def alive(pid):   # a killed process no one has reaped yet is a zombie: dead
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    for _ in range(50):                       # the kill is asynchronous
        if not alive(child):
            break
        RUN.time.sleep(0.1)
    else:
        raise AssertionError("the leftover child is still alive")


def test_a_worker_ends_its_process_even_when_something_keeps_it_alive(tmp_path):
    """e2e_proof.py --worker ends with os._exit whatever happens; a worker that fails prints its
    traceback (into the log the report shows) and exits 1. Its spec travels as a file (spec_arg): one
    with the prompts of a long-context model is far beyond the 128 KiB a single argv string may hold
    (on the H200: "Argument list too long" at the DeepSeek-V3.2-shaped runs)."""
    from bench.e2e.worker import spec_arg

    path = spec_arg({"prompts": [list(range(40000))] * 3})  # ~0.7 MB, no model_dir: KeyError in worker()
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "e2e_proof.py"), "--worker", path],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and "KeyError: 'path'" in proc.stderr, proc.stderr[-2000:]
    assert not Path(path).exists()  # the worker removed its spec file


def _run(tokens, top5, tf, tf5):
    return {"tokens": tokens, "step_top5": top5, "step_logprobs": [[-0.1] * len(t) for t in tokens],
            "tf_logprobs": tf, "tf_top5": tf5}


def test_compare_near_ties_and_judge_against_the_noise_floor():
    ref = _run([[1, 2, 3, 4], [5, 6, 7, 8]], [[[1, 9], [2, 9], [3, 9], [4, 9]],
                                               [[5, 9], [6, 7], [7, 9], [8, 9]]],
               [[-1.0, -2.0, -3.0]], [[[1, 2], [2, 3], [3, 4]]])
    # prompt 2 diverges at step 1 on the reference's runner-up: a near-tie both ways
    near = _run([[1, 2, 3, 4], [5, 7, 7, 8]], [[[1, 9], [2, 9], [3, 9], [4, 9]],
                                                [[5, 9], [7, 6], [7, 9], [8, 9]]],
                [[-1.0, -2.1, -3.0]], [[[1, 2], [2, 3], [3, 4]]])
    c = J.compare(near, ref, 2)
    assert c["identical_steps"] == [4, 1] and c["divergences_near_ties"] is True
    # a token outside the other's top-5 is not a near-tie
    far = _run([[1, 2, 3, 4], [5, 11, 7, 8]], [[[1, 9], [2, 9], [3, 9], [4, 9]],
                                                 [[5, 9], [11, 12], [7, 9], [8, 9]]],
               [[-1.0, -2.1, -3.0]], [[[1, 2], [2, 3], [3, 4]]])
    assert J.compare(far, ref, 2)["divergences_near_ties"] is False

    floor = {"tf_mean": 0.05, "top5_overlap": 0.95, "min_identical_steps": 40,
             "divergences_near_ties": True}
    ok = dict(c, tf_mean=0.06, top5_overlap=0.94, min_identical_steps=1)
    assert J.judge(ok, [floor], None, "auto") == (True, "PASS")
    good, why = J.judge(dict(ok, tf_mean=0.2), [floor], None, "auto")
    assert not good and "TF mean" in why
    good, why = J.judge(dict(ok, top5_overlap=0.9), [floor], None, "auto")
    assert not good and "top-5" in why
    good, why = J.judge(dict(ok, divergences_near_ties=False), [floor], None, "auto")
    assert not good and "near-tie" in why
    assert J.judge(dict(ok, divergences_near_ties=False, min_identical_steps=P.MIN_IDENTICAL_STEPS),
                   [floor], None, "auto")[0]
    # upstream fails the greedy rule against itself: the rule cannot tell a bug from noise
    wild = dict(floor, min_identical_steps=1, divergences_near_ties=False)
    good, why = J.judge(dict(ok, divergences_near_ties=False), [floor, wild], None, "auto")
    assert good and "greedy not judged" in why
    assert not J.judge(ok, [floor, None], None, "auto")[0]     # a floor run missing: no verdict
    # a run that did not store its TF top-5: that criterion is skipped and said so
    good, why = J.judge(dict(ok, top5_overlap=None), [floor], None, "auto")
    assert good and "top-5 overlap not stored" in why
    l0 = "model.layers.0.self_attn.attn"
    dump = {"rows": [{"layer": l0, "span": "pos>=topk", "same_set": 1.0, "err_p99": 4e-3},
                     {"layer": "model.layers.1.self_attn.attn", "span": "pos>=topk",
                      "same_set": 0.1, "err_p99": 1.0}]}       # layer 1 inherits: not judged
    assert J.judge(ok, [floor], dump, "auto") == (True, "PASS (incl. layer 0)")
    dump["rows"][0]["err_p99"] = 2e-2
    assert not J.judge(ok, [floor], dump, "auto")[0] and J.judge(ok, [floor], dump, "fp8_ds_mla")[0]
    dump["rows"][0].update(err_p99=4e-3, same_set=0.99)
    assert "same set" in J.judge(ok, [floor], dump, "auto")[1]
    # eager vs graphs: layer 0's inputs differ (torch.compile), so layer 0 is not judged
    good, why = J.judge(ok, [floor], dump, "auto", same_mode=False)
    assert good and "layer 0 not judged" in why


def test_merge_runs_keeps_failures_and_fills_them_from_later_runs():
    first = {"meta": {"device": "A"}, "runs": {"a": {"tokens": [1]}, "b": {"error": "skipped"},
                                               "c": {"error": "exit 1"}},
             "dumps": {"a": {"rows": [1]}}}
    later = {"meta": {"device": "B"}, "runs": {"a": {"tokens": [2]}, "b": {"tokens": [3]},
                                               "d": {"tokens": [4]}},
             "dumps": {"a": {"rows": [2]}, "b": {"rows": [3]}}}
    m = R.merge_runs([first, later])
    assert m["meta"] == {"device": "A"}
    assert m["runs"]["a"] == {"tokens": [1]}            # the base wins where it succeeded
    assert m["runs"]["b"] == {"tokens": [3]}            # a failure is replaced by a later success
    assert m["runs"]["c"] == {"error": "exit 1"}        # a failure nobody repaired stays visible
    assert m["runs"]["d"] == {"tokens": [4]}
    assert m["dumps"] == {"a": {"rows": [1]}, "b": {"rows": [3]}}


def _tf_run(tf):
    """A finished run whose teacher-forced logprobs are `tf` (one prompt), identical greedy steps."""
    return {"tokens": [[1, 2]], "step_top5": [[[1], [2]]], "step_logprobs": [[-0.1, -0.1]],
            "tf_logprobs": [tf], "tf_top5": [[[0]] * len(tf)], "startup_s": 1.0, "wall_s": 2.0,
            "triton_calls": {"sparse_mla.sparse_mla_attention": 1, "indexer.fp8_fp4_mqa_logits": 1},
            "vendor_calls": {}}


# positions 200..255 differ by 1: inside the top-k of a 256 model, beyond it for index_topk 200
_SAME = [0.0] * 300
_DIFF = [1.0 if 200 <= i < 256 else 0.0 for i in range(300)]


def test_compare_splits_teacher_forced_positions_at_the_models_index_topk():
    a, b = _tf_run(_SAME), _tf_run(_DIFF)
    at200 = J.compare(a, b, 200)
    assert at200["tf_mean_short"] == 0.0 and at200["tf_mean_long"] == pytest.approx(56 / 100)
    at256 = J.compare(a, b, 256)
    assert at256["tf_mean_short"] == pytest.approx(56 / 256) and at256["tf_mean_long"] == 0.0
    assert at200["tf_mean"] == at256["tf_mean"] == pytest.approx(56 / 300)


def test_report_splits_each_comparison_at_its_own_models_index_topk():
    """The odd model has index_topk 200 (the split used to be a literal 256 for every model)."""
    assert P.index_topk("odd/triton/bf16/graphs") == 200 and P.index_topk("glm5/upstream/bf16/eager") == 256
    runs = [P.Run(m, "triton", graphs=graphs) for m in ("odd", "glm5") for graphs in (False, True)]
    results = {r.name: _tf_run(_DIFF if r.graphs else _SAME) for r in runs}
    comps = [(f"{m}/triton/bf16/graphs", f"{m}/triton/bf16/eager", f"{m} check") for m in ("odd", "glm5")]
    args = types.SimpleNamespace(isolate=True, device_name="test")
    text, ok = R.report(args, "test", [], results, runs, P.Plan(runs, comps, {}, {}), {}, 1.0)
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines()
            if line.startswith(("| odd check", "| glm5 check"))}
    assert rows["odd check"][3] == "0.00000 / 0.56000"
    assert rows["glm5 check"][3] == f"{56 / 256:.5f} / 0.00000"
    assert "odd 200" in text and "glm5 256" in text and ok


def test_floors_and_must_match_name_comparisons_and_a_broken_plan_is_caught():
    old = P.PLANS["h200-0.23"]
    comps = {c for c, _, _ in old.comparisons}
    assert set(old.must_match) <= comps and {f for fs in old.floors.values() for f in fs} <= comps
    # the plan does not depend on the order of COMPARISONS (the old FLOORS / MUST_MATCH indexed it)
    shuffled = list(old.comparisons)
    random.Random(0).shuffle(shuffled)
    assert shuffled != old.comparisons and P.plan_errors(old._replace(comparisons=shuffled)) == []
    bad = P.plan_errors(old._replace(
        floors={"auto": ["glm5/triton/bf16/eager", "nope"], "fp8_ds_mla": ["glm5/upstream/bf16/graphs"]},
        must_match={"glm5/triton/fp8_ds_mla/eager": "fp8_ds_mla", "glm5/triton/bf16/eager": "fp4",
                    "glm5/upstream/bf16/eager": "auto"}))
    assert "floors['auto']: 'glm5/triton/bf16/eager' is not upstream vs upstream on one cache" in bad
    assert "floors['auto']: 'nope' is not a comparison" in bad
    assert ("must_match['glm5/triton/fp8_ds_mla/eager']: cache 'fp8_ds_mla' judged by the 'fp8_ds_mla' "
            "floors (cache 'auto')") in bad
    assert "must_match['glm5/triton/bf16/eager']: no floor set 'fp4'" in bad
    assert "must_match: 'glm5/upstream/bf16/eager' is not a comparison" in bad
    mixed = P.plan_errors(old._replace(floors={"auto": ["glm5/upstream/bf16/graphs",
                                                        "glm5/upstream/fp8_ds_mla/graphs"]}, must_match={}))
    assert "floors['auto']: 'glm5/upstream/fp8_ds_mla/graphs' mixes cache dtypes" in mixed
    twice = old.comparisons + [old.comparisons[0], ("odd/triton/bf16/eager", "glm5/upstream/bf16/eager", "x")]
    bad = P.plan_errors(P.Plan(old.runs + [P.Run("x", "triton"), old.runs[0]],
                               twice + [("x/triton/bf16/eager", "x/z", "")], {}, {}))
    assert f"comparison {old.comparisons[0][0]!r} listed twice" in bad
    assert "run 'glm5/upstream/bf16/eager' listed twice" in bad
    assert "comparison 'odd/triton/bf16/eager': its reference 'glm5/upstream/bf16/eager' serves another model" in bad
    assert "comparison 'x/triton/bf16/eager': no run 'x/z'" in bad


def test_stored_runs_give_the_same_verdicts_whatever_the_order_of_comparisons():
    data = R.merge_runs(R.load_parts([str(p) for p in STORED]))
    args = types.SimpleNamespace(isolate=False, device_name="H200")
    old = P.PLANS["h200-0.23"]

    def verdicts(comps):
        text, ok = R.report(args, "stored", [], data["runs"], old.runs, old._replace(comparisons=comps),
                            data["dumps"], 1.0)
        whats = {w for _, _, w in comps}
        return ok, {line.split(" | ")[0][2:]: line.rsplit(" | ", 1)[1] for line in text.splitlines()
                    if line.startswith("| ") and line.split(" | ")[0][2:] in whats}

    ok, rows = verdicts(old.comparisons)
    assert ok and len(rows) == len(old.comparisons)
    assert sum(v.startswith("PASS") for v in rows.values()) == len(old.must_match)
    assert verdicts(list(reversed(old.comparisons))) == (ok, rows)


def test_a_budget_cut_is_incomplete_not_a_pass_and_the_results_file_has_the_tables():
    """Stored run2 alone lacks one run (its budget skipped it): the report says INCOMPLETE (exit 1),
    every comparison that ran keeps its verdict, and the bench/RESULTS.md file carries the same rows."""
    data = R.merge_runs(R.load_parts([str(STORED[0])]))
    args = types.SimpleNamespace(isolate=False, device_name="H200")
    old = P.PLANS["h200-0.23"]
    text, ok = R.report(args, "stored", [], data["runs"], old.runs, old, data["dumps"], 1.0)
    assert not ok and "Overall: INCOMPLETE (1 of 12 runs skipped; nothing that ran failed)" in text
    assert "| odd/triton/fp8_ds_mla/graphs | skipped: time budget spent |" in text
    md = R.results_markdown(args, "vLLM 0.23.0", data["runs"], old.runs, old, data["dumps"], 1.0)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [line for line in md.splitlines() if line.startswith("| ")] == rows[:len(
        [line for line in md.splitlines() if line.startswith("| ")])]
    assert md.startswith("### E2E proof on H200, vLLM 0.23.0") and "Overall: INCOMPLETE" in md


def test_rejudge_of_the_stored_runs_regenerates_the_stored_report(tmp_path):
    """bench/README.md's recipe: `e2e_proof.py --plan h200-0.23 --rejudge run2,run3` rebuilds
    bench/results/h200-e2e_proof-run2+3-rejudged.md (all but the date in its title)."""
    out = tmp_path / "rejudged.md"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "e2e_proof.py"), "--plan", "h200-0.23", "--rejudge",
                           ",".join(map(str, STORED)), "--out", str(out)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stored = (REPO / "bench" / "results" / "h200-e2e_proof-run2+3-rejudged.md").read_text().splitlines()
    got = out.read_text().splitlines()
    assert got[0].rsplit(" (", 1)[0] == stored[0].rsplit(" (", 1)[0]
    assert got[1:] == stored[1:]
    assert "Overall: PASS" in got


def test_stage_patched_copy_applies_the_overlay_to_a_private_copy(tmp_path, monkeypatch):
    """Without an overlay in SITE, the proof runs on a private patched copy; SITE stays pristine."""
    from tests import vllm_envs

    _, site = vllm_envs.require("0.23.0")
    monkeypatch.setattr(RUN.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "stage"))
    (tmp_path / "stage").mkdir()
    before = {p: p.read_bytes() for p in (site / "vllm").rglob("*.py") if "attention" in str(p)}
    dest = RUN.stage_patched_copy(site)
    assert (dest / "vllm" / "_dsa_overlay" / "kernels" / "sparse_mla.py").is_file()
    assert not (site / "vllm" / "_dsa_overlay").exists()
    assert {p: p.read_bytes() for p in before} == before
    changed = [p for p in before if (dest / p.relative_to(site)).read_bytes() != before[p]]
    assert changed, "the overlay patched no attention file in the copy"


def test_prove_writes_partial_tables_after_every_run_and_resume_continues(tmp_path, monkeypatch):
    """prove() end to end with engines replaced by canned results: the budget cuts the plan, the report,
    its JSON, the bench/RESULTS.md tables and the work dir's results.json exist after the cut; a second
    call with --resume starts only the runs the first did not finish, and GGUF runs without a fixture
    are skipped without costing budget."""
    plan = P.PLANS["h200"]
    specs = []

    def start(spec, pp):
        specs.append(spec)
        return spec

    def finish(spec, t0, timeout):
        r = _tf_run(_SAME)
        if spec["path"] == "upstream":
            r["vendor_calls"] = {"flashmla.flash_mla_sparse_fwd": 1, "deep_gemm.fp8_fp4_mqa_logits": 1}
            r["triton_calls"] = {}
        return r

    monkeypatch.setattr(RUN, "start_worker", start)
    monkeypatch.setattr(RUN, "finish_worker", finish)
    monkeypatch.setattr(RUN, "prepare_vllm", lambda args, log: ("", "", "stub"))
    monkeypatch.setattr(RUN, "vllm_version", lambda pp: "0.26.0")
    monkeypatch.setattr(RUN, "make_model", lambda d, m: (d.mkdir(parents=True), (d / "config.json").write_text("{}")))
    clock = [0.0]
    monkeypatch.setattr(RUN.time, "perf_counter", lambda: clock[0])

    def start_timed(spec, pp):
        clock[0] += P.estimate_s(P.Run(spec["model_dir"].rsplit("/", 1)[-1], spec["path"], spec["kv"],
                                       spec["graphs"], spec["tps"], spec["chunk"]))
        return start(spec, pp)

    monkeypatch.setattr(RUN, "start_worker", start_timed)
    args = types.SimpleNamespace(site=str(tmp_path), apply=False, workdir=str(tmp_path / "work"), only=None,
                                 gguf_fixture=None, resume=False, no_dump=True, parallel=1, max_minutes=5,
                                 out=str(tmp_path / "out" / "e2e_proof.md"), isolate=False)
    text, ok = RUN.prove(args, plan)
    first = len(specs)
    assert 0 < first < len(plan.runs) and not ok and "Overall: INCOMPLETE" in text
    assert sum(P.estimate_s(P.Run(s["model_dir"].rsplit("/", 1)[-1], s["path"], s["kv"], s["graphs"],
                                  s["tps"], s["chunk"])) for s in specs) <= 300
    for f in ("e2e_proof.md", "e2e_proof.json", "e2e_proof-results.md"):
        assert (tmp_path / "out" / f).is_file()
    assert (tmp_path / "work" / RUN.RESULTS_JSON).is_file()
    assert "| glm5: Triton vs upstream, bf16, eager |" in (tmp_path / "out" / "e2e_proof-results.md").read_text()
    assert all(s["model_dir"].rsplit("/", 1)[-1] not in ("gguf_bf16",) for s in specs)
    dsv = [s for s in specs if s["model_dir"].endswith("dsv32")]
    assert dsv and all(len(p) > 2048 for p in dsv[0]["prompts"]) and dsv[0]["max_model_len"] == 4096
    assert {s["path"] for s in specs} <= {"upstream", "triton"}
    args.resume = True
    clock[0] = 0.0
    text, _ = RUN.prove(args, plan)
    again = [s["model_dir"].rsplit("/", 1)[-1] + s["path"] + s["kv"] + str(s["graphs"]) + str(s["chunk"])
             for s in specs]
    assert len(again) == len(set(again)), "a finished run was started again"
    assert "gguf_bf16/triton/bf16/eager | skipped: no --gguf-fixture" in text


def test_a_failed_run_fails_the_proof_only_when_a_verdict_needs_it():
    """vLLM 0.20.0 has no FLASH_ATTN_MLA_SPARSE: that run (informative rows only) may fail; a failed
    Triton run or noise-floor run fails the proof."""
    plan = P.PLANS["h200"]
    need = P.needed_runs(plan)
    assert "glm5/upstream_fa/bf16/eager" not in need
    assert {"glm5/triton/bf16/eager", "glm5/upstream/bf16/eager/c512", "dsv32/upstream/bf16/eager"} <= need
    runs = [P.Run("glm5", "upstream"), P.Run("glm5", "triton"), P.Run("glm5", "upstream", chunk=512),
            P.Run("glm5", "upstream_fa")]
    sub = P.Plan(runs, [c for c in plan.comparisons if c[0] in {r.name for r in runs}],
                 {"glm5/bf16/eager": plan.floors["glm5/bf16/eager"]},
                 {"glm5/triton/bf16/eager": "glm5/bf16/eager"})
    up = dict(_tf_run(_SAME), vendor_calls={"flashmla.flash_mla_sparse_fwd": 1, "deep_gemm.fp8_fp4_mqa_logits": 1},
              triton_calls={})
    results = {runs[0].name: up, runs[1].name: _tf_run(_SAME), runs[2].name: dict(up, tf_logprobs=[_DIFF]),
               runs[3].name: {"error": "exit 1", "log": "FLASH_ATTN_MLA_SPARSE is not a valid backend"}}
    args = types.SimpleNamespace(isolate=False, device_name="H200")
    text, ok = R.report(args, "x", [], results, runs, sub, {}, 1.0)
    assert ok and "| glm5/upstream_fa/bf16/eager | FAILED: exit 1 |" in text and "Overall: PASS" in text
    results[runs[1].name] = {"error": "exit 1"}
    text, ok = R.report(args, "x", [], results, runs, sub, {}, 1.0)
    assert not ok and "Overall: FAIL" in text

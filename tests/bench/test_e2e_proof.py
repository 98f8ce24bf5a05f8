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


def test_default_runs_put_tok_s_last_and_cover_comparisons():
    names = [r[0] for r in P.RUNS]
    tps = [r[5] for r in P.RUNS]
    assert any(tps) and tps == sorted(tps), "tok/s runs go last (alone on the GPU)"
    assert P.plan_errors(P.RUNS, P.COMPARISONS, P.FLOORS, P.MUST_MATCH) == []
    assert P.plan_errors(P.ISOLATE_RUNS, P.ISOLATE_COMPARISONS, {}, {}) == []
    for runs in (P.RUNS, P.ISOLATE_RUNS):
        assert all(r[2] in P.PATHS for r in runs)
        assert all(r[0].startswith(f"{r[1]}/{r[2]}/") for r in runs)   # names say model and path
    assert len(set(names)) == len(names)


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
        if name == "b" and tried[name] == 1:
            return {"error": "exit 1", "log": "Error in memory profiling. Initial free memory"}
        return {"tokens": [], "wall_s": 1.0}

    monkeypatch.setattr(RUN, "start_worker", start)
    monkeypatch.setattr(RUN, "finish_worker", finish)
    monkeypatch.setattr(RUN.time, "sleep", lambda s: None)
    runs = [("a", "m", "triton", "auto", False, False), ("b", "m", "triton", "auto", False, False),
            ("c", "m", "triton", "auto", False, False), ("t", "m", "upstream", "auto", True, True)]
    res = RUN.run_all(runs, lambda run, mem: {"name": run[0], "mem": mem}, lambda run: "",
                      RUN.time.perf_counter(), parallel=2)
    assert [s[0] for s in started] == ["a", "b", "c", "t", "b"]
    assert peak[0] == 2
    assert [s[1] for s in started] == [0.4, 0.4, 0.4, 0.5, 0.5]
    assert started[3][2] == 0 and started[4][2] == 0          # alone on the GPU
    assert all("error" not in r for r in res.values())


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
    runs = [(f"{m}/triton/bf16/{mode}", m, "triton", "auto", mode == "graphs", False)
            for m in ("odd", "glm5") for mode in ("eager", "graphs")]
    results = {name: _tf_run(_DIFF if name.endswith("graphs") else _SAME) for name, *_ in runs}
    comps = [(f"{m}/triton/bf16/graphs", f"{m}/triton/bf16/eager", f"{m} check") for m in ("odd", "glm5")]
    args = types.SimpleNamespace(isolate=True, device_name="test")
    text, ok = R.report(args, "test", [], results, runs, comps, {}, 1.0)
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines()
            if line.startswith(("| odd check", "| glm5 check"))}
    assert rows["odd check"][3] == "0.00000 / 0.56000"
    assert rows["glm5 check"][3] == f"{56 / 256:.5f} / 0.00000"
    assert "odd 200" in text and "glm5 256" in text and ok


def test_floors_and_must_match_name_comparisons_and_a_broken_plan_is_caught():
    comps = {c for c, _, _ in P.COMPARISONS}
    assert set(P.MUST_MATCH) <= comps and {f for fs in P.FLOORS.values() for f in fs} <= comps
    ok = P.plan_errors(P.RUNS, P.COMPARISONS, P.FLOORS, P.MUST_MATCH)
    assert ok == []
    # the plan does not depend on the order of COMPARISONS (the old FLOORS / MUST_MATCH indexed it)
    shuffled = list(P.COMPARISONS)
    random.Random(0).shuffle(shuffled)
    assert shuffled != P.COMPARISONS and P.plan_errors(P.RUNS, shuffled, P.FLOORS, P.MUST_MATCH) == []
    bad = P.plan_errors(P.RUNS, P.COMPARISONS,
                        {"auto": ["glm5/triton/bf16/eager", "nope"], "fp8_ds_mla": ["glm5/upstream/bf16/graphs"]},
                        {"glm5/triton/fp8_ds_mla/eager": "auto", "glm5/triton/bf16/eager": "fp4",
                         "glm5/upstream/bf16/eager": "auto"})
    assert "FLOORS['auto']: 'glm5/triton/bf16/eager' is not upstream vs upstream with cache 'auto'" in bad
    assert "FLOORS['auto']: 'nope' is not a comparison" in bad
    assert "FLOORS['fp8_ds_mla']: 'glm5/upstream/bf16/graphs' is not upstream vs upstream with cache " \
           "'fp8_ds_mla'" in bad
    assert "MUST_MATCH['glm5/triton/fp8_ds_mla/eager']: cache 'fp8_ds_mla' judged by the 'auto' floors" in bad
    assert "MUST_MATCH['glm5/triton/bf16/eager']: no floor set 'fp4'" in bad
    assert "MUST_MATCH: 'glm5/upstream/bf16/eager' is not a comparison" in bad
    twice = P.COMPARISONS + [P.COMPARISONS[0], ("odd/triton/bf16/eager", "glm5/upstream/bf16/eager", "x")]
    bad = P.plan_errors(P.RUNS + [("x/y", "x", "triton", "auto", False, False)], twice + [("x/y", "x/z", "")],
                        {}, {})
    assert f"comparison {P.COMPARISONS[0][0]!r} listed twice" in bad
    assert "comparison 'odd/triton/bf16/eager': its reference 'glm5/upstream/bf16/eager' serves another model" in bad
    assert "comparison 'x/y': no run 'x/z'" in bad


def test_stored_runs_give_the_same_verdicts_whatever_the_order_of_comparisons():
    data = R.merge_runs(R.load_parts([str(p) for p in STORED]))
    args = types.SimpleNamespace(isolate=False, device_name="H200")

    def verdicts(comps):
        text, ok = R.report(args, "stored", [], data["runs"], P.RUNS, comps, data["dumps"], 1.0)
        whats = {w for _, _, w in comps}
        return ok, {line.split(" | ")[0][2:]: line.rsplit(" | ", 1)[1] for line in text.splitlines()
                    if line.startswith("| ") and line.split(" | ")[0][2:] in whats}

    ok, rows = verdicts(P.COMPARISONS)
    assert ok and len(rows) == len(P.COMPARISONS)
    assert sum(v.startswith("PASS") for v in rows.values()) == len(P.MUST_MATCH)
    assert verdicts(list(reversed(P.COMPARISONS))) == (ok, rows)


def test_rejudge_of_the_stored_runs_regenerates_the_stored_report(tmp_path):
    """bench/README.md's recipe: `e2e_proof.py --rejudge run2,run3` rebuilds
    bench/results/h200-e2e_proof-run2+3-rejudged.md (all but the date in its title)."""
    out = tmp_path / "rejudged.md"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "e2e_proof.py"), "--rejudge",
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

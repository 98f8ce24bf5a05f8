"""Pure helpers of bench/e2e_proof.py (dump comparison, kernel-path check) on CPU tensors."""

import torch

from bench import e2e_proof as E


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
    d = E.compare_dumps(_dump(tmp_path / "c.pt", cand), _dump(tmp_path / "r.pt", ref), topk)
    rows = {(r["layer"], r["span"]): r for r in d["rows"]}
    assert rows["l0", "pos<topk"]["same_set"] == 1.0 and rows["l0", "pos>=topk"]["err_max"] == 0
    assert rows["l1", "pos>=topk"]["same_set"] == 0.5
    assert abs(rows["l1", "pos>=topk"]["overlap"] - 0.875) < 1e-9
    assert abs(rows["l1", "pos>=topk"]["err_max"] - 0.5) < 1e-2
    short = E.compare_dumps(_dump(tmp_path / "s.pt", cand[:1]), str(tmp_path / "r.pt"), topk)
    assert "schedules differ" in short["error"]


def test_kernels_ok_per_path():
    r = {"vendor_calls": {"flashmla.flash_mla_sparse_fwd": 3, "deep_gemm.fp8_fp4_mqa_logits": 2,
                          "deep_gemm.get_paged_mqa_logits_metadata": 1},
         "triton_calls": {"sparse_mla.sparse_mla_attention": 0, "indexer.fp8_fp4_mqa_logits": 0}}
    assert E.kernels_ok("upstream", r) and not E.kernels_ok("triton", r)
    mix = {"vendor_calls": {"flashmla.flash_mla_sparse_fwd": 0, "deep_gemm.fp8_fp4_mqa_logits": 2,
                            "deep_gemm.get_paged_mqa_logits_metadata": 1},
           "triton_calls": {"sparse_mla.sparse_mla_attention": 4, "indexer.fp8_fp4_mqa_logits": 0}}
    assert E.kernels_ok("attn_triton", mix) and not E.kernels_ok("idx_triton", mix)
    # the Triton path's decode builder may still be counted calling DeepGEMM's metadata: never
    tri = {"vendor_calls": {"deep_gemm.get_paged_mqa_logits_metadata": 1},
           "triton_calls": {"sparse_mla.sparse_mla_attention": 4, "indexer.fp8_fp4_mqa_logits": 2}}
    assert not E.kernels_ok("triton", tri)


def test_default_runs_put_tok_s_last_and_cover_comparisons():
    names = [r[0] for r in E.RUNS]
    tps = [r[5] for r in E.RUNS]
    assert any(tps) and tps == sorted(tps), "tok/s runs go last (alone on the GPU)"
    assert {E.MUST_MATCH[c] for c in E.MUST_MATCH} <= set(E.FLOORS)
    assert all(f in {c for c, _, _ in E.COMPARISONS} for fs in E.FLOORS.values() for f in fs)
    for runs, comps in ((E.RUNS, E.COMPARISONS), (E.ISOLATE_RUNS, E.ISOLATE_COMPARISONS)):
        have = {r[0] for r in runs}
        assert all(c in have and r in have for c, r, _ in comps)
        assert all(r[2] in E.PATHS for r in runs)
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

    monkeypatch.setattr(E, "start_worker", start)
    monkeypatch.setattr(E, "finish_worker", finish)
    monkeypatch.setattr(E.time, "sleep", lambda s: None)
    runs = [("a", "m", "triton", "auto", False, False), ("b", "m", "triton", "auto", False, False),
            ("c", "m", "triton", "auto", False, False), ("t", "m", "upstream", "auto", True, True)]
    res = E.run_all(runs, lambda run, mem: {"name": run[0], "mem": mem}, lambda run: "",
                    E.time.perf_counter(), parallel=2)
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
    c = E.compare(near, ref)
    assert c["identical_steps"] == [4, 1] and c["divergences_near_ties"] is True
    # a token outside the other's top-5 is not a near-tie
    far = _run([[1, 2, 3, 4], [5, 11, 7, 8]], [[[1, 9], [2, 9], [3, 9], [4, 9]],
                                                 [[5, 9], [11, 12], [7, 9], [8, 9]]],
               [[-1.0, -2.1, -3.0]], [[[1, 2], [2, 3], [3, 4]]])
    assert E.compare(far, ref)["divergences_near_ties"] is False

    floor = {"tf_mean": 0.05, "top5_overlap": 0.95, "min_identical_steps": 40,
             "divergences_near_ties": True}
    ok = dict(c, tf_mean=0.06, top5_overlap=0.94, min_identical_steps=1)
    assert E.judge(ok, [floor], None, "auto") == (True, "PASS")
    good, why = E.judge(dict(ok, tf_mean=0.2), [floor], None, "auto")
    assert not good and "TF mean" in why
    good, why = E.judge(dict(ok, top5_overlap=0.9), [floor], None, "auto")
    assert not good and "top-5" in why
    good, why = E.judge(dict(ok, divergences_near_ties=False), [floor], None, "auto")
    assert not good and "near-tie" in why
    assert E.judge(dict(ok, divergences_near_ties=False, min_identical_steps=E.MIN_IDENTICAL_STEPS),
                   [floor], None, "auto")[0]
    # upstream fails the greedy rule against itself: the rule cannot tell a bug from noise
    wild = dict(floor, min_identical_steps=1, divergences_near_ties=False)
    good, why = E.judge(dict(ok, divergences_near_ties=False), [floor, wild], None, "auto")
    assert good and "greedy not judged" in why
    assert not E.judge(ok, [floor, None], None, "auto")[0]     # a floor run missing: no verdict
    # a run that did not store its TF top-5: that criterion is skipped and said so
    good, why = E.judge(dict(ok, top5_overlap=None), [floor], None, "auto")
    assert good and "top-5 overlap not stored" in why
    l0 = "model.layers.0.self_attn.attn"
    dump = {"rows": [{"layer": l0, "span": "pos>=topk", "same_set": 1.0, "err_p99": 4e-3},
                     {"layer": "model.layers.1.self_attn.attn", "span": "pos>=topk",
                      "same_set": 0.1, "err_p99": 1.0}]}       # layer 1 inherits: not judged
    assert E.judge(ok, [floor], dump, "auto") == (True, "PASS (incl. layer 0)")
    dump["rows"][0]["err_p99"] = 2e-2
    assert not E.judge(ok, [floor], dump, "auto")[0] and E.judge(ok, [floor], dump, "fp8_ds_mla")[0]
    dump["rows"][0].update(err_p99=4e-3, same_set=0.99)
    assert "same set" in E.judge(ok, [floor], dump, "auto")[1]
    # eager vs graphs: layer 0's inputs differ (torch.compile), so layer 0 is not judged
    good, why = E.judge(ok, [floor], dump, "auto", same_mode=False)
    assert good and "layer 0 not judged" in why


def test_merge_runs_keeps_failures_and_fills_them_from_later_runs():
    first = {"meta": {"device": "A"}, "runs": {"a": {"tokens": [1]}, "b": {"error": "skipped"},
                                               "c": {"error": "exit 1"}},
             "dumps": {"a": {"rows": [1]}}}
    later = {"meta": {"device": "B"}, "runs": {"a": {"tokens": [2]}, "b": {"tokens": [3]},
                                               "d": {"tokens": [4]}},
             "dumps": {"a": {"rows": [2]}, "b": {"rows": [3]}}}
    m = E.merge_runs([first, later])
    assert m["meta"] == {"device": "A"}
    assert m["runs"]["a"] == {"tokens": [1]}            # the base wins where it succeeded
    assert m["runs"]["b"] == {"tokens": [3]}            # a failure is replaced by a later success
    assert m["runs"]["c"] == {"error": "exit 1"}        # a failure nobody repaired stays visible
    assert m["runs"]["d"] == {"tokens": [4]}
    assert m["dumps"] == {"a": {"rows": [1]}, "b": {"rows": [3]}}

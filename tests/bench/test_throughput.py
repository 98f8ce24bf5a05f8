"""bench/throughput.py on the CPU: the GLM-5-shaped config as real transformers reads it, the tokens/s
arithmetic against a clock the fake engine drives, the report's ratios, and the worker protocol with a worker
that cannot import vLLM (the run is a failed row, the results file is written, the exit code says so)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import throughput
from tests import vllm_envs

REPO = Path(__file__).resolve().parents[2]


def test_config_is_glm5_shaped_and_real_transformers_reads_it(tmp_path):
    python, _ = vllm_envs.require("0.26.0")
    d = throughput.write_model(tmp_path / "m", layers=8, experts=16)
    code = ("import json, sys; from transformers import AutoConfig; c = AutoConfig.from_pretrained(sys.argv[1]); "
            "print(json.dumps({k: getattr(c, k) for k in ('model_type', 'num_hidden_layers', 'hidden_size', "
            "'num_attention_heads', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim', "
            "'q_lora_rank', 'index_topk', 'index_n_heads', 'index_head_dim', 'n_routed_experts', "
            "'num_experts_per_tok', 'first_k_dense_replace', 'moe_intermediate_size', 'vocab_size')}))")
    proc = subprocess.run([str(python), "-c", code, str(d)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == dict(model_type="glm_moe_dsa", num_hidden_layers=8, hidden_size=6144, num_attention_heads=64,
                       kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                       q_lora_rank=2048, index_topk=2048, index_n_heads=32, index_head_dim=128,
                       n_routed_experts=16, num_experts_per_tok=8, first_k_dense_replace=3,
                       moe_intermediate_size=2048, vocab_size=154880)


def test_config_layer_lists_follow_the_layer_count():
    c = throughput.model_config(layers=2, experts=8)
    assert c["first_k_dense_replace"] == 2 and c["mlp_layer_types"] == ["dense", "dense"]
    c = throughput.model_config(layers=5, experts=8)
    assert c["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 2 and len(c["indexer_types"]) == 5
    with pytest.raises(ValueError, match="experts"):
        throughput.model_config(layers=4, experts=4)   # fewer experts than GLM-5's top-8


class FakeEngine:
    """generate() advances a fake clock by prompt tokens / prefill rate + decode steps x batch / decode rate;
    the first call of a batch shape (the warm-up) costs extra."""

    def __init__(self, prefill_rate, decode_rate):
        self.now = 100.0
        self.prefill_rate, self.decode_rate = prefill_rate, decode_rate
        self.calls = []

    def clock(self):
        return self.now

    def generate(self, batch, max_tokens):
        self.calls.append(max_tokens)
        cost = sum(map(len, batch)) / self.prefill_rate + (max_tokens - 1) * len(batch) / self.decode_rate
        self.now += cost + (7.0 if len(self.calls) == 1 else 0.0)


def test_measure_recovers_the_engine_rates(monkeypatch):
    eng = FakeEngine(prefill_rate=50_000.0, decode_rate=1_600.0)
    monkeypatch.setattr(throughput.time, "perf_counter", eng.clock)
    batch = [[5] * 4096 for _ in range(32)]
    res = throughput.measure(eng.generate, batch, decode_steps=128, repeats=2)
    assert eng.calls == [129, 1, 1, 129, 129]          # warm-up, prefill x2, prefill + decode x2
    assert res["prefill_tok_s"] == pytest.approx(50_000.0, rel=1e-6)
    assert res["decode_tok_s"] == pytest.approx(1_600.0, rel=1e-6)
    assert res["prompt_tokens"] == 32 * 4096 and res["decode_tokens"] == 32 * 128


def test_measure_takes_the_best_of_the_repeats(monkeypatch):
    eng = FakeEngine(prefill_rate=1000.0, decode_rate=100.0)
    slow = iter([0.0, 0.5, 0.0, 0.3, 0.0])              # extra seconds per call: noise on some repeats
    orig = eng.generate

    def noisy(batch, max_tokens):
        orig(batch, max_tokens)
        eng.now += next(slow)

    monkeypatch.setattr(throughput.time, "perf_counter", eng.clock)
    res = throughput.measure(noisy, [[3] * 100] * 2, decode_steps=10, repeats=2)
    assert res["prefill_s"] == [pytest.approx(0.7), pytest.approx(0.2)]
    assert res["prefill_tok_s"] == pytest.approx(1000.0)
    assert res["decode_tok_s"] == pytest.approx(100.0)


def test_report_ratios_and_failed_runs():
    ok = lambda p, d: dict(prefill_tok_s=p, decode_tok_s=d, prefill_s=[1.0], generate_s=[2.0],  # noqa: E731
                           vendor_calls={}, startup_s=50.0, wall_s=80.0)
    meta = dict(layers=8, experts=16, prompts=32, prompt_len=4096, decode_steps=128, chunk=8192, repeats=2,
                how="vLLM 0.26.0")
    md = throughput.report({"upstream/bf16": ok(40000.0, 2000.0), "triton/bf16": ok(30000.0, 2500.0),
                            "upstream/fp8_ds_mla": ok(35000.0, 2200.0),
                            "triton/fp8_ds_mla": {"error": "exit 1", "log": "boom"},
                            "triton_pdl/fp8_ds_mla": ok(35000.0, 2310.0)}, meta)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.splitlines() if line.startswith("| bf16") or line.startswith("| fp8_ds_mla")}
    assert rows["bf16"] == ["40000", "30000", "0.75x", "2000", "2500", "1.25x"]
    assert rows["fp8_ds_mla"] == ["35000", "failed", "-", "2200", "failed", "-"]
    assert rows["fp8_ds_mla (triton_pdl)"] == ["35000", "35000", "1.00x", "2200", "2310", "1.05x"]
    assert "bf16 (triton_pdl)" not in rows and len(rows) == 3
    assert "triton/fp8_ds_mla: exit 1" in md


def test_decode_profile_per_step_subtracts_the_prefill_call_and_ranks_by_time():
    """Per decode step: the prefill + decode call's kernel (and host op) time minus the prefill call's, per name;
    names only the prefill ran (or ran as much of) drop out; the wall time per step is the two calls' difference;
    the report lists kernels and host ops under the table."""
    short = {"attn_prefill": [900.0, 16], "gemm": [500.0, 40], "indexer": [80.0, 16], "sampler": [10.0, 1]}
    long_ = {"attn_prefill": [900.0, 16], "gemm": [500.0 + 4 * 300.0, 40 + 4 * 24], "indexer": [80.0 + 4 * 55.5, 48],
             "attn_decode": [4 * 120.25, 4 * 8], "sampler": [10.0 + 4 * 2.0, 5]}
    host_s = {"cudaGraphLaunch": [0.0, 0], "cudaLaunchKernel": [300.0, 30], "aten::copy_": [50.0, 5]}
    host_l = {"cudaGraphLaunch": [4 * 20.0, 4], "cudaLaunchKernel": [300.0 + 4 * 70.5, 30 + 4 * 9],
              "aten::copy_": [50.0, 5]}
    prof = throughput.decode_profile({"gpu": short, "host": host_s, "wall_s": 1.0, "busy_us": 1490.0,
                                      "streams": {"7": 1490.0}},
                                     {"gpu": long_, "host": host_l, "wall_s": 1.0 + 4 * 600e-6,
                                      "busy_us": 1490.0 + 4 * 450.0, "streams": {"7": 1490.0 + 4 * 400.0,
                                                                                 "9": 4 * 80.0}}, steps=4)
    assert prof["busy_us"] == pytest.approx(450.0) and prof["streams_us"] == {"7": 400.0, "9": 80.0}
    assert prof["gpu"]["rows"][:3] == [["gemm", 300.0, 24.0], ["attn_decode", 120.25, 8.0], ["indexer", 55.5, 8.0]]
    assert prof["gpu"]["total_us"] == pytest.approx(300.0 + 120.25 + 55.5 + 2.0, abs=0.1)
    assert prof["host"]["rows"] == [["cudaLaunchKernel", 70.5, 9.0], ["cudaGraphLaunch", 20.0, 1.0]]
    assert prof["wall_us"] == pytest.approx(600.0, abs=0.1)
    assert throughput.per_step(short, long_, steps=4, top=1)["rows"] == [["gemm", 300.0, 24.0]]
    res = dict(prefill_tok_s=1.0, decode_tok_s=1.0, prefill_s=[1.0], generate_s=[2.0], vendor_calls={},
               decode_profile=prof)
    meta = dict(layers=8, experts=16, prompts=32, prompt_len=4096, decode_steps=4, chunk=8192, repeats=2)
    md = throughput.report({"triton/bf16": res}, meta)
    assert "Decode step, triton/bf16" in md and "wall 600.0 us" in md and "| `attn_decode` | 120.2 | 8 |" in md
    assert "| `cudaLaunchKernel` | 70.5 | 9 |" in md
    assert "GPU busy (any stream) 450.0 us, by stream: 7 400.0 us, 9 80.0" in md


def test_gpu_busy_is_the_union_of_spans_and_each_stream_its_sum():
    """Overlapping, nested, touching and disjoint spans (ns) on two streams, in any order."""
    spans = [(5000, 9000, 2), (0, 4000, 1), (1000, 2000, 2), (4000, 6000, 1), (20000, 21000, 1), (8000, 8500, 1)]
    busy, streams = throughput.gpu_busy(spans)
    assert busy == pytest.approx(9.0 + 1.0)            # 0-9000 covered, then 20000-21000
    assert streams == {"1": pytest.approx(4.0 + 2.0 + 1.0 + 0.5), "2": pytest.approx(4.0 + 1.0)}
    assert throughput.gpu_busy([]) == (0.0, {})


def test_kernel_times_splits_host_ops_from_kernels():
    """A real profile of real work (here on the CPU): its host ops come back with their self CPU time and call
    count, the wall time is measured, and no host op is counted as a kernel (no GPU here, so none at all)."""
    import torch

    a, b = torch.randn(96, 80), torch.randn(80, 64)
    prof = throughput.kernel_times(lambda: [a @ b for _ in range(3)])
    assert prof["host"]["aten::mm"][1] == 3 and prof["host"]["aten::mm"][0] > 0
    assert prof["gpu"] == {} and prof["wall_s"] > 0


def test_bad_run_names_are_refused():
    assert throughput.parse_runs("upstream:bf16, triton:fp8_ds_mla,triton_pdl:bf16") == [
        ("upstream", "bf16"), ("triton", "fp8_ds_mla"), ("triton_pdl", "bf16")]
    for bad in ("flashmla:bf16", "triton:fp8", "triton"):
        with pytest.raises(SystemExit, match="bad run"):
            throughput.parse_runs(bad)


def test_a_worker_without_vllm_is_a_failed_row(tmp_path):
    """The real worker protocol: a process per run, its traceback kept, the results written after each run."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "throughput.py"), "--runs", "triton:bf16",
                           "--out", str(tmp_path), "--timeout", "120", "--rounds", "2"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "triton/bf16 (round 2 of 2): " in proc.stdout
    data = json.loads((tmp_path / "throughput.json").read_text())
    res = data["results"]["triton/bf16"]
    assert res["error"] == "exit 1" and "No module named 'vllm'" in res["log"]
    assert [r["error"] for r in data["rounds"]["triton/bf16"]] == ["exit 1", "exit 1"]
    assert "| bf16 | - | failed | - | - | failed | - |" in (tmp_path / "throughput.md").read_text()
    # a second call with another setup into the same --out is refused, nothing overwritten
    again = subprocess.run([sys.executable, str(REPO / "bench" / "throughput.py"), "--runs", "triton:bf16",
                            "--out", str(tmp_path), "--layers", "4"], capture_output=True, text=True, env=env,
                           timeout=300, cwd=tmp_path)
    assert again.returncode != 0 and "another setup" in again.stderr
    none = subprocess.run([sys.executable, str(REPO / "bench" / "throughput.py"), "--runs", "triton:bf16",
                           "--out", str(tmp_path), "--rounds", "0"], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert none.returncode != 0 and "--rounds must be >= 1" in none.stderr
    assert json.loads((tmp_path / "throughput.json").read_text()) == data


def test_rounds_alternate_the_engine_order():
    runs = [("upstream", "fp8_ds_mla"), ("triton", "fp8_ds_mla"), ("triton_pdl", "fp8_ds_mla")]
    order = [(r, p) for r, p, _ in throughput.round_order(runs, 3)]
    assert order == [(0, "upstream"), (0, "triton"), (0, "triton_pdl"),
                     (1, "triton_pdl"), (1, "triton"), (1, "upstream"),
                     (2, "upstream"), (2, "triton"), (2, "triton_pdl")]
    assert list(throughput.round_order(runs, 1)) == [(0, p, c) for p, c in runs]


def test_report_over_rounds_takes_medians_and_pairs_each_round():
    """Three rounds: the table shows each run's median; the paired table divides each round by the vendor run of the
    same round (a failed round drops out of the pairs, not the others) and gives the vendor path's own spread."""
    ok = lambda p, d: dict(prefill_tok_s=p, decode_tok_s=d, prefill_s=[1.0], generate_s=[2.0],  # noqa: E731
                           vendor_calls={}, startup_s=50.0, wall_s=80.0)
    meta = dict(layers=8, experts=16, prompts=32, prompt_len=4096, decode_steps=128, chunk=8192, repeats=2,
                how="vLLM 0.26.0")
    rounds = {"upstream/fp8_ds_mla": [ok(50000.0, 6400.0), ok(51000.0, 6200.0), ok(52000.0, 6300.0)],
              "triton/fp8_ds_mla": [ok(50500.0, 6336.0), {"error": "exit 1", "log": "x"}, ok(51500.0, 6363.0)],
              "triton_pdl/fp8_ds_mla": [ok(49000.0, 6528.0), ok(50000.0, 6014.0), ok(51000.0, 6300.0)]}
    last = {k: v[-1] for k, v in rounds.items()}
    md = throughput.report(last, meta, rounds)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.splitlines() if line.startswith("| fp8_ds_mla")}
    assert rows["fp8_ds_mla"] == ["51000", "51000", "1.00x", "6300", "6350", "1.01x"]
    assert rows["fp8_ds_mla (triton_pdl)"] == ["51000", "50000", "0.98x", "6300", "6300", "1.00x"]
    paired = [line for line in md.splitlines() if " / upstream, " in line]
    assert paired == ["| triton / upstream, fp8_ds_mla | 6400 / 6300 | 6336 / 6363 | 0.990 / 1.010 | 1.000x | 1.6% |",
                      "| triton_pdl / upstream, fp8_ds_mla | 6400 / 6200 / 6300 | 6528 / 6014 / 6300 | "
                      "1.020 / 0.970 / 1.000 | 1.000x | 3.2% |"]
    assert "median over the rounds" in md
    # one round: the plain table, no paired one
    one = throughput.report(last, meta, {k: v[-1:] for k, v in rounds.items()})
    assert "paired by round" not in one and "median over the rounds" not in one

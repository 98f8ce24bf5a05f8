"""bench/gguf_nan_probe.py's module watch: finds the module that makes the first non-finite value (on CPU)."""

import torch

from bench.gguf_nan_probe import Watch


class AddNorm(torch.nn.Module):
    """Like vLLM's fused add + RMSNorm: changes its inputs in place."""

    def forward(self, x, residual):
        residual.add_(x)
        x.copy_(residual / residual.pow(2).mean(-1, keepdim=True).sqrt())
        return x, residual


class Toy(torch.nn.Module):
    def __init__(self, bad: str):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.norm = AddNorm()
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 8)
        self.bad = bad
        self.register_buffer("qweight_type", torch.tensor([8]))

    def forward(self, input_ids):
        x = self.a(torch.nn.functional.one_hot(input_ids, 8).float())
        if self.bad == "norm":
            x = torch.zeros_like(x)  # 0 / sqrt(0): NaN made inside the in-place norm
        x, r = self.norm(x, torch.zeros_like(x))
        return self.c(self.b(x))


def test_the_watch_names_the_module_that_makes_the_first_nan(tmp_path):
    torch.manual_seed(0)
    model = Toy("b")
    with torch.no_grad():
        model.b.weight[3, 2] = float("inf")
    w = Watch(str(tmp_path / "o.pt"))
    w.install(model)
    ids = torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        model(input_ids=ids)
        model(input_ids=ids[:2])
    assert [o["module"] for o in w.origins] == ["b", "b"]      # not c, which only carries it on
    assert w.origins[0]["step"] == 1 and w.origins[0]["tokens"] == 4 and w.origins[1]["tokens"] == 2
    assert w.nonfinite_steps == [[1, 4], [2, 2]]
    blob = torch.load(tmp_path / "o.pt")
    assert blob["origin"]["module"] == "b" and torch.isinf(blob["state"]["weight"]).any()
    x = blob["args"][0]
    assert torch.isfinite(x).all() and torch.equal(blob["output"][0], torch.nn.functional.linear(
        x, blob["state"]["weight"], blob["state"]["bias"]))


def test_a_module_that_changes_its_inputs_in_place_is_judged_by_what_it_was_given():
    model = Toy("norm")
    w = Watch(None)
    w.install(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([0, 1]))
    assert w.origins and w.origins[0]["module"] == "norm"   # its inputs were finite when it got them
    assert all(o["module"] != "b" for o in w.origins)


def test_a_finite_model_has_no_origins():
    model = Toy("none")
    w = Watch(None)
    w.install(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([0, 1, 5]))
    assert w.origins == [] and w.nonfinite_steps == [] and w.step == 1


def test_each_config_runs_in_its_own_worker_and_a_failing_one_is_a_row(tmp_path):
    """The driver's plumbing without vLLM: the worker (this script, --worker SPEC) fails to import vLLM, and the
    report says so in that config's row instead of stopping."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    fx = tmp_path / "fx"
    fx.mkdir()
    (fx / "fixture.json").write_text(json.dumps({"gguf": {"Q8_0": "m.gguf"}, "hf": "hf",
                                                 "config": {"vocab_size": 512}}))
    script = Path(__file__).resolve().parents[2] / "bench" / "gguf_nan_probe.py"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "no-vllm-here")}
    proc = subprocess.run([sys.executable, str(script), "--fixture", str(fx), "--out", str(tmp_path / "o"),
                           "--configs", "256:off,512:on", "--timeout", "120"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "o" / "nan_probe.json").read_text())
    assert sorted(res) == ["Q8_0-c256-eager-hooks-upstream", "Q8_0-c512-compile-upstream"]
    assert all(r["error"] == "exit 1" and "No module named 'vllm'" in r["log"] for r in res.values())
    md = (tmp_path / "o" / "nan_probe.md").read_text()
    assert md.count("| exit 1 |") == 2 and "No module named 'vllm'" in md

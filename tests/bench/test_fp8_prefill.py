"""bench/fp8_prefill.py end to end in Triton's interpreter (--cpu-smoke): both fp8_ds_mla prefill paths run on a
tiny causal step, agree with each other and with the float32 reference, and the report names every row."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cpu_smoke_report(tmp_path):
    out = tmp_path / "fp8_prefill.md"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "fp8_prefill.py"), "--cpu-smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for row in ("fp8 direct", "fp8 workspace", "up-convert alone", "bf16 direct"):
        assert f"| {row} |" in text, text
    errs = json.loads(out.with_suffix(".json").read_text())["errors"]
    assert not errs["nan"], errs
    # bf16 outputs: a few bf16 ulps apart (the workspace tile and the fp8 tile round P differently)
    assert errs["workspace vs direct"] < 2e-2 and errs["direct vs float32"] < 2e-2, errs
    assert errs["workspace vs float32"] < 2e-2, errs

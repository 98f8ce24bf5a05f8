"""bench/mma_ceiling.py's GEMM kernel in the Triton interpreter: odd sizes (masked edges) against float64,
the output poisoned with NaN first; and the report's ratio column from both builds' times."""

from bench import mma_ceiling as MC


def test_gemm_kernel_matches_float64_on_odd_sizes():
    assert MC.cpu_smoke() < 1e-5


def test_report_divides_the_mma_sync_build_by_the_wgmma_build():
    key = "bf16 4096x4096x4096"
    own = {key: 200.0, key + " err": 1e-3, key + " cublas": 180.0}
    text = MC.report(own, {key: 500.0}, "child ok", "H200")
    row = next(line for line in text.splitlines() if line.startswith(f"| {key} "))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "200.0 (687)" and cells[2] == "500.0 (275)" and cells[3] == "2.50x" and cells[4] == "180.0"
    assert "| fp8 4096x4096x4096 | - | - | - | - |" in text      # not measured: dashes, not zeros

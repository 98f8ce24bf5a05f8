"""bench/sass_mix.py: the main-loop finder on hand-written SASS, and one real cross-compile (sm_89, 16 heads) in a
fresh process without TRITON_INTERPRET (the suite's pytest interprets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import sass_mix  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
.L_x_0:
        /*0020*/                   LDS R2, [R3] ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0040*/               @P0 BRA `(.L_x_0) ;
        /*0050*/                   F2FP.BF16.F32.PACK_AB R2, R3, R4 ;
.L_x_1:
        /*0060*/                   F2FP.BF16.F32.PACK_AB R2, R3, R4 ;
        /*0070*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0080*/                   PRMT R5, R6, 0x7604, R7 ;
        /*0090*/                   STS [R1], R2 ;
        /*0098*/                   STL [R1+0x10], R2 ;
        /*00a0*/              @!P1 BRA `(.L_x_1) ;
        /*00b0*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00c0*/                   EXIT ;
"""


def test_main_loop_is_the_longest_backward_branch():
    ops = sass_mix.main_loop(SASS)
    assert ops == {"F2FP": 1, "HMMA": 1, "PRMT": 1, "STS": 1, "STL": 1, "BRA": 1}
    assert sass_mix.classify(ops) == dict(hmma=1, conversion=2, shared=1, spills=1, other=1, total=6)
    with pytest.raises(ValueError, match="no loop"):
        sass_mix.main_loop(SASS.replace("`(.L_x_0)", "`(.L_x_2)").replace("`(.L_x_1)", "`(.L_x_2)"))


def test_fewest_mmas_per_row():
    # 16 heads: 36 k-steps of the 576-wide scores over 8 rows per MMA, 64 column tiles of P.V over 16 rows per MMA
    assert sass_mix.min_hmma_per_row(16, 1) == pytest.approx(36 / 8 + 64 / 16)
    assert sass_mix.min_hmma_per_row(64, 2) == pytest.approx(4 * (36 / 8 + 32 / 16))


def test_a_real_sm89_loop_has_its_mmas_and_the_fp8_decode(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "mix.md"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "sass_mix.py"), "--cc", "89", "--heads", "16",
                          "--tiles", "h16n32s1w4p2f", "--out", str(out)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    every = json.loads(out.with_suffix(".json").read_text())
    # each format's pick, then the tile asked for: counted as itself, its ratio against the bf16 pick
    assert [(r["fmt"], r["pick"]) for r in every] == [("bf16", True), ("bf16", False), ("fp8_ds_mla", True),
                                                      ("fp8_ds_mla", False)]
    assert [r["tile"] for r in every if not r["pick"]] == ["h16n32s1w4p2f"] * 2
    rows = {r["fmt"]: r for r in every if r["pick"]}
    extra = next(r for r in every if r["fmt"] == "fp8_ds_mla" and not r["pick"])
    assert f"| h16n32s1w4p2f | {extra['per_row']['total']:.0f} |" in out.read_text()
    assert f"{extra['per_row']['total'] / rows['bf16']['per_row']['total']:.2f}x |" in out.read_text()
    for r in rows.values():
        assert r["per_row"]["hmma"] >= r["min_hmma_per_row"] - 1e-9, r   # the loop found holds the MMAs
        assert r["loop"]["total"] == sum(r["loop"][k] for k in ("hmma", "conversion", "shared", "spills", "other"))
    # the e4m3 decode is conversion work per KV row that the bf16 loop does not have
    assert rows["fp8_ds_mla"]["per_row"]["conversion"] > 4 * max(rows["bf16"]["per_row"]["conversion"], 1.0)
    assert "| 89 | 16 x 128 | fp8_ds_mla |" in out.read_text()


NESTED = """
.L_x_0:
        /*0000*/                   LDG.E R2, [R4.64] ;
.L_x_1:
        /*0010*/                   PRMT R5, R6, 0x7604, R7 ;
        /*0020*/                   QMMA.16832.F32.E4M3.E4M3 R8, R12, R16, R8 ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/                   STG.E [R4.64], R2 ;
        /*0050*/               @P1 BRA `(.L_x_0) ;
.L_x_2:
        /*0060*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0070*/               @P2 BRA `(.L_x_2) ;
"""


def test_mma_loops_are_innermost_first_and_only_those_with_mmas():
    inner, outer = sass_mix.mma_loops(NESTED)
    assert inner == {"PRMT": 1, "QMMA": 1, "BRA": 1}
    assert outer == {"LDG": 1, "PRMT": 1, "QMMA": 1, "BRA": 2, "STG": 1}
    assert sass_mix.classify(inner)["hmma"] == 1   # fp8 mma.sync counts as MMA work
    assert sass_mix.main_loop(NESTED) == outer


def test_the_indexer_key_tiles_decoded_ahead_shed_most_of_sm80s_decode(tmp_path):
    """sm_80's indexer decode pick (key tiles decoded ahead by the PTX block) against the same walk decoding each tile
    in the iteration that loads it: the inner loop's conversions per key drop by more than half, with no spills; and
    against the pick with its query decoded opaquely (Q_OPAQUE)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "ix.md"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "sass_mix.py"), "--indexer", "decode", "--cc", "80",
                          "--heads", "32", "--variants", '[{"K_AHEAD": false}, {"Q_OPAQUE": true}]', "--out", str(out)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    pick, plain, opaque = json.loads(out.with_suffix(".json").read_text())
    assert pick["cfg"]["K_AHEAD"] and not plain["cfg"]["K_AHEAD"] and pick["spills"] == 0
    assert pick["per_key"]["hmma"] == plain["per_key"]["hmma"] > 0       # the same MMAs per key
    assert pick["per_key"]["conversion"] < 0.5 * plain["per_key"]["conversion"], (pick["per_key"], plain["per_key"])
    assert "| 80 | decode | 32 x 1 |" in out.read_text()
    # the query decoded by the impure PTX block: Triton no longer sees the 8-bit load behind either operand (kWidth 2),
    # the MMAs read 16-bit operands with fewer shared loads and register moves
    assert opaque["per_key"]["hmma"] == pick["per_key"]["hmma"] and opaque["spills"] == 0
    assert opaque["per_key"]["total"] < 0.8 * pick["per_key"]["total"], (opaque["per_key"], pick["per_key"])
    assert opaque["per_key"]["shared"] < pick["per_key"]["shared"]

"""bench/small_batch.py: the crossover rule that names GLUON_MIN_ROWS, and the whole script in Triton's
interpreter (--cpu-smoke: two tiny shapes, both formats; every tile against the float32 reference, as the backend
calls it and on slot ids; no Gluon there)."""

import json
import subprocess
import sys
from pathlib import Path

from bench import small_batch as S

REPO = Path(__file__).resolve().parents[2]


def test_suggest_min_rows_is_where_gluon_wins_from_there_on():
    t = {1: {"latency": 10.0, "triton": 12.0, "gluon": 11.0},
         4: {"latency": 20.0, "triton": 19.0, "gluon": 19.5},   # Triton fastest: not from here
         5: {"latency": 30.0, "triton": 21.0, "gluon": 20.0},
         8: {"latency": 40.0, "triton": 25.0, "gluon": 22.0},
         16: {"latency": 60.0, "triton": 40.0, "gluon": 30.0}}
    assert S.suggest_min_rows(t) == 5
    t[2] = {"latency": 14.0, "triton": 15.0, "gluon": 13.0}     # an isolated win below a loss does not count
    assert S.suggest_min_rows(t) == 5
    t[16]["gluon"] = 40.0                                        # a tie at the largest count: no suggestion
    assert S.suggest_min_rows(t) is None
    assert S.suggest_min_rows({8: {"latency": 9.0, "triton": None, "gluon": 8.0}}) == 8
    assert S.suggest_min_rows({8: {"latency": 9.0}}) is None   # Gluon not timed (no Gluon on this GPU)


def test_rows_of_64_heads_counts_token_64_head_rows():
    from overlay.kernels import sparse_mla as SM

    assert [SM.rows_of_64_heads(T, H) for T, H in ((1, 64), (3, 128), (5, 100), (0, 64), (4, 16))] == [1, 6, 10, 1, 4]


def test_tile_configs_follow_the_sm90_tables_and_the_split_rule():
    from overlay.kernels import sparse_mla as SM

    for fmt in SM.KV_FORMATS:
        cfgs = S.tile_configs(SM, 4, 64, 2048, fmt, 132)
        assert set(cfgs) == set(S.TILES)
        assert cfgs["latency"].tile == SM._LATENCY_TUNING[("sm90", fmt)].config.tile
        assert cfgs["gluon"].gluon and not cfgs["triton"].gluon
        for c in cfgs.values():
            assert c.num_splits == SM.split_count(4, 64, 2048, c, 1, 132) > 1


def test_cpu_smoke_report(tmp_path):
    out = tmp_path / "small_batch.md"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "small_batch.py"), "--cpu-smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert {(r["fmt"], r["T"]) for r in rows} == {(f, T) for f in ("bf16", "fp8_ds_mla") for T in (1, 2)}
    for r in rows:
        # latency and Triton tiles ran and matched the reference both ways; Gluon is said to be absent
        assert set(r["tiles"]) == set(r["raw"]) == {"latency", "triton"}, r
        assert r["errors"] == {"gluon": "no Gluon here"}, r
    text = out.read_text()
    assert text.count("| bf16 | 64 |") == 2 and text.count("| fp8_ds_mla | 64 |") == 2

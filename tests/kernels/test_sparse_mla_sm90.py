"""The sm_90 Gluon sparse-MLA kernel (overlay/kernels/sparse_mla_sm90.py) on a machine without a GPU.

Gluon does not run in Triton's interpreter, so its numbers are checked on a GPU (tests/kernels/gpu_checks.py: every
Gluon tile of the tables and the focus list, the heuristic cases that pick it, bit-identity of the direct launch,
the backend's request-local path). Here: it cross-compiles for sm_90 under every Triton the project meets (the
installed one, 3.5.1, and the newest vLLM venv's), fits in shared memory, never spills, and is the kernel it claims
to be: each warpgroup issues the score wgmma for its own half of the key block (36 = 576 / 16 instructions of
m64 x n(BLOCK_N / 2)), not for all of it as the Triton tile's chained-dot layout does; and the launch rules that
decide where it runs (tables, refusals, the kill switch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlay.kernels import sparse_mla as M
from overlay.kernels import sparse_mla_sm90 as G
from tests import vllm_envs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "_gluon_xcompile_worker.py"
NEWEST_VLLM = "0.33.0"  # the newest vLLM venv .ci/run makes: its Triton is the newest the overlay meets


def _python(tri: str) -> str:
    if tri == "installed":
        return sys.executable
    if tri == "3.5.1":
        from tests.kernels import _triton35

        return _triton35.python()
    py, _ = vllm_envs.require(NEWEST_VLLM)
    return str(py)


@pytest.mark.parametrize("tri", ["installed", "3.5.1", f"vllm-{NEWEST_VLLM}"])
def test_gluon_kernel_cross_compiles_for_sm90_as_designed(tri):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([_python(tri), str(WORKER)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    assert proc.returncode == 0, f"Gluon cross-compile under {tri} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    head, *rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    # the warp-specialised tile where this Triton's warp_specialize takes [(function, args), ...] (3.6 on); its
    # fp8_ds_mla schedule up to Triton 3.8 (3.9 spills it: sparse_mla_sm90.WS_FP8)
    assert head["ws"] == (tri != "3.5.1"), head
    assert head["ws_fp8"] == (head["ws"] and tuple(int(x) for x in head["triton"].split(".")[:2]) < (3, 9)), head
    tiles = {(f, str(M.SparseMLAConfig.from_tile(t))) for f in M.KV_FORMATS
             for t in M.candidate_tiles((9, 0), f) + M.FOCUS_TILES.get(f, []) if t[6]}
    assert {f for f, _ in tiles} == set(M.KV_FORMATS) and any(M.SparseMLAConfig.from_string(t).ws for _, t in tiles)
    tiles = {(f, t) for f, t in tiles if not M.SparseMLAConfig.from_string(t).ws
             or head["ws_fp8" if f == "fp8_ds_mla" else "ws"]}
    assert {(r["fmt"], r["tile"]) for r in rows} == tiles and len(rows) == 2 * len(tiles)  # split and unsplit
    for r in rows:
        c = M.SparseMLAConfig.from_string(r["tile"])
        what = f"triton {r['triton']} {r['tile']} split={r['split']}: {r}"
        assert r["shared"] <= r["limit"] and not (r["spill_stores"] or r["spill_loads"] or r["traps"]), what
        if c.ws:
            # the launcher's figure bounds the compiler's (whose scratch differs by a few bytes, split or not)
            fp8 = r["fmt"] == "fp8_ds_mla"
            assert G.ws_shared_bytes(fp8) - 64 <= r["shared"] <= G.ws_shared_bytes(fp8) <= r["limit"], what
            if fp8:  # WG0: every block's scores over K = 576 (36 steps of m64n64k16) and output columns 0-255 as
                # two 128-column tiles over K = 64 (2 x 4 steps); WG1: columns 256-511 the same way
                assert r["wgmma"] == {"m64n64k16": 36, "m64n128k16": 2 * 8}, what
            else:  # per math warpgroup: the scores of its own 64-key block (36 steps of m64n64k16) and its 256
                # output columns as two 128-column tiles over its own block and the other's (2 x 2 x 4 steps)
                assert r["wgmma"] == {"m64n64k16": 2 * 36, "m64n128k16": 2 * 16}, what
            continue
        # the launcher's shared-memory rule (sparse_mla._check_gluon) is the compiler's figure
        assert r["shared"] == G.shared_bytes(r["fmt"] == "fp8_ds_mla", c.block_n, c.num_stages), what
        # per warpgroup: scores of its BLOCK_N / 2 keys over K = 576 (36 steps of 16), once; P.V: its 64 of
        # each 128-column tile over K = BLOCK_N (4 tiles x BLOCK_N / 16 steps). Nothing else.
        assert r["wgmma"] == {f"m64n{c.block_n // 2}k16": 36, "m64n64k16": 4 * c.block_n // 16}, what


def test_gluon_config_strings_and_tiles():
    c = M.SparseMLAConfig(64, 64, 3, 8, 2, gluon=True)
    assert str(c) == "h64n64s3w8p2g" and M.SparseMLAConfig.from_string("h64n64s3w8p2g") == c
    assert M.SparseMLAConfig.from_tile(c.tile, 5) == M.SparseMLAConfig(64, 64, 5, 8, 2, gluon=True)
    # six-field tuples (no gluon flag) still read as Triton tiles
    assert M.SparseMLAConfig.from_tile((64, 64, 8, 3, 1, False), 2) == M.SparseMLAConfig(64, 64, 2, 8, 3)
    # six- and seven-field tuples (no prefetch flag) read with fp8_prefetch off
    assert M.SparseMLAConfig.from_tile((16, 64, 8, 2, 1, False, False), 1) == M.SparseMLAConfig(16, 64, 1, 8, 2)
    assert (64, 64, 8, 2, 1, False, True, False) in M.candidate_tiles((9, 0), "bf16")
    assert (64, 64, 8, 2, 1, False, True, False) in M.candidate_tiles((9, 0), "fp8_ds_mla")
    for cap in [(8, 0), (8, 9), (12, 0), (10, 0)]:
        for fmt in M.KV_FORMATS:
            assert not any(t[6] for t in M.candidate_tiles(cap, fmt)), (cap, fmt)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("H", [64, 100, 128])
def test_choose_config_takes_the_gluon_tile_from_gluon_min_rows(H, fmt):
    groups = -(-H // 64)
    for T in (1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 16, 23, 24, 33, 128, 4096):
        c = M.choose_config(T, H, 2048, fmt, capability=(9, 0), gluon=True)
        # from GLUON_WS_MIN_ROWS rows the warp-specialised tile, where this Triton builds it; else the 8-warp
        # Gluon tile from GLUON_MIN_ROWS
        ws = M.ws_builds(fmt) and T * groups >= M.GLUON_WS_MIN_ROWS[fmt]
        assert c.ws == ws, (T, H, c)
        assert c.gluon == (ws or T * groups >= M.GLUON_MIN_ROWS[fmt]), (T, H, c)
        if c.gluon:
            table = M._GLUON_WS_TUNING if ws else M._GLUON_TUNING
            assert c.tile == table[("sm90", fmt, 64)].config.tile and c.num_splits >= 1
        if c.ws:  # its splits are whole pairs of 64-key blocks
            split_len = -(-(-(-2048 // c.num_splits)) // 128) * 128
            assert split_len % 128 == 0 and (c.num_splits - 1) * split_len < 2048, c
        # without Gluon: the same config where it was not Gluon, else the latency or the bucket's Triton tile
        t = M.choose_config(T, H, 2048, fmt, capability=(9, 0), gluon=False)
        assert not t.gluon and (t == c if not c.gluon else t.tile in (
            M._THROUGHPUT_TUNING[("sm90", fmt, 64)].config.tile, M._LATENCY_TUNING[("sm90", fmt)].config.tile))
    for cap in [(8, 0), (8, 6), (12, 0), (10, 0)]:
        assert not M.choose_config(4096, H, 2048, fmt, capability=cap, gluon=True).gluon, cap
        assert not M.choose_config(4, H, 2048, fmt, capability=cap, gluon=True).gluon, cap


def test_small_batch_tiles_at_64_heads_on_sm90():
    """What bench/small_batch.py measured on the H200 (2026-12-05), as choose_config's picks at 64 heads."""
    lat = {f: M._LATENCY_TUNING[("sm90", f)].config.tile for f in M.KV_FORMATS}
    thr = {f: M._THROUGHPUT_TUNING[("sm90", f, 64)].config.tile for f in M.KV_FORMATS}
    glu = {f: M._GLUON_TUNING[("sm90", f, 64)].config.tile for f in M.KV_FORMATS}
    ws8 = M._GLUON_WS_TUNING[("sm90", "fp8_ds_mla", 64)].config.tile

    def tile(T, fmt, H=64, gluon=True):
        return M.choose_config(T, H, 2048, fmt, capability=(9, 0), gluon=gluon).tile

    # bf16: the latency tile for 1-4 tokens, the Gluon tile from 5 rows (at 128 heads: 3 tokens)
    assert [tile(T, "bf16") for T in (1, 2, 3, 4, 5, 6)] == [lat["bf16"]] * 4 + [glu["bf16"]] * 2
    assert tile(2, "bf16", H=128) == lat["bf16"] and tile(3, "bf16", H=128) == glu["bf16"]
    # fp8_ds_mla: the latency tile up to 2 rows; then the warp-specialised tile (H100, stop 40: 1.09-1.32x the
    # Triton tile at 3-16 rows); where this Triton has no warp_specialize, the 64-head Triton tile for 3-9 rows and
    # the 8-warp Gluon tile from 10 (H200, stop 33)
    ts = (1, 2, 3, 4, 9, 10)
    if G.WS_FP8:
        assert [tile(T, "fp8_ds_mla") for T in ts] == [lat["fp8_ds_mla"]] * 2 + [ws8] * 4
        assert tile(1, "fp8_ds_mla", H=128) == lat["fp8_ds_mla"] and tile(2, "fp8_ds_mla", H=128) == ws8
    else:  # pragma: no cover - Triton 3.5 or 3.9 on
        assert [tile(T, "fp8_ds_mla") for T in ts] == (
            [lat["fp8_ds_mla"]] * 2 + [thr["fp8_ds_mla"]] * 3 + [glu["fp8_ds_mla"]])
        assert tile(1, "fp8_ds_mla", H=128) == lat["fp8_ds_mla"] and tile(2, "fp8_ds_mla", H=128) == thr["fp8_ds_mla"]
        assert tile(5, "fp8_ds_mla", H=128) == glu["fp8_ds_mla"]
    # without Gluon the fp8 rule stands; bf16 keeps the sm_count / 8 latency regime
    assert tile(4, "fp8_ds_mla", gluon=False) == thr["fp8_ds_mla"] and tile(4, "bf16", gluon=False) == lat["bf16"]
    # the rule is sm_90's and the 64-head bucket's: 16 and 32 heads and the other families keep the latency tile
    for H in (8, 16, 32):
        assert tile(4, "fp8_ds_mla", H=H) == lat["fp8_ds_mla"], H
    for cap in [(8, 0), (8, 9), (12, 0), (10, 0)]:
        fam = M._family(cap)
        assert M.choose_config(4, 64, 2048, "fp8_ds_mla", capability=cap).tile == \
            M._LATENCY_TUNING[(fam, "fp8_ds_mla")].config.tile, cap


def test_interpreted_runs_never_default_to_gluon():
    # the suite interprets (tests/conftest.py): the default must be the Triton kernel, which runs here
    assert M.INTERPRETED and not M.GLUON_DEFAULT
    assert not M.choose_config(4096, 64, 2048, "bf16", capability=(9, 0)).gluon


def test_gluon_env_switch():
    assert M._gluon_wanted({}) and M._gluon_wanted({"DSA_OVERLAY_GLUON": "1"})
    assert M._gluon_wanted({"DSA_OVERLAY_GLUON": " On "})
    assert not M._gluon_wanted({"DSA_OVERLAY_GLUON": "0"}) and not M._gluon_wanted({"DSA_OVERLAY_GLUON": "off"})
    with pytest.raises(ValueError, match="DSA_OVERLAY_GLUON='maybe'"):
        M._gluon_wanted({"DSA_OVERLAY_GLUON": "maybe"})


def test_gluon_env_switch_reaches_the_default_in_a_compiled_process():
    """DSA_OVERLAY_GLUON=0 takes the Gluon tile out of the default in a process that compiles (no interpreter)."""
    code = ("from overlay.kernels import sparse_mla as M; import sys; "
            "sys.stdout.write(f'{M.GLUON_DEFAULT} {M.choose_config(4096, 64, 2048, \"bf16\", capability=(9, 0))}')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = {}
    for value in ("1", "0"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              env={**env, "DSA_OVERLAY_GLUON": value}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got[value] = proc.stdout.split()
    ws = "h64n64s1w4p2g" if G.WS else "h64n64s1w8p2g"  # T=4096: the warp-specialised tile where Triton has it
    assert got["1"] == ["True", ws] and got["0"] == ["False", "h64n64s1w8p3"], got


@pytest.mark.parametrize("config,why", [
    ("h64n64s1w8p2g", "interpreter"),
])
def test_a_gluon_config_is_refused_in_one_line_where_it_cannot_run(config, why):
    import torch

    case_q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=why) as e:
        M.sparse_mla_attention(case_q, cache, idx, 0.1, config=M.SparseMLAConfig.from_string(config))
    assert "\n" not in str(e.value) and config in str(e.value)


@pytest.mark.parametrize("kw,why", [
    (dict(kv_format="fp8_ds_mla", config="h64n64s1w8p3g"), "3 gather buffers of 64 rows need 270848 B"),
    (dict(config="h64n64s1w8p3g"), "3 gather buffers of 64 rows need 303616 B"),
    (dict(config="h64n32s1w8p6g"), "more than sm_90's 232448"),
    (dict(kv_format="nvfp4"), "not nvfp4"),
    (dict(capability=(8, 9)), "sm_90 kernel"),
    (dict(capability=(12, 0)), "sm_90 kernel"),
    (dict(config="h32n64s1w8p2g"), "64-head"),
    (dict(config="h64n64s1w4p3g"), "h64n64 with 2 buffers"),
    (dict(config="h64n32s1w4p2g"), "h64n64 with 2 buffers"),
    (dict(config="h64n64s1w4p2d2g"), "without d2 or f"),
    (dict(config="h32n64s1w4p2g"), "h64n64 with 2 buffers"),
    (dict(config="h64n64s1w2p2g"), "64-head"),
    (dict(config="h64n64s1w8p2d2g"), "64-head"),
    (dict(config="h64n16s1w8p2g"), "block_n"),
    (dict(config="h64n64s1w8p1g"), "gather buffers"),
])
def test_check_gluon_names_what_it_does_not_do(kw, why, monkeypatch):
    monkeypatch.setattr(M, "INTERPRETED", False)  # past the interpreter refusal, to the others
    config = M.SparseMLAConfig.from_string(kw.get("config", "h64n64s1w8p2g"))
    with pytest.raises(ValueError, match=why) as e:
        M._check_gluon(config, kw.get("kv_format", "bf16"), kw.get("capability", (9, 0)))
    assert "\n" not in str(e.value)
    M._check_gluon(M.SparseMLAConfig.from_string("h64n32s3w8p4g"), "bf16", (9, 0))  # valid ones pass
    M._check_gluon(M.SparseMLAConfig.from_string("h64n64s3w8p2g"), "fp8_ds_mla", (9, 0))
    M._check_gluon(M.SparseMLAConfig.from_string("h64n32s3w8p5g"), "fp8_ds_mla", (9, 0))
    if G.WS:
        M._check_gluon(M.SparseMLAConfig.from_string("h64n64s3w4p2g"), "bf16", (9, 0))
    if G.WS_FP8:
        M._check_gluon(M.SparseMLAConfig.from_string("h64n64s3w4p2g"), "fp8_ds_mla", (9, 0))


def test_check_gluon_refuses_the_fp8_ws_tile_where_its_triton_spills_it(monkeypatch):
    monkeypatch.setattr(M, "INTERPRETED", False)
    monkeypatch.setattr(M, "_WS", True)
    monkeypatch.setattr(M, "_WS_FP8", False)
    with pytest.raises(ValueError, match="fp8_ds_mla schedule spills under Triton") as e:
        M._check_gluon(M.SparseMLAConfig.from_string("h64n64s3w4p2g"), "fp8_ds_mla", (9, 0))
    assert "\n" not in str(e.value)
    M._check_gluon(M.SparseMLAConfig.from_string("h64n64s3w4p2g"), "bf16", (9, 0))  # bf16's schedule stays
    M.choose_config.cache_clear()
    try:
        c = M.choose_config(128, 64, 2048, "fp8_ds_mla", capability=(9, 0), gluon=True)
        assert c.gluon and not c.ws, c  # the 8-warp tile there
        assert M.choose_config(128, 64, 2048, "bf16", capability=(9, 0), gluon=True).ws
    finally:
        M.choose_config.cache_clear()


@pytest.fixture
def MI(monkeypatch):
    """The kernel module loaded for the interpreter as tests/kernels/test_sparse_mla.py loads it, with its heuristic
    as on an H200 (the Gluon tile by default)."""
    from tests.kernels._interp import load_interpreted

    mod = load_interpreted(ROOT / "overlay" / "kernels" / "sparse_mla.py", "_sparse_mla_sm90_fallback")
    monkeypatch.setattr(mod, "GLUON_DEFAULT", True)
    monkeypatch.setattr(mod, "_check_gluon", lambda *a: None)
    mod.choose_config.cache_clear()
    yield mod
    mod.choose_config.cache_clear()


def _small_case(seed):
    from tests.kernels import _cases as C

    return C.mla_case(seed, "bf16", 64, 40, 17, 16, num_blocks=6)  # 17 rows of 64 heads: the Gluon tile's shapes


def test_a_gluon_tile_that_does_not_build_falls_back_to_the_triton_tile_once(MI, monkeypatch, caplog):
    from tests.kernels import _cases as C

    broken = C.BrokenLaunch(C.compilation_error("module 'gluon.language' has no attribute 'thread_barrier'"))
    monkeypatch.setattr(MI, "_gluon_launch", broken)
    case = _small_case(441)
    assert MI.choose_config(17, 64, 40, "bf16").gluon  # what the call below plans first
    out, lse = C.poisoned_mla_outputs(17, 64)
    with caplog.at_level("WARNING"):
        MI.sparse_mla_attention(case.q, case.cache, case.idx, case.scale, out=out, lse=lse)
        MI.sparse_mla_attention(case.q, case.cache, case.idx, case.scale, out=out, lse=lse)
    C.check_mla(out, lse, case.ref(), C.MLA_INTERP_BF16, case.what)  # the Triton tile's result
    assert broken.calls == 1  # tried once; the second call planned the Triton tile straight away
    warnings = [r for r in caplog.records if "Gluon attention tile did not build" in r.getMessage()]
    assert len(warnings) == 1 and "DSA_OVERLAY_GLUON=0" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage() and "no attribute 'thread_barrier'" in warnings[0].getMessage()
    assert not MI.GLUON_DEFAULT and not MI.choose_config(17, 64, 40, "bf16").gluon


def test_other_errors_of_the_gluon_tile_are_not_swallowed(MI, monkeypatch):
    from tests.kernels import _cases as C

    broken = C.BrokenLaunch(ValueError("not a build failure"))
    monkeypatch.setattr(MI, "_gluon_launch", broken)
    case = _small_case(442)
    with pytest.raises(ValueError, match="not a build failure"):
        MI.sparse_mla_attention(case.q, case.cache, case.idx, case.scale)
    assert MI.GLUON_DEFAULT  # still on


def test_a_gluon_config_given_by_the_caller_is_not_replaced(MI, monkeypatch):
    from triton.compiler.errors import CompilationError

    from tests.kernels import _cases as C

    monkeypatch.setattr(MI, "_gluon_launch", C.BrokenLaunch(C.compilation_error("no Gluon here")))
    case = _small_case(443)
    with pytest.raises(CompilationError):
        MI.sparse_mla_attention(case.q, case.cache, case.idx, case.scale,
                               config=MI.SparseMLAConfig.from_string("h64n64s1w8p2g"))
    assert MI.GLUON_DEFAULT

"""bench/bench_sparse_mla.py's pure logic: the --focus baseline is read from the stored report itself."""

from pathlib import Path

from bench import bench_sparse_mla as B

# What the script used to keep in code (run 1's heuristic and best-of-sweep per focus shape), now read
# from bench/results/h200-sparse_mla-run1.md.
RUN1 = {
    "bf16 T=1 H=64": [("h64n32s64w8p2", 19.3), ("h16n64s32w8p2", 12.9)],
    "fp8_ds_mla T=1 H=8": [("h16n64s32w8p2", 15.3)],
    "bf16 T=128 H=16": [("h16n64s1w8p2", 135.9), ("h16n64s2w4p2", 99.8)],
    "fp8_ds_mla T=128 H=64": [("h64n32s1w8p2", 283.4), ("h64n64s1w8p3", 208.1)],
    "bf16 T=128 H=128": [("h64n32s1w8p2", 479.7), ("h64n64s1w8p3", 344.6)],
    "bf16 T=4096 H=64 (prefill)": [("h64n32s1w8p2", 7788.5), ("h64n64s1w8p3", 5392.0)],
}


def test_baseline_is_the_sweep_table_of_the_stored_run():
    base = B.load_baseline(B.BASELINE)
    for label, pairs in RUN1.items():
        for cfg, us in pairs:
            assert base[label][cfg] == us, (label, cfg)
    # every focus shape of run 1's grid is there, and its best is the run's best of sweep
    assert min(base["bf16 T=1 H=64"].values()) == 12.9
    # (run 1 timed 8, 16, 64 and 128 heads: the 32-head focus shapes, added in stop 46, have no baseline)
    assert all(f"{f} T={T} H={H}{' (prefill)' if p else ''}" in base
               for f, T, H, p in B.FOCUS_SHAPES if not p and H != 32)
    assert not any(f"{f} T={T} H={H}" in base for f, T, H, p in B.FOCUS_SHAPES if H == 32)


def test_baseline_parses_suffixed_configs_and_skips_other_tables(tmp_path):
    report = tmp_path / "r.md"
    report.write_text("## Results\n\n| shape | impl |\n|---|---|\n| bf16 T=1 H=8 | h16n64s1w8p2: 1.0 |\n\n"
                      "## Sweep (fastest first)\n\n| shape | config: us |\n|---|---|\n"
                      "| bf16 T=1 H=8 | h16n64s32w8p2: 10.5, h64n64s1w8p3d2: 11.0 (err 3.0e-01), "
                      "h16n64s32w8p2f: 12.25, h16n32s1w4p2: - skipped: time budget |\n\nTotal 3 s\n")
    assert B.load_baseline(str(report)) == {
        "bf16 T=1 H=8": {"h16n64s32w8p2": 10.5, "h64n64s1w8p3d2": 11.0, "h16n64s32w8p2f": 12.25}}
    assert B.load_baseline(str(tmp_path / "missing.md")) == {}
    assert Path(B.BASELINE).is_file()


def test_mma_sync_tiles_are_each_familys_own_pick_and_the_fp8_twin():
    from overlay.kernels import sparse_mla as SM

    tagged = B.mma_tile_configs("fp8_ds_mla", 128, 64, 2048, 132)
    picks = {tag: cfg for tag, cfg in tagged}
    for cap in B.MMA_SYNC_CAPABILITIES:
        mine = SM.choose_config(128, 64, 2048, "fp8_ds_mla", sm_count=132, capability=cap)
        # the family's own pick is timed (under its tag, or under the first family that has the same config)
        assert mine in picks.values()
        twin = SM.SparseMLAConfig.from_tile(mine.tile, mine.num_splits)
        twin = type(twin)(**{**twin.__dict__, "fp8_post_scale": not mine.fp8_post_scale})
        assert twin in picks.values()
        ahead = SM.SparseMLAConfig.from_tile(mine.tile[:7] + (2,), mine.num_splits)  # decoded one iteration ahead
        assert ahead in picks.values() and ahead.fp8_prefetch == 2
    assert len(set(picks.values())) == len(tagged)          # nothing timed twice
    assert all(not c.fp8_post_scale for t, c in B.mma_tile_configs("bf16", 128, 64, 2048, 132))


def test_mma_sync_leads_are_timed_beside_the_picks_where_listed():
    from overlay.kernels import sparse_mla as SM

    bf = dict((str(c), t) for t, c in B.mma_tile_configs("bf16", 128, 64, 2048, 132))
    assert bf["h32n64s1w4p2"] == "spills"
    assert bf["h32n32s1w4p2"] == "sm80/sm89 pick"   # the stop 45 pick of both families, timed once, tagged with both
    assert [t for t in bf.values() if t.endswith("pick")]                     # the picks stay
    fp8 = {str(c): t for t, c in B.mma_tile_configs("fp8_ds_mla", 128, 16, 2048, 132)}
    assert fp8.get("h16n32s1w4p2") == "sm8x lead"
    # a lead takes its split count from the pick: at T=1 the tile splits the top-k like the family's pick
    pick = SM.choose_config(1, 16, 2048, "fp8_ds_mla", sm_count=132, capability=B.MMA_SYNC_CAPABILITIES[-1])
    lead = [c for t, c in B.mma_tile_configs("fp8_ds_mla", 1, 16, 2048, 132) if t == "sm8x lead"]
    assert lead and lead[0].num_splits == pick.num_splits > 1 and lead[0].num_warps == 4
    # no leads where none are listed
    assert [t for t, c in B.mma_tile_configs("bf16", 128, 16, 2048, 132)] == ["sm80 pick", "sm89 pick"]


def test_mma_sync_rows_divide_fp8_by_the_same_familys_bf16_pick():
    mma = {"bf16 T=128 H=64": 224.0,                                  # sm_90's pick: not a per-tile row
           "bf16 T=128 H=64 | sm80 pick | h64n16s1w8p2": 300.0,
           "bf16 T=128 H=64 | sm89 pick | h64n16s1w8p2": 320.0,
           "fp8_ds_mla T=128 H=64 | sm80 pick | h32n32s1w8p2": 600.0,
           "fp8_ds_mla T=128 H=64 | sm80 alt | h32n32s1w8p2f": 330.0,
           "fp8_ds_mla T=1 H=64 | sm80 pick | h16n64s32w8p2": 14.0,
           "bf16 T=32 H=64 | sm80/sm89 pick | h32n32s2w4p2": 100.0,       # one pick of both families
           "fp8_ds_mla T=32 H=64 | sm89 pick | h32n32s2w8p2r": 130.0}
    rows = {tuple(c.strip() for c in r.split("|")[1:4]): r.split("|")[5].strip() for r in B.mma_tile_rows(mma)}
    assert rows[("fp8_ds_mla T=128 H=64", "sm80 pick", "h32n32s1w8p2")] == "2.00x"
    assert rows[("fp8_ds_mla T=128 H=64", "sm80 alt", "h32n32s1w8p2f")] == "1.10x"
    assert rows[("bf16 T=128 H=64", "sm89 pick", "h64n16s1w8p2")] == "-"
    assert rows[("fp8_ds_mla T=1 H=64", "sm80 pick", "h16n64s32w8p2")] == "-"   # no bf16 row of that shape
    assert rows[("fp8_ds_mla T=32 H=64", "sm89 pick", "h32n32s2w8p2r")] == "1.30x"
    assert len(rows) == 7

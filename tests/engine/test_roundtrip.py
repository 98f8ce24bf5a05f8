"""apply -> status -> re-apply (no-op) -> rollback on real pristine vLLM releases, through the CLI."""

import json
import os
import re
import shutil
import time
from pathlib import PurePosixPath

from tests.conftest import TIMINGS
from dsa_installer import engine, manifest, state

from .conftest import cli


def _status(site):
    proc = cli("status", "--vllm-site-packages", site, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_round_trip_is_byte_identical(tree):
    site = tree.path
    ps = manifest.load(tree.version)
    assert _status(site)["state"] == "pristine"

    t0 = time.perf_counter()
    proc = cli("--vllm-site-packages", site)
    t_apply = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert f"applied patch set {tree.version}" in proc.stdout

    st = _status(site)
    assert (st["state"], st["vllm_version"], st["supported"], st["forced_version"]) == (
        "applied", tree.version, True, None)
    assert {f["path"]: f["status"] for f in st["files"]} == {
        **{p.target: "patched" for p in ps.patches}, **{d.dest: "added" for d in ps.dropins}}
    for d in ps.dropins:
        assert (site / d.dest).read_bytes() == d.src.read_bytes()
    state = json.loads((site / "vllm/.dsa_overlay/state.json").read_text())
    assert state["complete"] and state["vllm_version"] == tree.version
    assert sorted(state["added_dirs"]) == sorted({str(PurePosixPath(d.dest).parent) for d in ps.dropins})

    again = cli("--vllm-site-packages", site, "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["changed"] is False
    assert "already applied; nothing to do" in cli("--vllm-site-packages", site).stdout

    t0 = time.perf_counter()
    proc = cli("rollback", "--vllm-site-packages", site)
    t_rollback = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"{site}: rolled back; vLLM is pristine again"
    tree.assert_pristine(full=True)
    assert not (site / "vllm/.dsa_overlay").exists() and not (site / "vllm/_dsa_overlay").exists()
    assert _status(site)["state"] == "pristine"
    assert "nothing to roll back" in cli("rollback", "--vllm-site-packages", site).stdout

    t0 = time.perf_counter()
    engine.apply(site)
    t_apply_lib = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.rollback(site)
    t_rollback_lib = time.perf_counter() - t0
    tree.assert_pristine()
    TIMINGS.append(
        f"vLLM {tree.version}: apply {t_apply:.2f} s, rollback {t_rollback:.2f} s (CLI process, incl. Python "
        f"start); engine only: apply {t_apply_lib * 1000:.0f} ms, rollback {t_rollback_lib * 1000:.0f} ms"
    )


def _unnumbered(text: str) -> str:
    return re.sub(r"(?m)^@@ -\d+(,\d+)? \+\d+(,\d+)? @@", "@@", text)


def test_dry_run_prints_the_diff_and_changes_nothing(tree):
    ps = manifest.load(tree.version)
    proc = cli("--vllm-site-packages", tree.path, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    for p in ps.patches:
        assert f"--- a/{p.target}\n+++ b/{p.target}\n" in proc.stdout
        # the printed diff is what the patch set says, line for line (headers aside; a family's diff may
        # land at an offset, so the hunk headers' line numbers are this release's)
        body = p.diff.read_text().split("\n", 2)[2]
        assert _unnumbered(body) in _unnumbered(proc.stdout)
    for d in ps.dropins:
        assert f"would add {d.dest}\n" in proc.stdout
    assert proc.stdout.endswith("nothing changed\n")
    tree.assert_pristine()
    assert not (tree.path / "vllm/.dsa_overlay").exists()


def test_stale_pycache_of_touched_files_is_removed(tree):
    site = tree.path
    target = site / manifest.load(tree.version).patches[0].target
    cache = target.parent / "__pycache__"
    cache.mkdir(exist_ok=True)
    stale = cache / f"{target.stem}.cpython-311.pyc"
    stale.write_bytes(b"stale bytecode of the pristine file")
    other = cache / "unrelated.cpython-311.pyc"
    other.write_bytes(b"keep me")
    engine.apply(site)
    assert not stale.exists() and other.exists()
    stale.write_bytes(b"bytecode of the patched file")
    (site / "vllm/_dsa_overlay/__pycache__").mkdir()
    (site / "vllm/_dsa_overlay/__pycache__/speculators.cpython-311.pyc").write_bytes(b"x")
    engine.rollback(site)
    assert not stale.exists() and other.exists()
    assert not (site / "vllm/_dsa_overlay").exists()
    shutil.rmtree(cache)  # other tests of the session may have imported from this copy too
    tree.assert_pristine()


def test_json_output_of_every_command(tree):
    site = tree.path
    applied = json.loads(cli("--vllm-site-packages", site, "--json").stdout)
    assert applied["action"] == "apply" and applied["changed"] is True
    rolled = json.loads(cli("rollback", "--vllm-site-packages", site, "--json").stdout)
    assert rolled["changed"] is True and sorted(rolled["restored"]) == sorted(
        p.target for p in manifest.load(tree.version).patches)
    dry = json.loads(cli("--vllm-site-packages", site, "--json", "--dry-run").stdout)
    assert dry["action"] == "dry-run" and dry["diff"].startswith("--- a/vllm/")
    tree.assert_pristine()


def test_options_before_the_subcommand_are_honoured(tree):
    """`apply.py --vllm-site-packages P rollback` must roll back P, not the vLLM this Python finds."""
    site = tree.path
    assert cli("--vllm-site-packages", site).returncode == 0
    assert json.loads(cli("--vllm-site-packages", site, "--json", "status").stdout)["state"] == "applied"
    proc = cli("--vllm-site-packages", site, "rollback")
    assert proc.returncode == 0, proc.stderr
    tree.assert_pristine()
    wrong = cli("--dry-run", "status", "--vllm-site-packages", site)
    assert wrong.returncode == 2 and "--dry-run and --force-version belong to apply" in wrong.stderr


def test_backups_are_the_original_files(tree):
    """apply keeps each original file itself as its backup (a hard link: no data written, so no space
    needed) and rollback renames it back: inode, mode and mtime are the ones pip installed."""
    site = tree.path
    targets = [p.target for p in manifest.load(tree.version).patches]
    mode = os.lstat(site / targets[0]).st_mode & 0o7777
    os.chmod(site / targets[0], 0o600)  # an unusual mode must survive too
    before = {t: os.lstat(site / t) for t in targets}
    engine.apply(site)
    for t in targets:
        backup = os.lstat(state.backup_path(site, t))
        assert (backup.st_ino, backup.st_mode, backup.st_mtime_ns) == (
            before[t].st_ino, before[t].st_mode, before[t].st_mtime_ns)
        assert os.lstat(site / t).st_ino != before[t].st_ino
        assert os.lstat(site / t).st_mode == before[t].st_mode  # the patched file keeps the mode
    engine.rollback(site)
    for t in targets:
        now = os.lstat(site / t)
        assert (now.st_ino, now.st_mode, now.st_mtime_ns) == (before[t].st_ino, before[t].st_mode,
                                                             before[t].st_mtime_ns)
    os.chmod(site / targets[0], mode)
    tree.assert_pristine(full=True)

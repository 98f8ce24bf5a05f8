"""A hostile or damaged tree: lost or tampered state, planted links, malformed metadata. The engine keeps
pristine bytes until the tree is verified, never writes outside the tree, and answers with one line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dsa_installer import engine, fsops, manifest, state
from dsa_installer.errors import UserError

from .conftest import family_tree_fixture, assert_error, cli

tree = family_tree_fixture()  # the engine's exhaustive cases: one release per family (conftest)

RECOVER = ("nothing was changed; move it away and run `apply.py rollback`, which then restores vLLM from the "
           "backups it can verify against the patch set")
WITHOUT_STATE = "rolled back without state.json (every restored file was verified); vLLM is pristine again"


def _targets(tree) -> list[str]:
    return [p.target for p in manifest.load(tree.version).patches]


def _cuda(tree) -> str:
    return next(t for t in _targets(tree) if t.endswith("platforms/cuda.py"))


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (links not followed): kind and bytes or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = ("file", p.read_bytes())
            else:
                out[rel] = ("dir",)
    return out


def _clean(tree) -> None:
    tree.assert_pristine(full=True)
    assert not os.path.lexists(tree.path / state.STATE_DIR)
    assert not os.path.lexists(tree.path / manifest.DROPIN_ROOT)


# ------------------------------------------------------------------------------------ lost state
def test_state_json_deleted_after_apply_restores_from_verified_backups(tree):
    site = tree.path
    engine.apply(site)
    state.state_file(site).unlink()
    assert engine.status(site)["state"] == "partially applied"
    assert_error(cli("--vllm-site-packages", site),
                 f"{state.state_dir(site)}: left by an interrupted apply or rollback (it has no state.json); run "
                 "`apply.py rollback` first, then apply")
    proc = cli("rollback", "--vllm-site-packages", site, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (sorted(result["restored"]), result["message"]) == (sorted(_targets(tree)), WITHOUT_STATE)
    assert sorted(result["removed"]) == sorted(d.dest for d in manifest.load(tree.version).dropins)
    _clean(tree)


def test_state_json_deleted_and_a_target_edited_keeps_the_backups(tree):
    """No state and an edit after apply: refused by name, backups untouched; --force restores the backup
    (verified against the manifest's pristine sha256) over the edit."""
    site, rel = tree.path, _cuda(tree)
    engine.apply(site)
    state.state_file(site).unlink()
    (site / rel).write_bytes((site / rel).read_bytes() + b"# edited\n")
    before = _snapshot(site / "vllm")
    for args in ([], ["--json"]):
        proc = cli("rollback", "--vllm-site-packages", site, *args)
        assert proc.returncode == 2 and proc.stderr == (
            f"error: {site / rel}: edited since apply and the overlay's state.json is gone; save your change "
            "elsewhere, then run `apply.py rollback --force` (which restores the backup verified against the patch "
            "set)\n"), proc.stderr
    assert _snapshot(site / "vllm") == before
    backup = state.backup_path(site, rel)
    assert fsops.file_sha256(backup) == manifest.load(tree.version).patches[_targets(tree).index(rel)].sha256
    result = engine.rollback(site, force=True)
    assert (sorted(result["restored"]), result["message"]) == (sorted(_targets(tree)), WITHOUT_STATE)
    _clean(tree)


def test_state_json_deleted_and_a_dropin_edited_is_refused_until_forced(tree):
    site = tree.path
    engine.apply(site)
    state.state_file(site).unlink()
    edited = site / manifest.DROPIN_ROOT / "kernels" / "indexer.py"
    edited.write_bytes(b"# mine\n")
    before = _snapshot(site / "vllm")
    root = site / manifest.DROPIN_ROOT
    assert_error(cli("rollback", "--vllm-site-packages", site),
                 f"{edited}: in {root} but not a file this dsa-overlay writes (edited, or from another version), and "
                 f"the overlay's state.json is gone; save it elsewhere, then run `apply.py rollback --force` (which "
                 f"removes {root})")
    assert _snapshot(site / "vllm") == before
    result = engine.rollback(site, force=True)
    assert (sorted(result["restored"]), result["message"]) == (sorted(_targets(tree)), WITHOUT_STATE)
    assert sorted(result["removed"]) == sorted(d.dest for d in manifest.load(tree.version).dropins)
    _clean(tree)


def test_whole_state_folder_deleted_is_undone_by_reversing_the_diffs(tree):
    """State and backups gone (and, in a second round, the drop-ins too): a target whose bytes are the patch
    applied to bytes with the manifest's pristine sha256 is restored by reversing the diff; the result is
    checked against that sha256."""
    site = tree.path
    for also_dropins in (False, True):
        engine.apply(site)
        shutil.rmtree(state.state_dir(site))
        if also_dropins:
            shutil.rmtree(site / manifest.DROPIN_ROOT)
        assert engine.status(site)["state"] == "modified (no overlay state)"
        result = engine.rollback(site)
        assert (sorted(result["restored"]), result["message"]) == (sorted(_targets(tree)), WITHOUT_STATE)
        _clean(tree)


def test_whole_state_folder_deleted_and_a_target_edited_is_refused(tree):
    site, rel = tree.path, _cuda(tree)
    engine.apply(site)
    shutil.rmtree(state.state_dir(site))
    (site / rel).write_bytes(b"# not vLLM any more\n")
    before = _snapshot(site / "vllm")
    assert_error(cli("rollback", "--vllm-site-packages", site, "--force"),
                 f"{site / rel}: cannot be proven pristine or patched by dsa-overlay without the overlay's state.json; "
                 f"reinstall with `pip install --force-reinstall --no-deps vllm=={tree.version}`, then delete "
                 f"{state.state_dir(site)} and {site / manifest.DROPIN_ROOT}")
    assert _snapshot(site / "vllm") == before


def test_unverifiable_backup_is_kept(tree):
    """A file in the backup folder that no patch set patches cannot be verified: refused, kept."""
    site = tree.path
    engine.apply(site)
    state.state_file(site).unlink()
    stray = state.backup_path(site, "vllm/envs.py")
    stray.write_bytes(b"# someone's bytes\n")
    before = _snapshot(site / "vllm")
    assert_error(cli("rollback", "--vllm-site-packages", site),
                 f"{stray}: a backup of vllm/envs.py, which no supported patch set patches, so dsa-overlay cannot "
                 f"verify it; if {site / 'vllm/envs.py'} is patched put this file back there by hand, then delete the "
                 "backup and run `apply.py rollback` again (nothing was changed)")
    assert _snapshot(site / "vllm") == before
    stray.unlink()
    assert engine.rollback(site)["message"] == WITHOUT_STATE
    _clean(tree)


# ------------------------------------------------------------------------------- tampered state
PATCHED = "patched entry {entry}: needs a path under vllm/ (outside its .dsa_overlay and _dsa_overlay), sha256s and a mode"
ADDED = "added entry {entry}: needs a path under vllm/_dsa_overlay/ and a sha256"
FOLDER = "added folder {entry}: must be vllm/_dsa_overlay or a folder under it"


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


@pytest.mark.parametrize("where, value, problem", [
    ("patched", "../outside/victim.py", PATCHED),
    ("patched", "vllm/../../outside/victim.py", PATCHED),
    ("patched", "{outside}/victim.py", PATCHED),
    ("patched", "vllm_other/victim.py", PATCHED),
    ("patched", "vllm/.dsa_overlay/state.json", PATCHED),
    ("patched", "vllm/./platforms/cuda.py", PATCHED),
    ("added", "vllm/envs.py", ADDED),
    ("added", "vllm/_dsa_overlay/../../outside/victim.py", ADDED),
    ("added_dirs", "{outside}", FOLDER),
    ("added_dirs", "vllm/_dsa_overlay/../../outside", FOLDER),
    ("added_dirs", "vllm", FOLDER),
])
def test_state_paths_outside_the_tree_are_refused(tree, tmp_path, where, value, problem):
    """Entries leading outside vllm/ (or to the wrong part of it) are refused with one line by every
    command, even --force; nothing inside or outside is touched; the advice in the message works."""
    site = tree.path
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.py").write_bytes(b"victim\n")
    near = site.parent / "outside"  # what '../outside' reaches from site-packages
    near.mkdir(exist_ok=True)
    (near / "victim.py").write_bytes(b"victim\n")
    engine.apply(site)
    path = state.state_file(site)
    st = json.loads(path.read_text())
    value = value.replace("{outside}", str(outside))
    if where == "added_dirs":
        st[where].append(value)
        entry = value
    else:
        st[where][0]["path"] = value
        entry = st[where][0]
    path.write_text(json.dumps(st))
    message = f"{path}: damaged overlay state ({problem.format(entry=_shown(entry))}); {RECOVER}"
    before, outside_before = _snapshot(site), (_snapshot(outside), _snapshot(near))
    assert_error(cli("rollback", "--force", "--vllm-site-packages", site), message)
    for call in (lambda: engine.rollback(site), lambda: engine.status(site), lambda: engine.apply(site)):
        with pytest.raises(UserError) as exc:
            call()
        assert str(exc.value) == message
    assert _snapshot(site) == before
    assert (_snapshot(outside), _snapshot(near)) == outside_before
    path.rename(tmp_path / "state.json")  # the advice: move it away, roll back
    assert engine.rollback(site)["message"] == WITHOUT_STATE
    _clean(tree)
    assert (_snapshot(outside), _snapshot(near)) == outside_before
    shutil.rmtree(near)


@pytest.mark.parametrize("content, problem", [
    (lambda st: b'{"format": 1}', "damaged overlay state (`overlay_version` missing or of the wrong type)"),
    (lambda st: json.dumps({**st, "patched": "vllm/x.py"}).encode(),  # a string where a list belongs
     "damaged overlay state (`patched` missing or of the wrong type)"),
    (lambda st: json.dumps({**st, "patched": ["vllm/x.py"]}).encode(),
     "damaged overlay state (patched entry 'vllm/x.py': needs a path under vllm/ (outside its .dsa_overlay and "
     "_dsa_overlay), sha256s and a mode)"),
    (lambda st: json.dumps({**st, "added": [{"path": "vllm/_dsa_overlay/x.py", "sha256": 5}]}).encode(),
     "damaged overlay state (added entry {'path': 'vllm/_dsa_overlay/x.py', 'sha256': 5}: needs a path under "
     "vllm/_dsa_overlay/ and a sha256)"),
    (lambda st: json.dumps({**st, "complete": "yes"}).encode(),
     "damaged overlay state (`complete` missing or of the wrong type)"),
    (lambda st: json.dumps({**st, "vllm_version": "../0.23.0"}).encode(),
     "damaged overlay state (`vllm_version` '../0.23.0' is not a version)"),
    (lambda st: b"\xff\xfe not json",
     "unreadable overlay state ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)"),
    (lambda st: b'{"format": 1, ',
     "unreadable overlay state (Expecting property name enclosed in double quotes: line 1 column 15 (char 14))"),
])
def test_malformed_state_is_one_line(tree, content, problem):
    site = tree.path
    engine.apply(site)
    path = state.state_file(site)
    path.write_bytes(content(json.loads(path.read_text())))
    before = _snapshot(site / "vllm")
    message = f"{path}: {problem}; {RECOVER}"
    assert_error(cli("rollback", "--vllm-site-packages", site), message)
    for call in (lambda: engine.status(site), lambda: engine.apply(site), lambda: engine.rollback(site, force=True)):
        with pytest.raises(UserError) as exc:
            call()
        assert str(exc.value) == message
    assert _snapshot(site / "vllm") == before
    path.unlink()
    assert engine.rollback(site)["message"] == WITHOUT_STATE
    _clean(tree)


def test_state_of_another_format_is_one_line(tree):
    site = tree.path
    engine.apply(site)
    for content in (b"[]", b'{"format": 2}', b"null"):
        state.state_file(site).write_bytes(content)
        assert_error(cli("rollback", "--vllm-site-packages", site),
                     f"{state.state_file(site)}: overlay state of an unknown format; use the dsa-overlay version "
                     "that applied it")
    state.state_file(site).unlink()
    engine.rollback(site)
    _clean(tree)


# ------------------------------------------------------------------------------------- planted links
@pytest.mark.parametrize("name", [".cuda.py.dsa-overlay-tmp", ".cuda.py.deadbeef.dsa-overlay-tmp"])  # old, new form
@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_planted_staging_link_is_not_written_through(tree, tmp_path, monkeypatch, name, dangling):
    """A link planted where apply stages cuda.py (made to be the exact name apply draws first): the staging
    file is created exclusively without following links, so the outside file is never written (nor
    created) and apply draws another name."""
    site, rel = tree.path, _cuda(tree)
    victim = tmp_path / "victim.py"
    if not dangling:
        victim.write_bytes(b"victim\n")
    planted = (site / rel).parent / name
    planted.symlink_to(victim)
    real, drawn = fsops._temp_candidate, []

    def first_draw_collides(path):
        if path.name == "cuda.py" and not drawn:
            drawn.append(path)
            return planted
        return real(path)

    monkeypatch.setattr(fsops, "_temp_candidate", first_draw_collides)
    engine.apply(site)
    monkeypatch.undo()
    assert drawn
    assert engine.status(site)["state"] == "applied"
    assert planted.is_symlink() and os.readlink(planted) == str(victim)
    assert (victim.read_bytes() == b"victim\n") if not dangling else not os.path.lexists(victim)
    engine.rollback(site)
    assert planted.is_symlink()  # not ours: left alone
    planted.unlink()
    _clean(tree)


def test_state_folder_as_a_link_is_refused(tree, tmp_path):
    """vllm/.dsa_overlay as a link to an outside folder: apply refuses (nothing written there); with the state
    of an earlier apply moved out behind such a link, rollback refuses cleanly, and following its advice
    (move the folder back in place of the link) finishes the rollback."""
    site = tree.path
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    link = state.state_dir(site)
    link.symlink_to(outside)
    message = (f"{link}: is a symbolic link; dsa-overlay keeps its state only in a real folder inside vllm/: if it "
               "points to the state of an earlier apply, move that folder here in its place, else remove the link "
               "(nothing was changed)")
    for args in ([], ["--dry-run"], ["rollback"], ["rollback", "--force"], ["status"]):
        assert_error(cli(*args, "--vllm-site-packages", site), message)
    assert list(outside.iterdir()) == []
    link.unlink()
    tree.assert_pristine()

    engine.apply(site)
    outside.rmdir()
    shutil.move(str(link), str(outside))
    link.symlink_to(outside)
    before, outside_before = _snapshot(site / "vllm"), _snapshot(outside)
    for args in (["rollback"], ["rollback", "--force"]):
        assert_error(cli(*args, "--vllm-site-packages", site), message)
    assert (_snapshot(site / "vllm"), _snapshot(outside)) == (before, outside_before)
    link.unlink()
    shutil.move(str(outside), str(link))
    assert engine.rollback(site)["message"] == "rolled back; vLLM is pristine again"
    _clean(tree)


@pytest.mark.parametrize("which", ["vllm/_dsa_overlay", "vllm/_dsa_overlay/kernels"])
def test_linked_dropin_folder_is_refused(tree, tmp_path, which):
    """After apply, a drop-in folder replaced by a link to an outside copy: rollback would delete the outside
    files through it; it refuses instead, and finishes once the link is removed."""
    site = tree.path
    engine.apply(site)
    outside = tmp_path / "copy"
    shutil.move(str(site / which), str(outside))
    (site / which).symlink_to(outside)
    outside_before = _snapshot(outside)
    message = (f"{site / which}: is a symbolic link, which dsa-overlay never creates; remove it (or put the real "
               "folder or file back), then run the command again (nothing was changed)")
    for args in (["rollback"], ["rollback", "--force"], ["status"]):
        assert_error(cli(*args, "--vllm-site-packages", site), message)
    assert _snapshot(outside) == outside_before
    (site / which).unlink()
    result = engine.rollback(site)
    assert result["message"] == "rolled back; vLLM is pristine again"
    _clean(tree)
    assert _snapshot(outside) == outside_before


def test_linked_patch_target_is_refused(tree, tmp_path):
    """A target that is a link (or sits in a linked folder) is refused before anything is written: apply
    would otherwise turn the link into a regular file. The link and the file it points to stay as they are."""
    site, rel = tree.path, _cuda(tree)
    target = site / rel
    real_copy = tmp_path / "cuda.py"
    shutil.copy(target, real_copy)
    original = target.read_bytes()
    target.unlink()
    target.symlink_to(real_copy)
    try:
        for args in ([], ["--dry-run"]):
            assert_error(cli("--vllm-site-packages", site, *args),
                         f"{target}: is a symbolic link; dsa-overlay patches only regular files inside vllm/ (it "
                         f"would otherwise replace the link by a file): reinstall with "
                         f"`pip install --force-reinstall --no-deps vllm=={tree.version}` (nothing was changed)")
        assert target.is_symlink() and real_copy.read_bytes() == original
        assert not os.path.lexists(state.state_dir(site))
    finally:
        target.unlink()
        target.write_bytes(original)
    folder = target.parent
    moved = tmp_path / "platforms"
    shutil.move(str(folder), str(moved))
    folder.symlink_to(moved)
    try:
        assert_error(cli("--vllm-site-packages", site),
                     f"{folder}: is a symbolic link; dsa-overlay patches only regular files inside vllm/ (it would "
                     f"otherwise replace the link by a file): reinstall with "
                     f"`pip install --force-reinstall --no-deps vllm=={tree.version}` (nothing was changed)")
        assert (moved / "cuda.py").read_bytes() == original
    finally:
        folder.unlink()
        shutil.move(str(moved), str(folder))
    tree.assert_pristine()


def test_target_replaced_by_a_link_after_apply(tree, tmp_path):
    """A patched target replaced by a link after apply: rollback refuses by name; --force puts the backup in
    place of the link (the file it pointed to is not written)."""
    site, rel = tree.path, _cuda(tree)
    engine.apply(site)
    victim = tmp_path / "victim.py"
    victim.write_bytes(b"victim\n")
    (site / rel).unlink()
    (site / rel).symlink_to(victim)
    assert engine.status(site)["state"] == "modified after apply"
    assert_error(cli("rollback", "--vllm-site-packages", site),
                 f"{site / rel}: replaced by a link, folder or device since apply; save your change elsewhere, then "
                 "run `apply.py rollback --force` (which discards it)")
    engine.rollback(site, force=True)
    assert not (site / rel).is_symlink() and victim.read_bytes() == b"victim\n"
    _clean(tree)


# ----------------------------------------------------------------------------- malformed metadata
def _metadata(tree) -> Path:
    return tree.path / f"vllm-{tree.version}.dist-info" / "METADATA"


def test_metadata_with_bytes_that_are_not_utf8(tree):
    """Non-UTF-8 bytes in the description do not matter (only the headers are read)."""
    meta = _metadata(tree)
    original = meta.read_bytes()
    try:
        meta.write_bytes(original + b"\n\xff\xfe\x80 latin-1 caf\xe9\n")
        st = json.loads(cli("status", "--vllm-site-packages", tree.path, "--json").stdout)
        assert (st["vllm_version"], st["state"]) == (tree.version, "pristine")
        header = original.replace(f"Version: {tree.version}".encode(), f"Version: {tree.version}\xe9".encode("latin-1"))
        meta.write_bytes(header)
        assert_error(cli("status", "--vllm-site-packages", tree.path),
                     f"{meta}: malformed version '{tree.version}\ufffd' (expected one like 0.23.0); reinstall vLLM "
                     "with pip")
    finally:
        meta.write_bytes(original)
    tree.assert_pristine()


@pytest.mark.parametrize("version", ["../../etc", "0.23.0/../0.16.0", "0.23.0 x", ".hidden", "0.23.0;rm",
                                     "9" * 200, "0.23.0\x00"])
def test_malformed_version_is_one_line(tree, version):
    meta = _metadata(tree)
    original = meta.read_bytes()
    try:
        meta.write_bytes(original.replace(f"Version: {tree.version}".encode(), f"Version: {version}".encode()))
        shown = version if len(version) <= 40 else version[:40] + "..."
        for args in ([], ["rollback"], ["status"]):
            assert_error(cli(*args, "--vllm-site-packages", tree.path),
                         f"{meta}: malformed version {shown!r} (expected one like 0.23.0); reinstall vLLM with pip")
    finally:
        meta.write_bytes(original)
    assert_error(cli("--vllm-site-packages", tree.path, "--force-version", "../" + tree.version),
                 f"--force-version ../{tree.version}: no such patch set (supported: "
                 f"{', '.join(manifest.supported_versions())})")
    tree.assert_pristine()

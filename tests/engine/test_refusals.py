"""Every refusal: exact one-line error, exit code 2, no traceback, nothing changed on disk."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

import pytest

from dsa_installer import engine, fsops, hunks, manifest, resources
from dsa_installer.errors import UserError

from .conftest import REPO, assert_error, cli

SUPPORTED = ", ".join(manifest.supported_versions())


def repo_copy(dest: Path) -> Path:
    """The tool's runnable files (what a user's clone holds) copied to `dest`, to be broken on purpose."""
    for name in ("dsa_installer", "overlay", "patches"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "apply.py", dest / "apply.py")
    return dest


def _target(tree) -> str:
    return manifest.load(tree.version).patches[0].target


def test_path_without_vllm(tmp_path):
    for cmd in ([], ["rollback"], ["status"]):
        assert_error(cli(*cmd, "--vllm-site-packages", tmp_path),
                     f"{tmp_path}: no vllm/ package here; pass the site-packages directory of the venv that has vLLM")
    assert list(tmp_path.iterdir()) == []


def test_unsupported_version_lists_the_supported_ones(tree):
    site = tree.path
    info = site / f"vllm-{tree.version}.dist-info"
    meta = info / "METADATA"
    original = meta.read_bytes()
    moved = site / "vllm-0.15.1.dist-info"
    try:
        meta.write_bytes(original.replace(f"Version: {tree.version}".encode(), b"Version: 0.15.1", 1))
        info.rename(moved)
        assert_error(cli("--vllm-site-packages", site), f"vLLM 0.15.1 at {site} has no patch set (supported: "
                     f"{SUPPORTED}); install a supported release, or try a neighbouring set with --force-version")
        assert_error(cli("--vllm-site-packages", site, "--force-version", "9.9.9"),
                     f"--force-version 9.9.9: no such patch set (supported: {SUPPORTED})")
        st = json.loads(cli("status", "--vllm-site-packages", site, "--json").stdout)
        assert (st["vllm_version"], st["supported"], st["state"]) == ("0.15.1", False, "not applied")
        assert "not supported (supported: " in cli("status", "--vllm-site-packages", site).stdout
    finally:
        moved.rename(info)
        meta.write_bytes(original)
    tree.assert_pristine()


def test_several_dist_infos(tree):
    extra = tree.path / "vllm-0.1.0.dist-info"
    extra.mkdir()
    try:
        assert_error(cli("--vllm-site-packages", tree.path),
                     f"{tree.path}: several vLLM installs are recorded (vllm-0.1.0.dist-info, "
                     f"vllm-{tree.version}.dist-info); reinstall vLLM with pip to clean up")
    finally:
        extra.rmdir()
    tree.assert_pristine()


def test_edited_target_is_refused_by_name(tree):
    site, rel = tree.path, _target(tree)
    path = site / rel
    original = path.read_bytes()
    path.write_bytes(original + b"# local edit\n")
    try:
        edited = fsops.sha256(original + b"# local edit\n")
        expected = manifest.load(tree.version).patches[0].sha256
        for args in ([], ["--dry-run"]):
            assert_error(cli("--vllm-site-packages", site, *args),
                         f"{path}: differs from pristine vLLM {tree.version} (sha256 {edited[:12]}..., expected "
                         f"{expected[:12]}...): edited, or another build; reinstall with "
                         f"`pip install --force-reinstall --no-deps vllm=={tree.version}`")
        assert not (site / "vllm/.dsa_overlay").exists()
        st = json.loads(cli("status", "--vllm-site-packages", site, "--json").stdout)
        assert st["state"] == "modified (no overlay state)"
        assert {"path": rel, "kind": "target", "status": "differs from pristine"} in st["files"]
    finally:
        path.write_bytes(original)


def test_edits_after_apply_block_rollback_unless_forced(tree):
    site, rel = tree.path, _target(tree)
    assert cli("--vllm-site-packages", site).returncode == 0
    cases = [
        (site / rel, "edited", lambda p: p.write_bytes(p.read_bytes() + b"# edited after apply\n")),
        (site / "vllm/_dsa_overlay/speculators.py", "edited", lambda p: p.write_bytes(b"# replaced\n")),
        (site / "vllm/_dsa_overlay/mine.py", "added to the overlay's folder", lambda p: p.write_bytes(b"x = 1\n")),
    ]
    for path, what, tamper in cases:
        if not (site / "vllm/.dsa_overlay").exists():
            assert cli("--vllm-site-packages", site).returncode == 0
        tamper(path)
        snapshot = {p: p.read_bytes() for p in site.glob("vllm/**/*") if p.is_file() and "_dsa_overlay" in str(p)}
        snapshot[site / rel] = (site / rel).read_bytes()
        st = json.loads(cli("status", "--vllm-site-packages", site, "--json").stdout)
        assert st["state"] == "modified after apply"
        assert_error(cli("rollback", "--vllm-site-packages", site),
                     f"{path}: {what} since apply; save your change elsewhere, then run "
                     "`apply.py rollback --force` (which discards it)")
        relpath = path.relative_to(site)
        status_word = {"edited": "modified"}.get(what, "unexpected")
        assert_error(cli("--vllm-site-packages", site),
                     f"{site}: the overlay is modified after apply ({relpath}: {status_word}); "
                     "run `apply.py rollback --force` first (it discards that edit)")
        assert {p: p.read_bytes() for p in snapshot if p.exists()} == {p: b for p, b in snapshot.items() if p.exists()}
        assert all(p.exists() for p in snapshot)
        forced = cli("rollback", "--vllm-site-packages", site, "--force")  # what apply said: works at once
        assert forced.returncode == 0, forced.stderr
        tree.assert_pristine()
        assert not (site / "vllm/_dsa_overlay").exists()


def test_deleting_an_added_or_patched_file_does_not_block_rollback(tree):
    """Nothing of the user's is lost by restoring a deleted target or by not removing a deleted drop-in, so
    (unlike an edit) a deletion is no reason to refuse: it is what a killed rollback leaves, too."""
    site, rel = tree.path, _target(tree)
    engine.apply(site)
    (site / "vllm/_dsa_overlay/speculators.py").unlink()
    (site / rel).unlink()
    st = engine.status(site)
    assert st["state"] == "partially applied"
    assert {(f["path"], f["status"]) for f in st["files"]} >= {
        ("vllm/_dsa_overlay/speculators.py", "missing"), (rel, "missing")}
    assert_error(cli("--vllm-site-packages", site),
                 f"{site}: the overlay is partially applied ({rel}: missing); run `apply.py rollback` first")
    result = engine.rollback(site)
    assert sorted(result["restored"]) == sorted(p.target for p in manifest.load(tree.version).patches)
    assert result["message"] == "rolled back; vLLM is pristine again"
    tree.assert_pristine(full=True)
    assert not (site / "vllm/.dsa_overlay").exists() and not (site / "vllm/_dsa_overlay").exists()


def test_leftover_dropin_folder_without_state(tree):
    site = tree.path
    (site / "vllm/_dsa_overlay").mkdir()
    try:
        assert_error(cli("--vllm-site-packages", site),
                     f"{site / 'vllm/_dsa_overlay'} exists but no overlay is recorded as applied (left over from "
                     "a manual copy?); remove it and apply again")
        st = json.loads(cli("status", "--vllm-site-packages", site, "--json").stdout)
        assert st["state"] == "modified (no overlay state)"
    finally:
        (site / "vllm/_dsa_overlay").rmdir()
    tree.assert_pristine()


@pytest.mark.parametrize("damage, message", [
    (lambda t: t[: t.rstrip("\n").rfind("\n") + 1],
     "{diff}: malformed patch (Hunk is shorter than expected); restore it from git or regenerate it"),
    (lambda t: "this is not a diff\n",
     "{diff}: malformed patch (patches 0 files, expected exactly one); regenerate it"),
    (lambda t: t + t,
     "{diff}: malformed patch (patches 2 files, expected exactly one); regenerate it"),
    (lambda t: t.replace("--- a/vllm/", "--- a/../vllm/", 1),
     "{diff}: malformed patch (paths must be a/vllm/... and b/vllm/..., the same file); regenerate it"),
    (lambda t: t.replace("\n ", "\n #", 1),
     "{diff}: hunk 1 ({header}) does not apply to {target}: its context lines differ (zero fuzz); this patch "
     "set does not fit this vLLM build"),
    (lambda t: re.sub(r"^(\+\+\+ b/vllm/\S*)\.py", r"\1_other.py", t, count=1, flags=re.M),  # another file
     "{diff}: malformed patch (paths must be a/vllm/... and b/vllm/..., the same file); regenerate it"),
])
def test_malformed_patch(tree, tmp_path, damage, message):
    copy = repo_copy(tmp_path / "repo")
    entry = manifest.load(tree.version).patches[0]
    rel = entry.diff.relative_to(resources.patches_dir()).as_posix()  # the release's folder or its family's
    diff = copy / "patches" / rel
    text = diff.read_text()
    header = text.split("\n")[2].strip()
    header = header[: header.rindex("@@") + 2]
    diff.write_text(damage(text))
    expected = message.format(diff=f"patches/{rel}", header=header, target=entry.target)
    for args in ([], ["--dry-run"]):
        assert_error(cli("--vllm-site-packages", tree.path, *args, cwd=copy), expected)
    tree.assert_pristine()
    assert not (tree.path / "vllm/.dsa_overlay").exists()


def test_malformed_manifest(tree, tmp_path):
    copy = repo_copy(tmp_path / "repo")
    m = copy / "patches" / tree.version / "manifest.toml"
    text = m.read_text()
    where = f"patches/{tree.version}/manifest.toml"
    first = manifest.load(tree.version).patches[0]
    layers = manifest.family_names(tomllib.loads(text))   # a missing diff is reported in the farthest layer searched
    searched_last = resources.patches_dir() / manifest.FAMILIES / layers[-1] if layers else first.diff.parent
    cases = [
        (text + "[[patch\n", f"{where}: unreadable manifest ("),
        (text.replace('sha256 = "', 'sha256 = "zz', 1),
         f"{where} [[patch]] #1: `sha256` must be 64 lowercase hex digits; regenerate with tools/patchset.py regen"),
        (text.replace('target = "vllm/', 'target = "/etc/', 1),
         f"{where} [[patch]] #1: target '/etc/{first.target.removeprefix('vllm/')}' must be a relative path under "
         "vllm/; fix the manifest"),
        (text.replace('diff = "', 'diff = "missing-', 1),
         f"{where} [[patch]] #1: {resources.display(searched_last)}/missing-{first.diff.name} is missing; "
         "restore it from git"),
        (text.replace(f'vllm = "{tree.version}"', 'vllm = "0.0.1"'),
         f"{where}: `vllm = \"{tree.version}\"` expected (got '0.0.1'); fix the manifest"),
    ]
    if "\nfamily = " in text:
        line = next(l for l in text.splitlines() if l.startswith("family = "))  # a name or a list of layers
        cases += [
            (text.replace(line, 'family = "../x"'),
             f"{where}: `family` must be a folder name under patches/families/ (got '../x'); fix the manifest"),
            (text.replace(line, 'family = "0.0-0.0"'),
             f"{where}: family folder patches/families/0.0-0.0 is missing; restore it from git"),
        ]
    for content, message in cases:
        m.write_text(content)
        proc = cli("--vllm-site-packages", tree.path, cwd=copy)
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: {message}"), proc.stderr
        assert "Traceback" not in proc.stderr
    tree.assert_pristine()


def test_force_version_needs_exact_context(trees):
    assert len(manifest.supported_versions()) >= 2, "several patch sets ship"
    old = manifest.supported_versions()[0]
    t = trees(old)
    # the newest release whose targets all exist in the oldest (hooks far apart; 0.29+ patch a file 0.16 lacks)
    new = next(v for v in reversed(manifest.supported_versions())
               if all((t.path / p.target).is_file() for p in manifest.load(v).patches))
    refusals = []  # what the zero-fuzz apply says of each of new's diffs on old's files (one may still fit)
    for entry in manifest.load(new).patches:
        try:
            hunks.apply((t.path / entry.target).read_bytes(), hunks.parse(entry.diff))
        except UserError as e:
            refusals.append(str(e))
    assert refusals, f"every diff of {new} fits {old}: pick releases whose hooks differ"
    assert_error(cli("--vllm-site-packages", t.path, "--force-version", new), refusals[0])
    t.assert_pristine()


def test_force_version_on_a_relabelled_release_is_recorded(tree):
    """A neighbouring release (here: the same files under another version number, one target shifted by
    five lines): --force-version applies with exact context at an offset and records the override."""
    site, rel = tree.path, _target(tree)
    info = site / f"vllm-{tree.version}.dist-info"
    meta, moved = info / "METADATA", site / "vllm-9.0.0.dist-info"
    original_meta, original = meta.read_bytes(), (site / rel).read_bytes()
    try:
        meta.write_bytes(original_meta.replace(f"Version: {tree.version}".encode(), b"Version: 9.0.0", 1))
        info.rename(moved)
        (site / rel).write_bytes(b"# shifted\n" * 5 + original)
        proc = cli("--vllm-site-packages", site, "--force-version", tree.version)
        assert proc.returncode == 0, proc.stderr
        diff = hunks.parse(next(p for p in manifest.load(tree.version).patches if p.target == rel).diff)
        shifts = [o + 5 for o in hunks.apply(original, diff)[1]]  # a family diff may sit at an offset already
        assert f"patched  {rel}  (hunks shifted by {shifts})" in proc.stdout
        assert "forced onto vLLM 9.0.0 by --force-version" in proc.stdout
        st = json.loads(cli("status", "--vllm-site-packages", site, "--json").stdout)
        assert (st["state"], st["forced_version"], st["vllm_version"]) == ("applied", tree.version, "9.0.0")
        assert cli("--vllm-site-packages", site, "--force-version", tree.version).returncode == 0  # no-op
        assert cli("rollback", "--vllm-site-packages", site).returncode == 0
        assert (site / rel).read_bytes() == b"# shifted\n" * 5 + original
    finally:
        (site / rel).write_bytes(original)
        if moved.exists():
            moved.rename(info)
        meta.write_bytes(original_meta)
    tree.assert_pristine()


def _nobody_can_run(python: str, cwd: Path) -> str | None:
    if os.geteuid() != 0:
        return "not root: cannot switch to an unprivileged user"
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) not available"
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c",
                            "import click, unidiff"], cwd=cwd, capture_output=True, text=True)
    return None if probe.returncode == 0 else f"user nobody cannot run {python}: {probe.stderr.strip()[-200:]}"


def test_unwritable_directory(trees):
    """A real permission problem: the apply runs as user `nobody` on a root-owned tree."""
    version = manifest.supported_versions()[-1]
    pristine = trees(version).pristine
    base = Path(tempfile.mkdtemp(prefix="dsa-unwritable-"))
    try:
        os.chmod(base, 0o755)
        copy = repo_copy(base / "repo")
        site = base / "site"
        rels = [p.target for p in manifest.load(version).patches] + [f"vllm-{version}.dist-info/METADATA"]
        for rel in rels:
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(pristine / rel, site / rel)
        for p in [base, *base.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        reason = _nobody_can_run(sys.executable, copy)
        if reason:
            pytest.skip(reason)
        before = {p: p.read_bytes() for p in site.rglob("*") if p.is_file()}
        target_dir = (site / rels[0]).parent
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                               "apply.py", "--vllm-site-packages", str(site)], cwd=copy, capture_output=True,
                              text=True)
        assert_error(proc, f"{target_dir} is not writable by this user; run as the user that owns this venv "
                           "(nothing was changed)")
        assert {p: p.read_bytes() for p in site.rglob("*") if p.is_file()} == before
        assert stat.S_IMODE(os.stat(site / "vllm").st_mode) == 0o755
    finally:
        shutil.rmtree(base)

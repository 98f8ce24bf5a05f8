"""apply / rollback / status: the transactions on a vLLM site-packages.

apply:    plan in memory (plan.make: targets regular files, no links among their folders) -> lock -> no
          leftover state folder, enough free space and inodes -> state (complete=false) -> backups (hard
          links to the original files; copies where links are impossible) -> patched targets -> drop-ins ->
          stale __pycache__ removed -> state (complete=true). Any failure puts every target back by renaming
          its backup over it (no new space needed, so it works on a full disk), removes every added file and
          folder and the state folder, and names any staging file it could not remove.
rollback: lock -> state checked (shape, every path inside the tree) -> nothing edited since apply ->
          targets from backups (renames) -> drop-ins removed -> every target verified at its original bytes
          -> state folder removed (backups first, state.json last). A rollback that stops or is killed
          anywhere keeps what the next one needs: files already restored or removed count as done.
          Without a state.json (deleted, or an apply killed while writing it) rollback restores only what it
          can prove: a target whose bytes are this patch set applied to its backup (or to the bytes that
          reversing the diff gives, checked against the manifest's pristine sha256).
status:   read-only; compares the tree with the state (or with the pristine hashes when not applied)."""

from __future__ import annotations

import os
from pathlib import Path

from . import fsops, hunks, manifest, plan, state
from .errors import UserError
from .site import vllm_version


# ----------------------------------------------------------------------------------------------- apply
def apply(site: Path, force_version: str | None = None, wait: bool = False, dry_run: bool = False) -> dict:
    vllm_version(site)
    if dry_run:  # read-only: no lock
        current = state.load(site)
        if current is not None:
            return _already_applied(site, current, force_version)
        _refuse_leftover_state(site)
        p = plan.make(site, force_version)
        return {**_describe(p), "action": "dry-run", "changed": False, "diff": p.unified_diff()}
    with fsops.Lock(site / "vllm", wait):  # everything below sees no half-done apply of another process
        current = state.load(site)
        if current is not None:
            return _already_applied(site, current, force_version)
        _refuse_leftover_state(site)
        p = plan.make(site, force_version)
        _check_writable([(site / c.target).parent for c in p.changes]
                        + [site / manifest.DROPIN_ROOT, state.state_dir(site)])
        problem = fsops.space_problem(site / "vllm", *p.space_needed())
        if problem:
            raise UserError(f"{problem}; free some space, then apply again (nothing was changed)")
        _transact(p)
    return {**_describe(p), "action": "apply", "changed": True}


def _refuse_leftover_state(site: Path) -> None:
    if os.path.lexists(state.state_dir(site)):
        raise UserError(
            f"{state.state_dir(site)}: left by an interrupted apply or rollback (it has no state.json); run "
            "`apply.py rollback` first, then apply"
        )


def _transact(p: plan.Plan) -> None:
    site = p.site
    folder = state.state_dir(site)
    try:
        fsops.make_dir(folder)
        state.save(site, p.state(complete=False))
        for c in p.changes:
            backup = state.backup_path(site, c.target)
            fsops.make_dirs(backup.parent, folder)
            fsops.link_or_copy(site / c.target, backup, c.before, c.mode)
        for c in p.changes:
            fsops.write_file(site / c.target, c.after, c.mode)
        for d in p.new_dirs:
            fsops.make_dir(site / d)
        for a in p.adds:
            fsops.write_file(site / a.dest, a.data)
        for c in p.changes:
            fsops.remove_pycache(site / c.target)
        state.save(site, p.state(complete=True))
    except BaseException as exc:
        failure, left = _undo_apply(p)
        if failure:
            also = f"; {', '.join(left)} is left behind" if left else ""
            raise UserError(
                f"apply failed ({_reason(exc)}) and undoing it failed too ({failure}{also}); the backups are kept "
                f"in {folder}: fix the cause and run `apply.py rollback`"
            ) from None
        if left:
            raise UserError(
                f"apply failed ({_reason(exc)}); nothing else was changed, but {', '.join(left)} is left behind; "
                "delete it by hand"
            ) from None
        if isinstance(exc, UserError):
            raise
        if isinstance(exc, OSError):
            raise UserError(f"apply failed ({_reason(exc)}); nothing was changed") from None
        raise


def _undo_apply(p: plan.Plan) -> tuple[str | None, list[str]]:
    """Put back every target that is not at its original bytes (renaming its backup over it: no space
    needed); remove every drop-in and the state folder. Judged from the disk, not from bookkeeping, so a
    call that failed after doing its work is undone too. Returns (what failed, staging files left)."""
    site = p.site
    failures: list[str] = []

    def attempt(fn, *args) -> None:
        try:
            fn(*args)
        except OSError as exc:
            failures.append(_reason(exc))

    for c in reversed(p.changes):
        attempt(_put_back, site, c)
    for a in reversed(p.adds):
        attempt(fsops.remove_file, site / a.dest)
        fsops.remove_pycache(site / a.dest)
    left = _remove_temps([site / c.target for c in p.changes] + [site / a.dest for a in p.adds])
    for d in reversed(p.new_dirs):
        if (site / d).is_dir() and not (site / d).is_symlink():
            attempt(os.rmdir, site / d)
    pristine = all(fsops.file_sha256(site / c.target) == fsops.sha256(c.before) for c in p.changes)
    if pristine and not failures and os.path.lexists(state.state_dir(site)):
        attempt(fsops.remove_tree, state.state_dir(site), "state.json")
    if not pristine and not failures:
        failures.append("a target is not at its original bytes")
    return ("; ".join(failures) or None), left


def _put_back(site: Path, c: plan.Change) -> None:
    path = site / c.target
    fsops.remove_pycache(path)
    if fsops.file_sha256(path) == fsops.sha256(c.before):
        return
    backup = state.backup_path(site, c.target)
    if fsops.file_sha256(backup) == fsops.sha256(c.before):
        fsops.move(backup, path)
    else:  # no backup yet (cannot happen in the order above, but never leave a target patched)
        fsops.write_file(path, c.before, c.mode)


def _remove_temps(paths: list[Path]) -> list[str]:
    """Delete the staging files of `paths` a killed or failed write left; the ones that cannot be removed
    (an append-only folder) as 'PATH (reason)'."""
    left = []
    for path in paths:
        for tmp in fsops.temps_of(path):
            try:
                fsops.remove_file(tmp)
            except OSError as exc:
                left.append(f"{tmp} (cannot remove it: {exc.strerror})")
    return left


def _already_applied(site: Path, current: dict, force_version: str | None) -> dict:
    """A re-apply: a no-op when the recorded apply is intact and is what this patch set would write."""
    info = status(site)
    if info["state"] != "applied":
        edited = info["state"] == "modified after apply"  # plain rollback refuses an edited tree
        undo = "`apply.py rollback --force` first (it discards that edit)" if edited else "`apply.py rollback` first"
        raise UserError(f"{site}: the overlay is {info['state']} ({_first_problem(info)}); run {undo}")
    wanted = force_version or info["vllm_version"]
    backups = {f["path"]: fsops.read_or_none(state.backup_path(site, f["path"])) for f in current["patched"]}
    same = (wanted == current["patch_set"] and None not in backups.values()
            and wanted in manifest.supported_versions()
            and {p.target for p in manifest.load(wanted).patches} == set(backups))
    if same:  # recompute what this patch set writes, from the pristine backups, and compare
        again = plan.make(site, force_version, originals=backups).state(complete=True)
        key = lambda st: ([(f["path"], f["after"]) for f in st["patched"]], st["added"], st["overlay_version"])
        same = key(again) == key(current)
    if not same:
        raise UserError(
            f"{site}: already applied by dsa-overlay {current['overlay_version']} with patch set "
            f"{current['patch_set']}, which differs from this one; run `apply.py rollback` first, then apply"
        )
    return {**info, "action": "apply", "changed": False, "message": "already applied; nothing to do"}


# -------------------------------------------------------------------------------------------- rollback
def rollback(site: Path, force: bool = False, wait: bool = False) -> dict:
    version = vllm_version(site)
    with fsops.Lock(site / "vllm", wait):
        current = state.load(site)
        if current is None:
            return _rollback_without_state(site, version, force)
        return _rollback_locked(site, version, current, force)


def _rollback_locked(site: Path, version: str, current: dict, force: bool) -> dict:
    if current["vllm_version"] != version:
        raise UserError(
            f"{site}: the overlay was applied to vLLM {current['vllm_version']} but vLLM {version} is installed "
            f"now (reinstalled over it?); delete {site / manifest.DROPIN_ROOT} and {state.state_dir(site)} by hand"
        )
    _check_writable([(site / f["path"]).parent for f in current["patched"]]
                    + [site / manifest.DROPIN_ROOT, state.state_dir(site)])
    edited = [f for f in inspect(site, current) if f["status"] in _EDITED]
    if edited and not force:
        f = edited[0]
        raise UserError(
            f"{site / f['path']}: {_EDITED[f['status']]} since apply; save your change elsewhere, then run "
            "`apply.py rollback --force` (which discards it)"
        )
    restore = []
    for f in current["patched"]:
        if fsops.file_sha256(site / f["path"]) != f["before"]:
            backup = state.backup_path(site, f["path"])
            if fsops.file_sha256(backup) != f["before"]:
                raise UserError(
                    f"{backup}: backup missing or not matching the recorded sha256; reinstall with "
                    f"`pip install --force-reinstall --no-deps vllm=={version}` and delete {state.state_dir(site)}"
                )
            restore.append(f["path"])
    try:
        for rel in restore:
            fsops.move(state.backup_path(site, rel), site / rel)
        _clean_temps_or_raise([site / f["path"] for f in current["patched"]])
        for f in current["patched"]:
            fsops.remove_pycache(site / f["path"])
        for f in current["added"]:
            fsops.remove_file(site / f["path"])  # a link is unlinked, never followed
            fsops.remove_pycache(site / f["path"])
        _clean_temps_or_raise([site / f["path"] for f in current["added"]])
        for d in sorted(current["added_dirs"], key=lambda d: -d.count("/")):
            _remove_added_dir(site / d, force)
        _finish(site, {f["path"]: f["before"] for f in current["patched"]})
    except OSError as exc:
        raise UserError(
            f"rollback stopped ({_reason(exc)}); the overlay state is kept: fix the cause and run "
            "`apply.py rollback` again to finish"
        ) from None
    return {"action": "rollback", "site": str(site), "changed": True, "vllm_version": version,
            "restored": restore, "removed": [f["path"] for f in current["added"]],
            "message": "rolled back; vLLM is pristine again"}


def _clean_temps_or_raise(paths: list[Path]) -> None:
    left = _remove_temps(paths)
    if left:
        raise OSError(f"{left[0]}")


def _remove_added_dir(path: Path, force: bool) -> None:
    if not path.is_dir() or path.is_symlink():
        return
    if (path / "__pycache__").is_dir() and not (path / "__pycache__").is_symlink():
        fsops.remove_tree(path / "__pycache__")
    fsops.remove_tree(path) if force else os.rmdir(path)


def _finish(site: Path, expected: dict[str, str]) -> None:
    """Delete the state folder once every target is verified at its original bytes (backups first,
    state.json last, so a kill in between leaves a state that the next rollback completes)."""
    for rel, sha in expected.items():
        if fsops.file_sha256(site / rel) != sha:
            raise OSError(f"{site / rel}: not at its original bytes after restoring")
    if os.path.lexists(state.state_dir(site)):
        fsops.remove_tree(state.state_dir(site), keep_last="state.json")


_EDITED = {"modified": "edited", "not a file": "replaced by a link, folder or device",
           "unexpected": "added to the overlay's folder"}


# ---------------------------------------------------------------------------- rollback without a state
def _rollback_without_state(site: Path, version: str, force: bool) -> dict:
    """No state.json. Restore only what can be proven: a target whose bytes are a supported patch set
    applied to its backup, or to the bytes that reversing the diff gives when those match the manifest's
    pristine sha256. Everything is judged before anything is changed; what cannot be proven is refused."""
    folder = state.state_dir(site)
    root = site / manifest.DROPIN_ROOT
    sets = _sets_for(version)
    pristine_sha = {p.target: p.sha256 for p in sets[0].patches} if sets and sets[0].version == version else {}
    diffs: dict[str, list[hunks.FileDiff]] = {}
    for ps in sets:
        for p in ps.patches:
            diffs.setdefault(p.target, []).append(hunks.parse(p.diff))
    backups = _backups(site, set(diffs))
    moves, writes, refused = [], [], []
    expected = dict(pristine_sha)  # target -> the sha256 it must have when done
    for rel, ds in diffs.items():
        path, backup = site / rel, backups.get(rel)
        cur, cur_sha = fsops.read_or_none(path), fsops.file_sha256(path)
        saved = fsops.read_or_none(backup) if backup else None
        verified = saved is not None and fsops.sha256(saved) == pristine_sha.get(rel)
        if cur_sha is not None and (cur_sha == pristine_sha.get(rel) or (saved is not None and cur == saved)):
            continue  # at its original bytes
        if saved is not None and (verified and (cur_sha is None or force)
                                  or cur is not None and any(_forward(saved, d) == cur for d in ds)):
            moves.append(rel)  # what apply wrote over this backup (or gone, or --force)
            expected[rel] = fsops.sha256(saved)
            continue
        undone = _reverse(cur, ds[0]) if cur is not None and rel in pristine_sha else None
        if undone is not None and fsops.sha256(undone) == pristine_sha[rel] and _forward(undone, ds[0]) == cur:
            writes.append((rel, undone))  # our patch on the pristine file; its backup is gone
            continue
        if rel in pristine_sha or saved is not None or (cur is not None and any(_reverse(cur, d) for d in ds)):
            refused.append((rel, verified))
    evidence = os.path.lexists(folder) or os.path.lexists(root) or moves or writes
    if not evidence:
        return {"action": "rollback", "site": str(site), "changed": False, "restored": [], "removed": [],
                "message": "no overlay applied here; nothing to roll back"}
    if refused:
        rel, has_backup = refused[0]
        if has_backup:
            raise UserError(
                f"{site / rel}: edited since apply and the overlay's state.json is gone; save your change "
                "elsewhere, then run `apply.py rollback --force` (which restores the backup verified against "
                "the patch set)"
            )
        raise UserError(
            f"{site / rel}: cannot be proven pristine or patched by dsa-overlay without the overlay's state.json; "
            f"reinstall with `pip install --force-reinstall --no-deps vllm=={version}`, then delete "
            f"{folder} and {root}"
        )
    ours, foreign = _dropins_found(root, sets)
    if foreign and not force:
        raise UserError(
            f"{foreign[0]}: in {root} but not a file this dsa-overlay writes (edited, or from another version), "
            f"and the overlay's state.json is gone; save it elsewhere, then run `apply.py rollback --force` "
            f"(which removes {root})"
        )
    _check_writable([(site / rel).parent for rel in moves + [r for r, _ in writes]] + [root, folder])
    try:
        for rel in moves:
            fsops.move(backups[rel], site / rel)
        for rel, data in writes:
            fsops.write_file(site / rel, data, (site / rel).lstat().st_mode & 0o7777)
        _clean_temps_or_raise([site / rel for rel in diffs])
        for rel in moves + [r for r, _ in writes]:
            fsops.remove_pycache(site / rel)
        if os.path.lexists(root):
            fsops.remove_tree(root)
        _finish(site, expected)
    except OSError as exc:
        raise UserError(
            f"rollback stopped ({_reason(exc)}); the backups are kept in {folder}: fix the cause and run "
            "`apply.py rollback` again to finish"
        ) from None
    restored = sorted(moves + [r for r, _ in writes])
    if restored or ours or foreign:
        message = "rolled back without state.json (every restored file was verified); vLLM is pristine again"
    else:
        message = "removed the state folder of an interrupted apply or rollback (every file was already pristine)"
    return {"action": "rollback", "site": str(site), "changed": True, "vllm_version": version,
            "restored": restored, "removed": [str(p.relative_to(site)) for p in ours + foreign],
            "message": message}


def _sets_for(version: str) -> list[manifest.PatchSet]:
    """The patch set of the installed release; for a release without one (an apply with --force-version),
    every supported set."""
    supported = manifest.supported_versions()
    return [manifest.load(version)] if version in supported else [manifest.load(v) for v in supported]


def _backups(site: Path, targets: set[str]) -> dict[str, Path]:
    """The backups in the state folder, by target; refuses a link or a file that backs up no target."""
    top = state.state_dir(site) / "backup"
    found = {}
    if not top.is_dir() or top.is_symlink():
        return found
    for dirpath, dirnames, filenames in os.walk(top):  # does not descend into linked folders
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(top))
            if p.is_symlink() or (name in filenames and not p.is_file()):
                raise UserError(f"{p}: a link or special file among the overlay's backups; remove it, then run "
                                "`apply.py rollback` again (nothing was changed)")
            if name in filenames and not fsops.is_temp(p):
                if rel not in targets:
                    raise UserError(
                        f"{p}: a backup of {rel}, which no supported patch set patches, so dsa-overlay cannot verify "
                        f"it; if {site / rel} is patched put this file back there by hand, then delete the backup and "
                        "run `apply.py rollback` again (nothing was changed)"
                    )
                found[rel] = p
    return found


def _dropins_found(root: Path, sets: list[manifest.PatchSet]) -> tuple[list[Path], list[Path]]:
    """Files under the drop-in folder: (written by this dsa-overlay, anything else). __pycache__ and
    staging files are neither."""
    if root.is_symlink():
        raise UserError(f"{root}: is a symbolic link, which dsa-overlay never creates; remove the link, then run "
                        "`apply.py rollback` again (nothing was changed)")
    if not root.is_dir():
        return [], []
    wanted = {d.dest: d.src for ps in sets for d in ps.dropins}
    ours, foreign = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" or (Path(dirpath) / d).is_symlink()]
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root.parent.parent))
            if fsops.is_temp(p) and not p.is_symlink():
                continue
            src = wanted.get(rel)
            mine = src is not None and fsops.file_sha256(p) == fsops.file_sha256(src)
            (ours if mine else foreign).append(p)
    return sorted(ours), sorted(foreign)


def _forward(data: bytes, diff: hunks.FileDiff) -> bytes | None:
    try:
        return hunks.apply(data, diff)[0]
    except UserError:
        return None


def _reverse(data: bytes, diff: hunks.FileDiff) -> bytes | None:
    return _forward(data, plan.reverse(diff))


# ---------------------------------------------------------------------------------------------- status
def inspect(site: Path, current: dict) -> list[dict]:
    """Per file: patched (at the bytes apply wrote), pristine (at its original bytes), missing, modified,
    not a file (a link, folder or device in its place), added (a drop-in as written), unexpected (a file in
    a drop-in folder that apply did not write)."""
    files = []
    for f in current["patched"]:
        h = fsops.file_sha256(site / f["path"])
        st = {f["after"]: "patched", f["before"]: "pristine", None: "missing",
              fsops.NOT_A_FILE: "not a file"}.get(h, "modified")
        files.append({"path": f["path"], "kind": "patched", "status": st})
    known = set()
    for f in current["added"]:
        h = fsops.file_sha256(site / f["path"])
        st = {f["sha256"]: "added", None: "missing" if current["complete"] else "not added yet",
              fsops.NOT_A_FILE: "not a file"}.get(h, "modified")
        files.append({"path": f["path"], "kind": "added", "status": st})
        known.add(f["path"])
    for d in current["added_dirs"]:
        if (site / d).is_symlink():
            continue
        for child in sorted((site / d).glob("*")):
            rel = str(child.relative_to(site))
            if child.name == "__pycache__" or rel in known or rel in current["added_dirs"] or fsops.is_temp(child):
                continue
            files.append({"path": rel, "kind": "unknown", "status": "unexpected"})
    return files


def status(site: Path) -> dict:
    version = vllm_version(site)
    supported = manifest.supported_versions()
    info = {"action": "status", "site": str(site), "vllm_version": version, "supported": version in supported,
            "supported_versions": supported}
    current = state.load(site)
    if current is not None:
        files = inspect(site, current)
        seen = {f["status"] for f in files}
        if seen & set(_EDITED):
            overall = "modified after apply"
        elif current["complete"] and seen <= {"patched", "added"}:
            overall = "applied"
        else:  # an apply or a rollback that did not finish
            overall = "partially applied"
        return {**info, "state": overall, "overlay_version": current["overlay_version"],
                "patch_set": current["patch_set"], "forced_version": current["forced_version"], "files": files}
    if version not in supported:
        return {**info, "state": "not applied", "files": []}
    ps = manifest.load(version)
    files = []
    for p in ps.patches:
        h = fsops.file_sha256(site / p.target)
        st = "pristine" if h == p.sha256 else "missing" if h is None else "differs from pristine"
        files.append({"path": p.target, "kind": "target", "status": st})
    if os.path.lexists(site / manifest.DROPIN_ROOT):
        files.append({"path": manifest.DROPIN_ROOT, "kind": "unknown", "status": "unexpected"})
    overall = "pristine" if all(f["status"] == "pristine" for f in files) else "modified (no overlay state)"
    if os.path.lexists(state.state_dir(site)):  # an apply under way, or one killed before it changed any file
        overall = "partially applied"
    return {**info, "state": overall, "files": files}


# ------------------------------------------------------------------------------------------------ util
def _describe(p: plan.Plan) -> dict:
    return {
        "site": str(p.site), "vllm_version": p.vllm_version, "patch_set": p.patch_set,
        "forced_version": p.patch_set if p.forced else None,
        "patched": [{"path": c.target, "offsets": list(c.offsets)} for c in p.changes],
        "added": [a.dest for a in p.adds],
    }


def _check_writable(dirs: list[Path]) -> None:
    for d in dirs:
        problem = fsops.writable_problem(d)
        if problem:
            raise UserError(f"{problem}; run as the user that owns this venv (nothing was changed)")


def _first_problem(info: dict) -> str:
    bad = [f for f in info["files"] if f["status"] not in ("patched", "added")]
    return f"{bad[0]['path']}: {bad[0]['status']}" if bad else "interrupted apply"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc) or type(exc).__name__

"""apply / rollback / status: the transactions on a vLLM site-packages.

apply:    plan in memory (plan.make) -> lock -> backups -> state (complete=false) -> patched targets ->
          drop-ins -> stale __pycache__ removed -> state (complete=true). Any failure restores every
          target to its original bytes, removes every added file/folder and the state folder.
rollback: lock -> check nothing was edited since apply -> targets from backups -> drop-ins removed ->
          state folder removed. A rollback that stops half-way keeps the state; running it again resumes.
status:   read-only; compares the tree with the state (or with the pristine hashes when not applied)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import fsops, manifest, plan, state
from .errors import UserError
from .site import vllm_version


# ----------------------------------------------------------------------------------------------- apply
def apply(site: Path, force_version: str | None = None, wait: bool = False, dry_run: bool = False) -> dict:
    vllm_version(site)
    if dry_run:  # read-only: no lock
        current = state.load(site)
        if current is not None:
            return _already_applied(site, current, force_version)
        p = plan.make(site, force_version)
        return {**_describe(p), "action": "dry-run", "changed": False, "diff": p.unified_diff()}
    with fsops.Lock(site / "vllm", wait):  # everything below sees no half-done apply of another process
        current = state.load(site)
        if current is not None:
            return _already_applied(site, current, force_version)
        p = plan.make(site, force_version)
        _check_writable([(site / c.target).parent for c in p.changes]
                        + [site / manifest.DROPIN_ROOT, state.state_dir(site)])
        _transact(p)
    return {**_describe(p), "action": "apply", "changed": True}


def _transact(p: plan.Plan) -> None:
    site = p.site
    try:
        state.state_dir(site).mkdir(exist_ok=True)
        for c in p.changes:
            backup = state.backup_path(site, c.target)
            backup.parent.mkdir(parents=True, exist_ok=True)
            fsops.write_file(backup, c.before)
        state.save(site, p.state(complete=False))
        for c in p.changes:
            fsops.write_file(site / c.target, c.after, c.mode)
        for d in p.new_dirs:
            os.mkdir(site / d, 0o755)
        for a in p.adds:
            fsops.write_file(site / a.dest, a.data)
        for c in p.changes:
            fsops.remove_pycache(site / c.target)
        state.save(site, p.state(complete=True))
    except BaseException as exc:
        failure = _undo_apply(p)
        if failure:
            raise UserError(
                f"apply failed ({_reason(exc)}) and undoing it failed too ({failure}); the backups are kept in "
                f"{state.state_dir(site)}: fix the cause and run `apply.py rollback`"
            ) from None
        if isinstance(exc, UserError):
            raise
        if isinstance(exc, OSError):
            raise UserError(f"apply failed ({_reason(exc)}); nothing was changed") from None
        raise


def _undo_apply(p: plan.Plan) -> str | None:
    """Put back every target that is not at its original bytes; remove every drop-in. Judged from the
    disk, not from bookkeeping, so a write that failed after replacing its file is undone too."""
    site = p.site
    try:
        for c in reversed(p.changes):
            path = site / c.target
            if fsops.file_sha256(path) != fsops.sha256(c.before):
                fsops.write_file(path, c.before, c.mode)
            fsops.remove_pycache(path)
        for a in reversed(p.adds):
            fsops.remove_file(site / a.dest)
            fsops.remove_pycache(site / a.dest)
        for d in reversed(p.new_dirs):
            if (site / d).is_dir():
                os.rmdir(site / d)
        _remove_state_dir(site)
    except OSError as exc:
        return _reason(exc)
    return None


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
        return _rollback_locked(site, version, force)


def _rollback_locked(site: Path, version: str, force: bool) -> dict:
    current = state.load(site)
    if current is None:  # nothing applied; maybe the state folder of an apply killed before any change
        if state.state_dir(site).exists():
            _check_writable([state.state_dir(site)])
        return _nothing_applied(site, cleaned=_remove_state_dir(site))
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
    restore = {}
    for f in current["patched"]:
        if fsops.file_sha256(site / f["path"]) != f["before"]:
            backup = state.backup_path(site, f["path"])
            data = fsops.read_or_none(backup)
            if data is None or fsops.sha256(data) != f["before"]:
                raise UserError(
                    f"{backup}: backup missing or not matching the recorded sha256; reinstall with "
                    f"`pip install --force-reinstall --no-deps vllm=={version}` and delete {state.state_dir(site)}"
                )
            restore[f["path"]] = (data, f["mode"])
    try:
        for rel, (data, mode) in restore.items():
            fsops.write_file(site / rel, data, mode)
        for f in current["patched"]:
            fsops.remove_pycache(site / f["path"])
            fsops.remove_file(fsops.temp_path(site / f["path"]))  # left by a process killed mid-write
        for f in current["added"]:
            fsops.remove_file(site / f["path"])
            fsops.remove_file(fsops.temp_path(site / f["path"]))
            fsops.remove_pycache(site / f["path"])
        for d in sorted(current["added_dirs"], key=lambda d: -d.count("/")):
            path = site / d
            if path.is_dir():
                shutil.rmtree(path / "__pycache__", ignore_errors=True)
                shutil.rmtree(path) if force else os.rmdir(path)
        _remove_state_dir(site)
    except OSError as exc:
        raise UserError(
            f"rollback stopped ({_reason(exc)}); the overlay state is kept: fix the cause and run "
            "`apply.py rollback` again to finish"
        ) from None
    return {"action": "rollback", "site": str(site), "changed": True, "vllm_version": version,
            "restored": sorted(restore), "removed": [f["path"] for f in current["added"]],
            "message": "rolled back; vLLM is pristine again"}


def _nothing_applied(site: Path, cleaned: bool) -> dict:
    message = ("removed the state folder of an interrupted apply (no file had been changed)" if cleaned
               else "no overlay applied here; nothing to roll back")
    return {"action": "rollback", "site": str(site), "changed": cleaned, "restored": [], "removed": [],
            "message": message}


_EDITED = {"modified": "edited", "missing": "deleted", "unexpected": "added to the overlay's folder"}


# ---------------------------------------------------------------------------------------------- status
def inspect(site: Path, current: dict) -> list[dict]:
    """Per file: patched (at the bytes apply wrote), pristine (at its original bytes), modified, missing,
    added (a drop-in as written), unexpected (a file in a drop-in folder that apply did not write)."""
    files = []
    for f in current["patched"]:
        h = fsops.file_sha256(site / f["path"])
        st = {f["after"]: "patched", f["before"]: "pristine", None: "missing"}.get(h, "modified")
        files.append({"path": f["path"], "kind": "patched", "status": st})
    known = set()
    for f in current["added"]:
        h = fsops.file_sha256(site / f["path"])
        st = {f["sha256"]: "added", None: "missing" if current["complete"] else "not added yet"}.get(h, "modified")
        files.append({"path": f["path"], "kind": "added", "status": st})
        known.add(f["path"])
    for d in current["added_dirs"]:
        for child in sorted((site / d).glob("*")):
            rel = str(child.relative_to(site))
            if child.name == "__pycache__" or rel in known or rel in current["added_dirs"] or _is_temp(child):
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
        if seen & {"modified", "missing", "unexpected"}:
            overall = "modified after apply"
        elif current["complete"] and seen <= {"patched", "added"}:
            overall = "applied"
        else:
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
    if (site / manifest.DROPIN_ROOT).exists():
        files.append({"path": manifest.DROPIN_ROOT, "kind": "unknown", "status": "unexpected"})
    overall = "pristine" if all(f["status"] == "pristine" for f in files) else "modified (no overlay state)"
    if state.state_dir(site).is_dir():  # an apply under way, or one killed before it changed any file
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


def _remove_state_dir(site: Path) -> bool:
    """Delete vllm/.dsa_overlay/ (call with the lock held); whether there was one."""
    if not state.state_dir(site).exists():
        return False
    shutil.rmtree(state.state_dir(site))
    return True


def _is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".dsa-overlay-tmp")


def _first_problem(info: dict) -> str:
    bad = [f for f in info["files"] if f["status"] not in ("patched", "added")]
    return f"{bad[0]['path']}: {bad[0]['status']}" if bad else "interrupted apply"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc) or type(exc).__name__

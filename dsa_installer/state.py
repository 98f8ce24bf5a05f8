"""The engine's record of an apply, kept in `<site-packages>/vllm/.dsa_overlay/state.json`.

    {"format": 1, "overlay_version": "0.1.0", "vllm_version": "0.23.0", "patch_set": "0.23.0",
     "forced_version": null, "complete": true,
     "patched": [{"path": "vllm/...", "before": sha256, "after": sha256, "mode": 420}],
     "added":   [{"path": "vllm/_dsa_overlay/...", "sha256": sha256}],
     "added_dirs": ["vllm/_dsa_overlay", ...]}

`complete` is false while an apply is under way: a state found that way was interrupted (the process
was killed) and `rollback` finishes the job from the backups in `backup/` (hard links to the original
files where the file system allows).

A state is trusted only after `load` has checked its shape and that every path in it stays inside the
tree: patched files under `vllm/` (outside the overlay's own folders), added files and folders under
`vllm/_dsa_overlay/`, no `..`, no absolute paths, no link among the folders leading to them."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath

from . import fsops
from .errors import UserError
from .manifest import DROPIN_ROOT
from .site import VERSION

STATE_DIR = "vllm/.dsa_overlay"
FORMAT = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


def state_dir(site: Path) -> Path:
    return site / STATE_DIR


def state_file(site: Path) -> Path:
    return state_dir(site) / "state.json"


def backup_path(site: Path, target: str) -> Path:
    return state_dir(site) / "backup" / target


def check_state_dir(site: Path) -> None:
    """Refuse a state folder that is a link (its contents would live outside the tree) or not a folder."""
    d = state_dir(site)
    if d.is_symlink():
        raise UserError(
            f"{d}: is a symbolic link; dsa-overlay keeps its state only in a real folder inside vllm/: if it "
            f"points to the state of an earlier apply, move that folder here in its place, else remove the link "
            f"(nothing was changed)"
        )
    if d.exists() and not d.is_dir():
        raise UserError(f"{d}: is not a folder; remove it (nothing was changed)")


def load(site: Path) -> dict | None:
    """The recorded state, checked; None when there is no state.json."""
    check_state_dir(site)
    path = state_file(site)
    try:
        data = fsops.read_regular(path)
    except OSError as exc:
        raise UserError(f"{path}: unreadable overlay state ({exc.strerror}); {_RECOVER.format(path=path)}") from None
    if data is None:
        return None
    try:
        state = json.loads(data.decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise UserError(f"{path}: unreadable overlay state ({_one_line(exc)}); {_RECOVER.format(path=path)}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path}: overlay state of an unknown format; use the dsa-overlay version that applied it")
    problem = _problem(state)
    if problem:
        raise UserError(f"{path}: damaged overlay state ({problem}); {_RECOVER.format(path=path)}")
    folders = [str(PurePosixPath(f["path"]).parent) for f in state["patched"] + state["added"]]
    for rel in folders + state["added_dirs"]:  # a linked file itself is reported by status as "not a file"
        link = fsops.first_link(site, rel)
        if link is not None:
            raise UserError(
                f"{link}: is a symbolic link, which dsa-overlay never creates; remove it (or put the real folder "
                f"or file back), then run the command again (nothing was changed)"
            )
    return state


_RECOVER = ("nothing was changed; move it away and run `apply.py rollback`, which then restores vLLM from the "
            "backups it can verify against the patch set")


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _problem(state: dict) -> str | None:
    """What is wrong with a format-1 state, or None."""
    for key, kinds in (("overlay_version", str), ("vllm_version", str), ("patch_set", str), ("complete", bool),
                       ("forced_version", (str, type(None))), ("patched", list), ("added", list),
                       ("added_dirs", list)):
        if not isinstance(state.get(key), kinds):
            return f"`{key}` missing or of the wrong type"
    for key in ("vllm_version", "patch_set", "forced_version"):
        if state[key] is not None and not VERSION.fullmatch(state[key]):
            return f"`{key}` {state[key][:80]!r} is not a version"
    for f in state["patched"]:
        if not (isinstance(f, dict) and _inside(f.get("path"), "vllm", exclude=(STATE_DIR, DROPIN_ROOT))
                and _sha(f.get("before")) and _sha(f.get("after")) and isinstance(f.get("mode"), int)
                and not isinstance(f.get("mode"), bool) and 0 <= f["mode"] <= 0o7777):
            return f"patched entry {_show(f)}: needs a path under vllm/ (outside its .dsa_overlay and _dsa_overlay), sha256s and a mode"
    for f in state["added"]:
        if not (isinstance(f, dict) and _inside(f.get("path"), DROPIN_ROOT, strict=True) and _sha(f.get("sha256"))):
            return f"added entry {_show(f)}: needs a path under {DROPIN_ROOT}/ and a sha256"
    for d in state["added_dirs"]:
        if not _inside(d, DROPIN_ROOT):
            return f"added folder {_show(d)}: must be {DROPIN_ROOT} or a folder under it"
    return None


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _sha(value: object) -> bool:
    return isinstance(value, str) and bool(_SHA256.fullmatch(value))


def _inside(value: object, under: str, strict: bool = False, exclude: tuple[str, ...] = ()) -> bool:
    """`value` is a canonical relative POSIX path at or below `under` (strictly below with `strict`),
    not at or below any of `exclude`."""
    if not isinstance(value, str) or not value or "\0" in value or "\\" in value:
        return False
    p = PurePosixPath(value)
    if p.is_absolute() or str(p) != value or any(part in ("..", ".") for part in p.parts):
        return False
    base = PurePosixPath(under).parts
    if p.parts[: len(base)] != base or len(p.parts) < len(base) + (1 if strict else 0):
        return False
    if under == "vllm" and len(p.parts) < 2:
        return False
    return not any(p.parts[: len(PurePosixPath(x).parts)] == PurePosixPath(x).parts for x in exclude)


def save(site: Path, state: dict) -> None:
    data = (json.dumps(state, indent=1, sort_keys=True) + "\n").encode()
    fsops.write_file(state_file(site), data)

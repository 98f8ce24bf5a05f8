"""Everything an apply would do, computed in memory before a single byte is written.

`make()` reads the manifest, parses every diff, checks every target against its pristine sha256 and
applies every hunk; any refusal is raised here, while nothing has been touched."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

from . import __version__, fsops, hunks, manifest, resources
from .errors import UserError
from .site import vllm_version


@dataclass(frozen=True)
class Change:
    target: str
    before: bytes
    after: bytes
    mode: int
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class Add:
    dest: str
    data: bytes
    src: Path


@dataclass(frozen=True)
class Plan:
    site: Path
    vllm_version: str
    patch_set: str
    forced: bool
    changes: tuple[Change, ...]
    adds: tuple[Add, ...]
    new_dirs: tuple[str, ...]   # drop-in folders that do not exist yet, parents first

    def state(self, complete: bool) -> dict:
        return {
            "format": 1,
            "overlay_version": __version__,
            "vllm_version": self.vllm_version,
            "patch_set": self.patch_set,
            "forced_version": self.patch_set if self.forced else None,
            "complete": complete,
            "patched": [
                {"path": c.target, "before": fsops.sha256(c.before), "after": fsops.sha256(c.after), "mode": c.mode}
                for c in self.changes
            ],
            "added": [{"path": a.dest, "sha256": fsops.sha256(a.data)} for a in self.adds],
            "added_dirs": list(self.new_dirs),
        }

    def space_needed(self) -> tuple[int, int]:
        """(bytes, inodes) an apply may allocate at most: every new file and staging file, backups as copies
        (where hard links are not possible), two states, a 4 KiB block per file and folder, 1 MiB margin."""
        files = ([c.after for c in self.changes] + [c.before for c in self.changes] + [a.data for a in self.adds]
                 + [b"x" * 16384] * 2)
        folders = len(self.new_dirs) + len({Path(c.target).parent for c in self.changes}) + 3
        need = sum(len(d) + 4096 for d in files) + 4096 * folders + 2**20
        return need, len(files) + folders + 16

    def unified_diff(self) -> str:
        return "".join(hunks.make_diff(c.before, c.after, c.target) for c in self.changes)


def supported_message() -> str:
    return ", ".join(manifest.supported_versions()) or "none"


def make(site: Path, force_version: str | None = None, originals: dict[str, bytes] | None = None) -> Plan:
    """The plan for `site`. `originals` (target -> bytes) replaces reading targets from disk: used to
    recompute what an earlier apply wrote, from its backups."""
    version = vllm_version(site)
    supported = manifest.supported_versions()
    wanted = force_version or version
    if wanted not in supported:
        if force_version:
            raise UserError(f"--force-version {force_version}: no such patch set (supported: {supported_message()})")
        raise UserError(
            f"vLLM {version} at {site} has no patch set (supported: {supported_message()}); install a supported "
            f"release, or try a neighbouring set with --force-version"
        )
    forced = wanted != version
    ps = manifest.load(wanted)
    changes = [_change(site, ps, p, forced, originals) for p in ps.patches]
    root = site / manifest.DROPIN_ROOT
    if originals is None and ps.dropins and (root.exists() or root.is_symlink()):
        raise UserError(
            f"{root} exists but no overlay is recorded as applied (left over from a manual copy?); "
            "remove it and apply again"
        )
    adds = [_add(d) for d in ps.dropins]
    top = Path(manifest.DROPIN_ROOT)
    dirs = {p for a in adds for p in Path(a.dest).parents if p == top or top in p.parents}
    new_dirs = tuple(str(p) for p in sorted(dirs, key=lambda p: (len(p.parts), str(p))))
    return Plan(site, version, wanted, forced, tuple(changes), tuple(adds), new_dirs)


def _change(site: Path, ps: manifest.PatchSet, p: manifest.Patch, forced: bool, originals) -> Change:
    diff = hunks.parse(p.diff)
    if diff.target != p.target:
        raise UserError(
            f"{resources.display(p.diff)}: patches {diff.target} but {resources.display(ps.manifest)} says "
            f"{p.target}; fix the manifest"
        )
    path = site / p.target
    if originals is not None:
        before, mode = originals[p.target], 0o644
    else:
        link = fsops.first_link(site, p.target)
        if link is not None:
            raise UserError(
                f"{link}: is a symbolic link; dsa-overlay patches only regular files inside vllm/ (it would "
                f"otherwise replace the link by a file): reinstall with "
                f"`pip install --force-reinstall --no-deps vllm=={ps.version}` (nothing was changed)"
            )
        try:
            before, mode = fsops.read_regular(path), path.lstat().st_mode & 0o7777
            if before is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory")
        except OSError as exc:
            raise UserError(f"{path}: cannot read ({exc.strerror}); reinstall vllm=={ps.version}") from None
        if not forced and fsops.sha256(before) != p.sha256:
            raise UserError(
                f"{path}: differs from pristine vLLM {ps.version} (sha256 {fsops.sha256(before)[:12]}..., expected "
                f"{p.sha256[:12]}...): edited, or another build; reinstall with "
                f"`pip install --force-reinstall --no-deps vllm=={ps.version}`"
            )
    after, offsets = hunks.apply(before, diff)
    return Change(p.target, before, after, mode, tuple(offsets))


def reverse(diff: hunks.FileDiff) -> hunks.FileDiff:
    """The diff that undoes `diff` (each hunk's sides swapped, placed where the forward diff put it)."""
    out, shift = [], 0
    for h in diff.hunks:
        out.append(hunks.Hunk(h.header, h.start + shift, h.new, h.old))
        shift += len(h.new) - len(h.old)
    return hunks.FileDiff(diff.path, diff.target, tuple(out))


def _add(d: manifest.Dropin) -> Add:
    try:
        return Add(d.dest, d.src.read_bytes(), d.src)
    except OSError as exc:
        raise UserError(f"{resources.display(d.src)}: cannot read drop-in ({exc.strerror}); restore it from git") from None

"""Patch-set manifests: `patches/<version>/manifest.toml` plus the shared `patches/common.toml`.

    vllm = "0.23.0"
    [[patch]]                 # applied in this order, one diff per target file
    diff = "config.diff"      # beside the manifest; paths a/vllm/... b/vllm/...
    target = "vllm/transformers_utils/config.py"
    sha256 = "<sha256 of the pristine target>"
    [[dropin]]                # src relative to this folder (common.toml: to the repository root);
    src = "x.py"              # a directory drops in its *.py files
    dest = "vllm/_dsa_overlay/x.py"

Releases that share hook points form a family: `family = "0.20-0.23"` beside `vllm = ...` makes each
[[patch]] `diff` resolve to the release folder's file when it has one (a per-release override) and
otherwise to `patches/families/<family>/<diff>` (the shared hunks). Families layer: `family = ["0.18",
"0.17-0.18"]` names several folders, nearest first, and a diff resolves to the first that holds it (a
sub-family such as 0.18.0-0.18.1 keeps its shared overrides once). The [[patch]] list and every
`sha256` stay per release (pristine bytes differ even where the hunks are the same); the guarantees
do not change: pristine hash check, zero-fuzz hunks, exact version match.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from . import resources
from .errors import UserError

DROPIN_ROOT = "vllm/_dsa_overlay"
FAMILIES = "families"  # patches/families/<name>/: diffs shared by the releases whose manifest names <name>
# Releases that get a real `pip install vllm==X` venv in CI (.ci/run, tests/vllm_envs.py), at least one per
# family (tests/engine/test_patch_sets.py checks it; 0.20.0 for the 0.20-0.23 family's shared hunks, 0.23.0 for
# its overrides; 0.28.0 for the 0.26 family's torch-2.13 releases; 0.31.0 for 0.29-0.31, 0.33.0 for 0.32-0.33 and
# 0.33's own indexer diff); every supported release gets the pristine-wheel tests whether or not it is listed here.
# A release listed before its patch set ships fails its real-venv tests. .ci/run deletes cached venvs of releases
# no longer listed (the cache budget).
VENV_RELEASES = ("0.16.0", "0.18.1", "0.19.1", "0.20.0", "0.23.0", "0.25.1", "0.26.0", "0.28.0", "0.31.0", "0.33.0")
# Venvs that get another torch than the release pins: 0.33.0 pins torch 2.14.0, which PyPI serves only as a CUDA
# build (~5.5 GB with its CUDA libraries, over the CI cache budget); CI machines serve torch 2.13.0's CPU build from
# disk, and the CPU tests run no torch CUDA code. .ci/run installs vLLM without dependencies, then its
# requirements with this torch in the pinned one's place.
VENV_TORCH_SUBSTITUTE = {"0.33.0": "2.13.0"}
_FAMILY = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Patch:
    diff: Path      # the .diff file
    target: str     # "vllm/..." relative to site-packages
    sha256: str     # of the pristine target


@dataclass(frozen=True)
class Dropin:
    src: Path       # a file to copy
    dest: str       # "vllm/_dsa_overlay/..." relative to site-packages


@dataclass(frozen=True)
class PatchSet:
    version: str
    manifest: Path
    patches: tuple[Patch, ...]
    dropins: tuple[Dropin, ...]


def supported_versions() -> list[str]:
    root = resources.patches_dir()
    found = [p.parent.name for p in root.glob("*/manifest.toml")]
    return sorted(found, key=lambda v: tuple(int(x) if x.isdigit() else x for x in v.split(".")))


def load(version: str) -> PatchSet:
    """The patch set for `version` (with common drop-ins appended); UserError if absent or malformed."""
    manifest = resources.patches_dir() / version / "manifest.toml"
    if not manifest.is_file():
        raise UserError(f"no patch set for vLLM {version} (supported: {', '.join(supported_versions()) or 'none'})")
    data = _read_toml(manifest)
    where = resources.display(manifest)
    if data.get("vllm") != version:
        raise UserError(f"{where}: `vllm = \"{version}\"` expected (got {data.get('vllm')!r}); fix the manifest")
    families = _families(data, where)
    patches = tuple(_patch(manifest, i, entry, families) for i, entry in enumerate(_tables(data, "patch", where), 1))
    targets = [p.target for p in patches]
    dup = {t for t in targets if targets.count(t) > 1}
    if dup:
        raise UserError(f"{where}: several [[patch]] entries for {sorted(dup)[0]}; keep one diff per target file")
    dropins = [d for e in _tables(data, "dropin", where) for d in _dropins(manifest.parent, e, where)]
    common = resources.patches_dir() / "common.toml"
    if common.is_file():
        cdata = _read_toml(common)
        cwhere = resources.display(common)
        dropins += [d for e in _tables(cdata, "dropin", cwhere) for d in _dropins(None, e, cwhere)]
    dests = [d.dest for d in dropins]
    dup = {d for d in dests if dests.count(d) > 1}
    if dup:
        raise UserError(f"{where}: {sorted(dup)[0]} is dropped in twice (manifest and common.toml); keep one entry")
    return PatchSet(version, manifest, patches, tuple(dropins))


def family_names(data: dict) -> list[str]:
    """The family folder names a manifest's `family` names, nearest first (a string is a list of one)."""
    name = data.get("family")
    return [] if name is None else list(name) if isinstance(name, list) else [name]


def _families(data: dict, where: str) -> list[Path]:
    """The family folders the manifest names, nearest first ([] without `family`)."""
    names = family_names(data)
    if "family" in data and (not names or len(set(map(repr, names))) != len(names)):
        raise UserError(f"{where}: `family` must be a folder name or a list of distinct ones, nearest first "
                        f"(got {data['family']!r}); fix the manifest")
    folders = []
    for name in names:
        if not isinstance(name, str) or not _FAMILY.fullmatch(name):
            raise UserError(f"{where}: `family` must be a folder name under patches/{FAMILIES}/ (got {name!r}); fix the manifest")
        folder = resources.patches_dir() / FAMILIES / name
        if not folder.is_dir():
            raise UserError(f"{where}: family folder {resources.display(folder)} is missing; restore it from git")
        folders.append(folder)
    return folders


def _read_toml(path: Path) -> dict:
    # imported here so that `supported_versions` works on a bare Python 3.10 (bootstrap.py)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{resources.display(path)}: unreadable manifest ({exc}); fix or restore it from git") from None


def _tables(data: dict, key: str, where: str) -> list[dict]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise UserError(f"{where}: `{key}` must be an array of tables ([[{key}]]); fix the manifest")
    return value


def _rel(value: object, what: str, where: str, under: str = "vllm") -> str:
    """A safe site-packages-relative path under `under` (no absolute paths, no '..')."""
    p = PurePosixPath(value) if isinstance(value, str) else None
    if p is None or p.is_absolute() or ".." in p.parts or p.parts[: len(PurePosixPath(under).parts)] != PurePosixPath(under).parts:
        raise UserError(f"{where}: {what} {value!r} must be a relative path under {under}/; fix the manifest")
    return str(p)


def _patch(manifest: Path, index: int, entry: dict, families: list[Path] = ()) -> Patch:
    where = f"{resources.display(manifest)} [[patch]] #{index}"
    diff, target, sha = entry.get("diff"), entry.get("target"), entry.get("sha256")
    if not isinstance(diff, str) or "/" in diff or not diff.endswith(".diff"):
        raise UserError(f"{where}: `diff` must name a .diff file beside the manifest or in its family; fix the manifest")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise UserError(f"{where}: `sha256` must be 64 lowercase hex digits; regenerate with tools/patchset.py regen")
    candidates = [manifest.parent / diff] + [f / diff for f in families]  # the release's override first
    path = next((p for p in candidates if p.is_file()), candidates[-1])
    if not path.is_file():
        raise UserError(f"{where}: {resources.display(path)} is missing; restore it from git")
    return Patch(path, _rel(target, "target", where), sha)


def _dropins(folder: Path | None, entry: dict, where: str) -> list[Dropin]:
    src, dest = entry.get("src"), entry.get("dest")
    dest = _rel(dest, "dest", where, DROPIN_ROOT)
    if not isinstance(src, str) or PurePosixPath(src).is_absolute() or ".." in PurePosixPath(src).parts:
        raise UserError(f"{where}: dropin src {src!r} must be a relative path; fix the manifest")
    path = resources.source(src) if folder is None else folder / src
    if path.is_dir():
        return [Dropin(f, f"{dest}/{f.relative_to(path).as_posix()}") for f in sorted(path.rglob("*.py"))
                if f.is_file() and "__pycache__" not in f.relative_to(path).parts]
    if path.is_file():
        return [Dropin(path, dest)]
    raise UserError(f"{where}: dropin src {src} does not exist; fix the manifest")

#!/usr/bin/env python3
"""Maintainer workflow for patch sets: fetch a pristine vLLM release, edit it, regenerate patches/X/.

    python tools/patchset.py fetch 0.23.0    # pip download --no-deps vllm==0.23.0, unpack (cached)
    python tools/patchset.py edit 0.23.0     # git tree of its *.py with the current patch set applied
    ... edit files under ~/.cache/dsa-overlay/edit/0.23.0/vllm/ (hooks only; logic goes to overlay/) ...
    python tools/patchset.py regen 0.23.0    # write patches/0.23.0/*.diff + manifest hashes from the edits

Families (patches/families/<name>/, see dsa_installer/manifest.py) hold the diffs that releases share:

    python tools/patchset.py fetch 0.22.1
    python tools/patchset.py edit 0.22.1 --family 0.20-0.23   # new release: the family's diffs that apply
    ... port by hand the hooks `edit` reports as not applying ...
    python tools/patchset.py regen 0.22.1 --family 0.20-0.23

With a family (from --family or the release's manifest), regen keeps a target's diff in the family when
the family's diff, applied to this release's pristine file, gives exactly the edited bytes (offsets are
fine, fuzz is not); it writes a family diff that does not exist yet into the family; otherwise it writes
a per-release override into patches/<X>/ (`--update-family` writes it into the family instead, for a
hook changed for the whole family: then regen the family's other releases). Layered families
(`--family 0.18,0.17-0.18`, or the manifest's list) are read nearest first: a diff is checked against, and
rewritten in, the nearest layer holding it; a new one goes to the nearest layer. The manifest keeps every
target and its pristine sha256 per release.

Caches: pristine/<X>/ (the wheel unpacked in site-packages layout without its compiled binaries, ~60 MB a
release instead of 0.5-1.3 GB; the wheel itself is not kept), edit/<X>/ (edit trees), under ~/.cache/dsa-overlay.
`fetch()` is also what the tests use to get pristine trees."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dsa_installer import fsops, hunks, manifest, plan  # noqa: E402
from dsa_installer.errors import UserError  # noqa: E402

CACHE = Path(os.environ.get("DSA_OVERLAY_CACHE", Path.home() / ".cache" / "dsa-overlay"))


def pristine_dir(version: str) -> Path:
    return CACHE / "pristine" / version


# Beside each pristine tree in this format (pristine/<X>.slim): its absence makes fetch() slim a tree an older
# fetch unpacked whole. Outside the tree, which must hold the wheel's files and nothing else.
_SLIM_SUFFIX = ".slim"


def is_binary(name: str) -> bool:
    """Wheel members fetch() leaves out: compiled libraries and executables, never a patch target (the engine
    only patches and adds *.py), 90-95% of a vLLM wheel's bytes. The tests' RECORD checks skip them too."""
    return name.endswith(".so") or ".so." in name.rsplit("/", 1)[-1] or name == "vllm/vllm-rs"


def fetch(version: str, quiet: bool = False) -> Path:
    """The unpacked pristine release `version` (site-packages layout, without compiled binaries), downloading
    the wheel into a temporary folder if needed."""
    dest = pristine_dir(version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{version}.lock", "w") as lock:   # one fetch per release at a time (pytest -n)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch_locked(version, dest, quiet)


def _fetch_locked(version: str, dest: Path, quiet: bool) -> Path:
    slim = dest.with_name(version + _SLIM_SUFFIX)
    if (dest / f"vllm-{version}.dist-info" / "METADATA").is_file():
        if not slim.is_file():  # unpacked whole by an older fetch: drop the binaries
            for path in [p for p in dest.rglob("*") if p.is_file() and is_binary(p.relative_to(dest).as_posix())]:
                path.unlink()
            slim.write_text("")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{version}-wheel-", dir=dest.parent) as wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"vllm=={version}", "-d", wheels]
        subprocess.run(cmd + (["-q"] if quiet else []), check=True)
        found = sorted(Path(wheels).glob(f"vllm-{version}-*.whl"))
        if not found:
            raise UserError(f"pip download gave no vllm-{version} wheel")
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=dest.parent))
        try:
            with zipfile.ZipFile(found[-1]) as zf:
                zf.extractall(tmp, [m for m in zf.namelist() if not is_binary(m)])
            os.replace(tmp, dest)
            slim.write_text("")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def edit(version: str, where: Path | None = None, family: str | None = None) -> Path:
    """A git tree of the release's *.py files: commit 'pristine', then the current patch set applied (for a
    release without a manifest yet, with `family`: every family diff that applies; the rest is reported)."""
    src = fetch(version)
    tree = where or CACHE / "edit" / version
    if tree.exists():
        raise UserError(f"{tree} exists; finish with `regen {version}` or delete it first")
    for f in src.glob("vllm/**/*.py"):
        out = tree / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
    shutil.copytree(src / f"vllm-{version}.dist-info", tree / f"vllm-{version}.dist-info")
    git = ["git", "-C", str(tree), "-c", "user.name=dsa-overlay", "-c", "user.email=dsa-overlay@localhost"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", f"pristine vllm {version}"], check=True)
    subprocess.run(git + ["tag", "pristine"], check=True)
    p = plan.make(tree) if (REPO / "patches" / version / "manifest.toml").is_file() else None
    changed = [c.target for c in p.changes] if p else []
    for c in p.changes if p else ():
        (tree / c.target).write_bytes(c.after)
    if p is None and family is not None:
        for d in _family_diffs(REPO / "patches", family).values():
            try:
                (tree / d.target).write_bytes(hunks.apply((tree / d.target).read_bytes(), d)[0])
                changed.append(d.target)
            except (OSError, UserError) as exc:
                click.echo(f"port by hand: {d.target} ({str(exc).split(':')[0]} does not apply)", err=True)
    if changed:
        subprocess.run(git + ["commit", "-q", "-am", f"dsa-overlay patch set {version}"], check=True)
    return tree


def regen(version: str, where: Path | None = None, patches: Path = REPO / "patches", family: str | list[str] | None = None,
          update_family: bool = False) -> list[str]:
    """Write patches/<version>/<name>.diff (or the family's, see the module docstring) for every file of the
    edit tree that differs from pristine and rewrite the manifest's [[patch]] list (existing diff names and
    order kept); returns the targets."""
    src, tree = fetch(version), where or CACHE / "edit" / version
    if not tree.is_dir():
        raise UserError(f"{tree}: no edit tree; run `edit {version}` first")
    changed = []
    for f in sorted(tree.glob("vllm/**/*.py")):
        rel = f.relative_to(tree).as_posix()
        orig = src / rel
        if not orig.is_file():
            raise UserError(f"{f}: new file; new modules belong in overlay/ as drop-ins, not in a diff")
        if f.read_bytes() != orig.read_bytes():
            changed.append(rel)
    folder = patches / version
    folder.mkdir(parents=True, exist_ok=True)
    old = _read_manifest(folder / "manifest.toml")
    layers = _layers(family) or manifest.family_names(old)
    shared = _family_diffs(patches, layers)
    names = {d.target: d.path.name for d in shared.values()} | {e["target"]: e["diff"] for e in old.get("patch", [])}
    siblings = {f: [d for m in sorted(patches.glob("*/manifest.toml")) if m.parent.name != version
                    and f in manifest.family_names(d := _read_manifest(m))] for f in layers}  # the layer's other releases
    near = [d for f in layers for d in siblings[f]]
    listed = [e["target"] for e in (old if old or not near else near[-1]).get("patch", [])]
    order = [t for t in listed if t in changed] + [t for t in changed if t not in listed]
    for target in set(names) - set(changed):
        (folder / names[target]).unlink(missing_ok=True)
    entries = []
    for target in order:
        name = names.get(target) or _diff_name(target, {e["diff"] for e in entries})
        pristine, edited = (src / target).read_bytes(), (tree / target).read_bytes()
        out = folder / name
        if layers:  # the nearest layer that holds the diff (the one it resolves to), else the nearest layer
            fam = next((f for f in (patches / manifest.FAMILIES / n / name for n in layers) if f.is_file()),
                       patches / manifest.FAMILIES / layers[0] / name)
            if not fam.is_file() or update_family:
                (folder / name).unlink(missing_ok=True)
                out = fam
            elif _gives(fam, pristine, edited):
                (folder / name).unlink(missing_ok=True)
                out = None
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(hunks.make_diff(pristine, edited, target), encoding="utf-8")
        entries.append({"diff": name, "target": target, "sha256": fsops.sha256(pristine)})
    _write_manifest(folder / "manifest.toml", version, entries, old.get("dropin", []), layers)
    for f in layers:  # a layer's diff that no release naming the layer lists any more goes
        used = {e["diff"] for d in siblings[f] + [_read_manifest(folder / "manifest.toml")] for e in d.get("patch", [])}
        for diff in (patches / manifest.FAMILIES / f).glob("*.diff"):
            if diff.name not in used:
                diff.unlink()
    return order


def _layers(family: str | list[str] | None) -> list[str]:
    """Family folder names, nearest first, from --family ("0.18,0.17-0.18") or a list."""
    return (family.split(",") if isinstance(family, str) else list(family)) if family else []


def _family_diffs(patches: Path, family: str | list[str]) -> dict[str, hunks.FileDiff]:
    """The family's diffs by file name, the nearest layer's where several hold one (manifest.py's resolution
    order); UserError if a family folder does not exist."""
    out: dict[str, hunks.FileDiff] = {}
    for name in reversed(_layers(family)):
        folder = patches / manifest.FAMILIES / name
        if not folder.is_dir():
            raise UserError(f"{folder}: no such family; create it (a folder of shared diffs) or check the name")
        out |= {p.name: hunks.parse(p) for p in sorted(folder.glob("*.diff"))}
    return out


def _gives(diff: Path, pristine: bytes, edited: bytes) -> bool:
    """Whether `diff` applied to `pristine` (offsets allowed, no fuzz) gives exactly `edited`."""
    try:
        return hunks.apply(pristine, hunks.parse(diff))[0] == edited
    except UserError:
        return False


def _diff_name(target: str, taken: set[str]) -> str:
    path = Path(target)
    name = (path.parent.name if path.name == "__init__.py" else path.stem) + ".diff"  # a package by its name
    return name if name not in taken else target.removeprefix("vllm/").replace("/", "_").removesuffix(".py") + ".diff"


def _read_manifest(path: Path) -> dict:
    return manifest._read_toml(path) if path.is_file() else {}


def _notes(path: Path) -> list[str]:
    """The comment lines between an existing manifest's generated first line and its first key."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    notes = []
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        notes.append(line)
    return notes


def _write_manifest(path: Path, version: str, patches: list[dict], dropins: list[dict], family: list[str] = ()) -> None:
    q = lambda s: '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'
    fam = q(family[0]) if len(family) == 1 else "[" + ", ".join(map(q, family)) + "]"
    first = f"# Patch set for vLLM {version}. [[patch]] entries are written by tools/patchset.py regen."
    notes = _notes(path)  # a maintainer's comment lines under the first one (e.g. why a hook is absent) stay
    out = [first, *notes, f"vllm = {q(version)}"] + ([f"family = {fam}"] if family else []) + [""]
    for e in patches:
        out += ["[[patch]]", f"diff = {q(e['diff'])}", f"target = {q(e['target'])}", f"sha256 = {q(e['sha256'])}", ""]
    for e in dropins:
        out += ["[[dropin]]", f"src = {q(e['src'])}", f"dest = {q(e['dest'])}", ""]
    path.write_text("\n".join(out), encoding="utf-8")


@click.group()
def cli() -> None:
    """Maintain patches/<version>/ against pristine vLLM releases."""


@cli.command("fetch")
@click.argument("version")
def fetch_cmd(version: str) -> None:
    """Download (cached) and unpack pristine vLLM VERSION."""
    click.echo(fetch(version))


@cli.command("edit")
@click.argument("version")
@click.option("--dir", "where", type=click.Path(path_type=Path), help="Where to lay out the tree.")
@click.option("--family", help="For a release without a manifest: start from this family's diffs (layers: "
              "comma-separated, nearest first).")
def edit_cmd(version: str, where: Path | None, family: str | None) -> None:
    """Lay out VERSION's *.py as a git tree with the current patch set applied."""
    tree = edit(version, where, family)
    click.echo(f"{tree}\nedit files there (`git diff pristine` shows the set), then: tools/patchset.py regen {version}"
               + (f" --dir {tree}" if where else ""))


@cli.command("regen")
@click.argument("version")
@click.option("--dir", "where", type=click.Path(path_type=Path), help="The edit tree (default: the cache's).")
@click.option("--patches", type=click.Path(path_type=Path, file_okay=False), default=REPO / "patches",
              show_default=True, help="The patches/ folder to write into.")
@click.option("--family", help="Share diffs through patches/families/FAMILY/ (default: the manifest's; layers: "
              "comma-separated, nearest first, e.g. 0.18,0.17-0.18).")
@click.option("--update-family", is_flag=True, help="Write differing diffs into the family, not the release.")
def regen_cmd(version: str, where: Path | None, patches: Path, family: str | None, update_family: bool) -> None:
    """Write patches/VERSION/*.diff (or the family's) and manifest hashes from the edit tree."""
    for target in regen(version, where, patches, family, update_family):
        click.echo(f"patched: {target}")


def main() -> None:
    try:
        cli(standalone_mode=False)
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()

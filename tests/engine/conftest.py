"""Fixtures for the engine tests: real pristine vLLM trees (fetched once, cached under ~/.cache) copied
once per session; round trips restore them, and a dirty tree is copied anew for the next test."""

from __future__ import annotations

import base64
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_installer import fsops, manifest
from tools import patchset

REPO = Path(__file__).resolve().parents[2]
VERSIONS = manifest.supported_versions()


class Tree:
    """A writable copy of a pristine vLLM release (site-packages layout), checked against its wheel's RECORD."""

    def __init__(self, version: str, path: Path):
        self.version, self.path = version, path
        self.pristine = patchset.fetch(version, quiet=True)
        self.record = {rel: digest for rel, digest in
                       _record(self.pristine / f"vllm-{version}.dist-info" / "RECORD").items()
                       if not patchset.is_binary(rel)}  # fetch() leaves compiled binaries out
        self.copy()

    def copy(self) -> None:
        if self.path.exists():
            shutil.rmtree(self.path)
        shutil.copytree(self.pristine, self.path, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        self.baseline = _stats(self.path)

    def differences(self, full: bool = False) -> list[str]:
        """Paths that differ from the wheel's RECORD (missing, extra, other bytes). Without `full`, only
        files whose inode/size/mtime changed since the copy are hashed (the others are the copied bytes)."""
        now = _stats(self.path)
        problems = [f"extra {p}" for p in sorted(set(now) - set(self.record))]
        problems += [f"missing {p}" for p in sorted(set(self.record) - set(now))]
        for rel in sorted(set(now) & set(self.record)):
            if self.record[rel] and (full or now[rel] != self.baseline.get(rel)):
                if fsops.file_sha256(self.path / rel) != self.record[rel]:
                    problems.append(f"changed {rel}")
        return problems

    def assert_pristine(self, full: bool = False) -> None:
        problems = self.differences(full)
        assert not problems, f"{self.path} is not pristine vLLM {self.version}: {problems[:10]}"


def _record(path: Path) -> dict[str, str | None]:
    out = {}
    for rel, digest, _ in csv.reader(path.read_text().splitlines()):
        if digest.startswith("sha256="):
            raw = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4))
            out[rel] = raw.hex()
        else:
            out[rel] = None
    return out


def _stats(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="session")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("trees")
    made: dict[str, Tree] = {}

    def get(version: str) -> Tree:
        if version not in made:
            made[version] = Tree(version, base / version)
        return made[version]

    return get


# One release per patch-set family (test_patch_sets checks that VENV_RELEASES covers every family). The engine's
# transactions are one code path for every release; what differs between releases of a family is only the
# bytes of the hunks, which every release's round trip, compile, `git apply` and refusal tests check. The
# exhaustive engine tests (a kill, a failure or a full disk at every file-system call, hostile state, locks)
# run once per family, on this release: a module that wants that says `tree = family_tree_fixture()`.
FAMILY_RELEASES = [v for v in manifest.VENV_RELEASES if v in VERSIONS]


def _pristine_copy(request, trees):
    t = trees(request.param)
    t.assert_pristine()
    yield t
    if t.differences() or (t.path / "vllm" / ".dsa_overlay").exists():
        t.copy()


@pytest.fixture(params=VERSIONS)
def tree(request, trees) -> Tree:
    """A pristine copy of each supported release; copied anew afterwards if the test left it dirty."""
    yield from _pristine_copy(request, trees)


def family_tree_fixture(name: str = "tree"):
    """A fixture `name` (default: `tree`) over FAMILY_RELEASES (one release per family) for the module that
    assigns it."""
    @pytest.fixture(params=FAMILY_RELEASES, name=name)
    def tree(request, trees) -> Tree:
        yield from _pristine_copy(request, trees)
    return tree


def cli(*args, cwd=REPO, script="apply.py", **kw) -> subprocess.CompletedProcess:
    """Run `python apply.py ARGS...` (or another script of the repo) as a user would."""
    return subprocess.run([sys.executable, str(Path(cwd) / script), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, **kw)


def assert_error(proc: subprocess.CompletedProcess, message: str) -> None:
    """A user error: exit code 2, exactly `error: <message>` on stderr, nothing on stdout."""
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"error: {message}\n", ""), proc.stderr

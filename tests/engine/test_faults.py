"""Failure at every write: in-process (the write primitive raises) and a real process death (os._exit)."""

import errno
import json
import subprocess
import sys

import pytest

from dsa_installer import engine, fsops
from dsa_installer.errors import UserError

from .conftest import REPO, cli


def _count_writes(monkeypatch, fn) -> int:
    calls = []
    real = fsops.write_file

    def counting(*args, **kw):
        calls.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(fsops, "write_file", counting)
    fn()
    monkeypatch.setattr(fsops, "write_file", real)
    return len(calls)


def _fail_at(monkeypatch, n: int, after: bool) -> None:
    """Make the n-th write raise ENOSPC, before touching the file or right after replacing it."""
    real = fsops.write_file
    count = [0]

    def failing(path, data, mode=0o644):
        count[0] += 1
        if count[0] == n and not after:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        real(path, data, mode)
        if count[0] == n and after:
            raise OSError(errno.EIO, "I/O error after write (injected)", str(path))

    monkeypatch.setattr(fsops, "write_file", failing)


def test_apply_failing_at_every_write_leaves_the_tree_pristine(tree, monkeypatch):
    site = tree.path
    writes = _count_writes(monkeypatch, lambda: engine.apply(site))
    engine.rollback(site)
    tree.assert_pristine()
    assert writes >= 4  # backups, state twice, the targets, the drop-ins
    for after in (False, True):
        for n in range(1, writes + 1):
            _fail_at(monkeypatch, n, after)
            with pytest.raises(UserError, match=r"^apply failed \(.*\(injected\)\); nothing was changed$"):
                engine.apply(site)
            monkeypatch.undo()
            tree.assert_pristine()
            assert not (site / "vllm/.dsa_overlay").exists(), (n, after)
            assert not (site / "vllm/_dsa_overlay").exists(), (n, after)
            assert engine.status(site)["state"] == "pristine"
    engine.apply(site)  # and a clean apply still works afterwards
    engine.rollback(site)
    tree.assert_pristine(full=True)


def test_rollback_failing_half_way_keeps_state_and_resumes(tree, monkeypatch):
    site = tree.path
    engine.apply(site)
    writes = _count_writes(monkeypatch, lambda: engine.rollback(site))
    assert writes >= 1
    for n in range(1, writes + 1):
        engine.apply(site)
        _fail_at(monkeypatch, n, after=True)
        with pytest.raises(UserError, match=r"^rollback stopped \(.*\); the overlay state is kept"):
            engine.rollback(site)
        monkeypatch.undo()
        assert engine.status(site)["state"] in ("partially applied", "applied")
        assert engine.rollback(site)["changed"] is True
        tree.assert_pristine()


_CRASH = """
import os, sys
sys.path.insert(0, {repo!r})
from dsa_installer import fsops
real, n, torn, count = fsops.write_file, int(sys.argv[1]), sys.argv[3] == "torn", [0]
def dying(path, data, mode=0o644):
    count[0] += 1
    if count[0] == n:
        if torn:             # half of the bytes reached the staging file
            fsops.temp_path(path).write_bytes(data[: len(data) // 2])
        os._exit(9)          # the process dies here: no except, no finally, no cleanup
    real(path, data, mode)
fsops.write_file = dying
from dsa_installer import engine
from pathlib import Path
engine.apply(Path(sys.argv[2]))
"""


def test_apply_killed_at_every_write_is_recovered_by_rollback(tree, monkeypatch):
    site = tree.path
    writes = _count_writes(monkeypatch, lambda: engine.apply(site))
    engine.rollback(site)
    code = _CRASH.format(repo=str(REPO))
    for n, how in [(n, how) for n in range(1, writes + 1) for how in ("clean", "torn")]:
        proc = subprocess.run([sys.executable, "-c", code, str(n), str(site), how], capture_output=True, text=True)
        assert proc.returncode == 9, proc.stderr
        status = json.loads(cli("status", "--vllm-site-packages", site, "--json").stdout)
        assert status["state"] == "partially applied", (n, status)
        refused = cli("--vllm-site-packages", site)
        assert refused.returncode == 2 and "partially applied" in refused.stderr or refused.returncode == 0, n
        if refused.returncode == 0:  # killed before any target changed: a new apply is allowed and completes
            assert cli("rollback", "--vllm-site-packages", site).returncode == 0
        rolled = cli("rollback", "--vllm-site-packages", site)
        assert rolled.returncode == 0, rolled.stderr
        tree.assert_pristine()
        assert not (site / "vllm/.dsa_overlay").exists() and not (site / "vllm/_dsa_overlay").exists()

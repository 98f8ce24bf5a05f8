"""Faults at every file-system call of apply and rollback, on copies of the real pristine trees.

The engine changes the disk only through `os` calls (fsops.py), so a forked child process patches the `os`
module and, at the n-th call that touches the tree, either dies (`os._exit(9)`: no except, no finally; for a
write, optionally after half of its bytes), fails before or after doing it (EIO), or starts a full disk
(ENOSPC from then on for every call that needs blocks or inodes). Each case pins one outcome, derived from
the phase the call is in (read from the trace of an undisturbed run), and asserts it exactly."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import traceback
from pathlib import Path

import pytest

from dsa_installer import engine, manifest, plan, state
from dsa_installer.errors import UserError

from .conftest import family_tree_fixture, assert_error, cli

tree = family_tree_fixture()  # the engine's exhaustive cases: one release per family (conftest)

_FD_CALLS = ("write", "fsync", "fchmod")
_PATH_CALLS = ("replace", "rename", "link", "unlink", "remove", "rmdir", "mkdir", "chmod", "symlink")
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# calls that need free space: "blocks" (data and folder blocks) or "inodes" (new files and folders)
_NEEDS = {"blocks": {"write", "mkdir"}, "inodes": {"create", "mkdir"},
          "both": {"write", "mkdir", "create", "link", "symlink"}}


@pytest.fixture(autouse=True)
def no_flush(monkeypatch):
    """fsync stays a counted call (it is killed and failed like the others) but does not wait for the disk:
    these tests kill processes, which lose nothing the page cache holds; power loss is not simulated."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


class Injector:
    """Counts the calls that change something under `site` and disturbs the n-th one (1-based).

    kill=n: die before call n (torn: a write first puts half of its bytes); fail=n: raise EIO before call n
    (after=True: after doing it); full=(kind, n): from the n-th call needing space on, every such call raises
    ENOSPC; deny=(folder, errno, calls): those calls on an entry of `folder` fail (chattr +a: unlink and
    rename out of or over an entry; an unremovable folder: rmdir)."""

    def __init__(self, site: Path, kill=None, torn=False, fail=None, after=False, full=None, deny=None):
        self.site = str(site) + os.sep
        self.kill, self.torn, self.fail, self.after, self.full, self.deny = kill, torn, fail, after, full, deny
        self.trace: list[list] = []
        self.fds: dict[int, str] = {}
        self.space_calls = 0
        self.real = {name: getattr(os, name) for name in ("open", "close", *_FD_CALLS, *_PATH_CALLS)}

    def install(self) -> None:
        os.open = self._open
        os.close = self._close
        for name in _FD_CALLS:
            setattr(os, name, self._fd_call(name))
        for name in _PATH_CALLS:
            setattr(os, name, self._path_call(name))

    def uninstall(self) -> None:
        for name, fn in self.real.items():
            setattr(os, name, fn)

    def _mine(self, path) -> bool:
        return isinstance(path, (str, Path)) and str(path).startswith(self.site)

    def _rel(self, path) -> str:
        return str(path)[len(self.site):]

    def _call(self, name, path, do, to=None, data=None):
        self.trace.append([name, self._rel(path)] + ([self._rel(to)] if to is not None else []))
        n = len(self.trace)
        if self.kill == n:
            if self.torn and name == "write":
                self.real["write"](data[0], data[1][: len(data[1]) // 2])
            os._exit(9)
        if self.full is not None:
            kind, start = self.full
            if name in _NEEDS[kind]:
                self.space_calls += 1
                if self.space_calls >= start:
                    raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        if self.deny is not None:
            folder, code, calls = self.deny
            if name in calls and folder in (Path(path).parent, to and Path(to).parent):
                raise OSError(code, os.strerror(code), str(path))
        if self.fail == n and not self.after:
            raise OSError(errno.EIO, "I/O error (injected)", str(path))
        result = do()
        if self.fail == n and self.after:
            raise OSError(errno.EIO, "I/O error after the call (injected)", str(path))
        return result

    def _open(self, path, flags, mode=0o777, *, dir_fd=None):
        if not (self._mine(path) and flags & _WRITING):
            return self.real["open"](path, flags, mode, dir_fd=dir_fd)
        name = "create" if flags & os.O_CREAT else "open"
        fd = self._call(name, path, lambda: self.real["open"](path, flags, mode, dir_fd=dir_fd))
        self.fds[fd] = str(path)
        return fd

    def _close(self, fd):
        self.fds.pop(fd, None)
        return self.real["close"](fd)

    def _fd_call(self, name):
        def call(fd, *args):
            if fd not in self.fds:
                return self.real[name](fd, *args)
            return self._call(name, self.fds[fd], lambda: self.real[name](fd, *args), data=(fd, *args))
        return call

    def _path_call(self, name):
        def call(path, *args, **kw):
            if not self._mine(path):
                return self.real[name](path, *args, **kw)
            to = args[0] if name in ("replace", "rename", "link", "symlink") else None
            return self._call(name, path, lambda: self.real[name](path, *args, **kw), to=to)
        return call


def forked(site: Path, action, **inject) -> tuple[int, dict]:
    """Run `action()` in a forked child under an Injector; (exit code, {"result"|"error"|"crash", "trace"})."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            hook = Injector(site, **inject)
            hook.install()
            try:
                out = {"result": action()}
            except UserError as exc:
                out = {"error": str(exc)}
            except BaseException:
                out = {"crash": traceback.format_exc()}
            hook.uninstall()
            out["trace"] = hook.trace
            data = json.dumps(out).encode()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    _, code = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(code), (json.loads(b"".join(chunks)) if chunks else {})


def _trace(site: Path, action) -> list[list]:
    code, out = forked(site, action)
    assert code == 0 and "result" in out, out
    return out["trace"]


def _targets(tree) -> list[str]:
    return [p.target for p in manifest.load(tree.version).patches]


def _index(trace, name, rel, last=False) -> int:
    """1-based index of the first (or last) call `name` whose destination (or path) is `rel`."""
    hits = [i for i, c in enumerate(trace, 1) if c[0] == name and c[-1] == rel]
    assert hits, (name, rel)
    return hits[-1] if last else hits[0]


def _assert_clean(tree) -> None:
    tree.assert_pristine()
    assert not os.path.lexists(tree.path / state.STATE_DIR)
    assert not os.path.lexists(tree.path / manifest.DROPIN_ROOT)


STATE_JSON = f"{state.STATE_DIR}/state.json"
LEFTOVER = "{site}/vllm/.dsa_overlay: left by an interrupted apply or rollback (it has no state.json); run " \
           "`apply.py rollback` first, then apply"
ORPHAN_DONE = "removed the state folder of an interrupted apply or rollback (every file was already pristine)"


# ------------------------------------------------------------------------------------- kill -9 in apply
@pytest.mark.parametrize("torn", [False, True], ids=["clean", "torn"])
def test_apply_killed_before_every_call(tree, torn):
    """Pinned per kill point n: before the state folder exists the tree is untouched and apply works; from
    then on until the final state.json rename the apply is 'partially applied', apply refuses, and rollback
    restores exactly the targets already renamed over; after it the overlay is applied."""
    site, targets = tree.path, _targets(tree)
    trace = _trace(site, lambda: engine.apply(site))
    engine.rollback(site)
    adds = [d.dest for d in manifest.load(tree.version).dropins]
    first_state = _index(trace, "replace", STATE_JSON)
    final_state = _index(trace, "replace", STATE_JSON, last=True)
    assert trace[0] == ["mkdir", state.STATE_DIR] and final_state == len(trace)
    points = [n for n in range(1, len(trace) + 1) if not torn or trace[n - 1][0] == "write"]
    assert len(points) >= (len(targets) + len(adds) + 2 if torn else 5 * (len(targets) + len(adds)))
    for n in points:
        code, out = forked(site, lambda: engine.apply(site), kill=n, torn=torn)
        assert code == 9, (n, out)
        done = [t for t in targets if _index(trace, "replace", t) < n]
        if n == 1:  # nothing happened yet
            assert engine.status(site)["state"] == "pristine"
            _assert_clean(tree)
            continue
        assert engine.status(site)["state"] == "partially applied", n
        if n <= first_state:  # no state.json yet: only the (empty or half-written) state folder
            expect = LEFTOVER.format(site=site)
        else:
            pending = [t for t in targets if t not in done]
            added = [a for a in adds if _index(trace, "replace", a) < n]
            first = (f"{pending[0]}: pristine" if pending else
                     f"{next(a for a in adds if a not in added)}: not added yet" if len(added) < len(adds)
                     else "interrupted apply")
            expect = f"{site}: the overlay is partially applied ({first}); run `apply.py rollback` first"
        with pytest.raises(UserError) as refused:
            engine.apply(site)
        assert str(refused.value) == expect, n
        result = engine.rollback(site)
        if n <= first_state:
            assert (result["restored"], result["message"]) == ([], ORPHAN_DONE), n
        else:
            assert (result["restored"], result["message"]) == (done, "rolled back; vLLM is pristine again"), n
        _assert_clean(tree)
    tree.assert_pristine(full=True)


# ---------------------------------------------------------------------------------- kill -9 in rollback
def test_rollback_killed_before_every_call_is_finished_by_rollback(tree):
    """Pinned per kill point n: the next rollback restores exactly the targets not yet renamed back, treats
    drop-ins already removed as done (not as 'deleted since apply'), and leaves the tree pristine."""
    site, targets = tree.path, _targets(tree)
    engine.apply(site)
    trace = _trace(site, lambda: engine.rollback(site))
    tree.assert_pristine()
    state_gone = _index(trace, "unlink", STATE_JSON)
    assert trace[-1] == ["rmdir", state.STATE_DIR] and state_gone == len(trace) - 1
    for n in range(1, len(trace) + 1):
        engine.apply(site)
        code, out = forked(site, lambda: engine.rollback(site), kill=n)
        assert code == 9, (n, out)
        pending = [t for t in targets if _index(trace, "replace", t) >= n]
        if n == 1:  # killed before its first call: still applied, and a re-apply is a no-op
            assert engine.status(site)["state"] == "applied"
            assert engine.apply(site)["changed"] is False
        else:
            assert engine.status(site)["state"] == "partially applied", n
            with pytest.raises(UserError) as refused:
                engine.apply(site)
            assert str(refused.value) == (LEFTOVER.format(site=site) if n > state_gone else
                                          f"{site}: the overlay is partially applied ({targets[0]}: pristine); "
                                          "run `apply.py rollback` first"), n
        result = engine.rollback(site)
        if n > state_gone:
            assert (result["restored"], result["message"]) == ([], ORPHAN_DONE), n
        else:
            assert (result["restored"], result["message"]) == (pending, "rolled back; vLLM is pristine again"), n
        _assert_clean(tree)
    tree.assert_pristine(full=True)


# ------------------------------------------------------------------------ a failing call, before or after
APPLY_FAILED = re.compile(r"apply failed \(.*\(injected\)\); nothing was changed")


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_apply_failing_at_every_call_changes_nothing(tree, after):
    """Pinned: a call that fails before doing anything, or after doing it, anywhere in apply (the state, the
    backup links, each staging write/chmod/fsync/rename, the folders, the final state) gives exactly
    'apply failed (...); nothing was changed', and the tree is byte-identical with no state folder."""
    site = tree.path
    trace = _trace(site, lambda: engine.apply(site))
    engine.rollback(site)
    assert {c[0] for c in trace} >= {"mkdir", "create", "write", "fchmod", "fsync", "replace", "link"}
    for n in range(1, len(trace) + 1):
        code, out = forked(site, lambda: engine.apply(site), fail=n, after=after)
        assert code == 0 and APPLY_FAILED.fullmatch(out.get("error", "")), (n, trace[n - 1], out)
        _assert_clean(tree)
    engine.apply(site)  # and a clean apply still works afterwards
    engine.rollback(site)
    tree.assert_pristine(full=True)


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_rollback_failing_at_every_call_is_finished_by_rollback(tree, after):
    """Pinned: a rollback whose n-th call fails stops with 'rollback stopped (...); the overlay state is
    kept' (or, failing after its very last call, the state is already gone), and the next rollback restores
    exactly the targets not yet restored."""
    site, targets = tree.path, _targets(tree)
    engine.apply(site)
    trace = _trace(site, lambda: engine.rollback(site))
    for n in range(1, len(trace) + 1):
        engine.apply(site)
        code, out = forked(site, lambda: engine.rollback(site), fail=n, after=after)
        assert code == 0, out
        assert re.fullmatch(r"rollback stopped \(.*\(injected\)\); the overlay state is kept: fix the cause and "
                            r"run `apply.py rollback` again to finish", out.get("error", "")), (n, out)
        moved = [t for t in targets if _index(trace, "replace", t) < n + after]
        result = engine.rollback(site)
        if n == len(trace) and after:  # the state folder's rmdir did its work, then failed
            assert result["message"] == "no overlay applied here; nothing to roll back"
        elif n >= _index(trace, "unlink", STATE_JSON) + (not after):
            assert (result["restored"], result["message"]) == ([], ORPHAN_DONE), n
        else:
            assert result["restored"] == [t for t in targets if t not in moved], n
            assert result["message"] == "rolled back; vLLM is pristine again"
        _assert_clean(tree)


# ---------------------------------------------------------------------------------------- a full disk
@pytest.mark.parametrize("kind", ["blocks", "inodes", "both"])
def test_apply_on_a_disk_filling_up_at_every_point_changes_nothing(tree, kind):
    """The disk fills up at the n-th call that needs space, for every n, and stays full: the undo must need
    no new space (it renames backups back and removes files), so the tree ends byte-identical."""
    site = tree.path
    trace = _trace(site, lambda: engine.apply(site))
    engine.rollback(site)
    needing = sum(c[0] in _NEEDS[kind] for c in trace)
    assert needing >= 10
    for n in range(1, needing + 1):
        code, out = forked(site, lambda: engine.apply(site), full=(kind, n))
        assert code == 0 and re.fullmatch(r"apply failed \(.*No space left on device \(injected\)\); nothing was "
                                          r"changed", out.get("error", "")), (n, out)
        _assert_clean(tree)
    tree.assert_pristine(full=True)


def test_rollback_needs_no_free_space(tree):
    """A rollback on a disk that is already full (every call needing blocks or inodes fails) completes."""
    site = tree.path
    engine.apply(site)
    code, out = forked(site, lambda: engine.rollback(site), full=("both", 1))
    assert code == 0 and out["result"]["message"] == "rolled back; vLLM is pristine again", out
    assert not [c for c in out["trace"] if c[0] in _NEEDS["both"]]
    _assert_clean(tree)
    tree.assert_pristine(full=True)


def test_apply_refuses_when_space_or_inodes_are_short(tree, monkeypatch):
    """Free space and inodes are checked before the first write (os.statvfs), with one line."""
    site = tree.path
    real = os.statvfs

    def fake(blocks, inodes):
        def statvfs(path):
            st = real(path)
            return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, blocks, blocks, st.f_files, inodes, inodes,
                                      st.f_flag, st.f_namemax))
        return statvfs

    p_need = plan.make(site).space_needed()
    need_mib = f"{p_need[0] / 2**20:.1f} MiB"
    for blocks, inodes, short in [
        (10, 10**6, f"{need_mib} needed, {10 * 4096 / 2**20:.1f} MiB free"),
        (10**6, 5, f"{p_need[1]} inodes needed, 5 free"),
        (0, 0, f"{need_mib} needed, 0.0 MiB free; {p_need[1]} inodes needed, 0 free"),
    ]:
        monkeypatch.setattr(os, "statvfs", fake(blocks, inodes))
        with pytest.raises(UserError) as exc:
            engine.apply(site)
        monkeypatch.undo()
        assert str(exc.value) == (f"{site / 'vllm'}: not enough free space ({short}); free some space, then apply "
                                  "again (nothing was changed)")
        _assert_clean(tree)
    monkeypatch.setattr(os, "statvfs", fake(p_need[0] // 4096 + 1, p_need[1]))  # exactly enough
    engine.apply(site)
    monkeypatch.undo()
    engine.rollback(site)
    _assert_clean(tree)


# -------------------------------------------------------------------- append-only and immutable folders
def _platforms(tree) -> str:
    rel = next(t for t in _targets(tree) if t.endswith("platforms/cuda.py"))
    return rel


def test_append_only_folder_names_the_staging_file_it_leaves(tree):
    """chattr +a on a target's folder (simulated: unlink/rename there fail with EPERM): apply creates its
    staging file, cannot rename it over the target nor remove it, undoes the rest and names what is left."""
    site, rel = tree.path, _platforms(tree)
    folder = (site / rel).parent
    code, out = forked(site, lambda: engine.apply(site), deny=(folder, errno.EPERM, {"unlink", "rename", "replace"}))
    left = [p for p in tree.differences()]
    assert len(left) == 1 and re.fullmatch(rf"extra {re.escape(str(Path(rel).parent))}/\.cuda\.py\.[0-9a-f]{{8}}"
                                           r"\.dsa-overlay-tmp", left[0]), left
    tmp = site / left[0].removeprefix("extra ")
    assert out["error"] == (f"apply failed ({tmp}: Operation not permitted); nothing else was changed, but {tmp} "
                            "(cannot remove it: Operation not permitted) is left behind; delete it by hand"), out
    tmp.unlink()
    _assert_clean(tree)


def _chattr(flag: str, path: Path) -> str | None:
    """Set a real file attribute; why it cannot be set here (not root, file system without them), or None."""
    proc = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)
    return None if proc.returncode == 0 else f"chattr {flag} not possible here: {proc.stderr.strip()}"


def test_real_append_only_folder(tree):
    """The same with a real `chattr +a` (root on ext4/xfs/btrfs): the message names the file left."""
    site, rel = tree.path, _platforms(tree)
    folder = (site / rel).parent
    why = _chattr("+a", folder)
    if why:
        pytest.skip(why)
    try:
        proc = cli("--vllm-site-packages", site)
    finally:
        _chattr("-a", folder)
    left = tree.differences()
    assert len(left) == 1 and left[0].startswith(f"extra {Path(rel).parent}/.cuda.py."), left
    tmp = site / left[0].removeprefix("extra ")
    assert_error(proc, f"apply failed ({tmp}: Operation not permitted); nothing else was changed, but {tmp} "
                       "(cannot remove it: Operation not permitted) is left behind; delete it by hand")
    tmp.unlink()
    _assert_clean(tree)


def test_unremovable_folder_stops_rollback_and_rollback_finishes(tree):
    """A drop-in folder that cannot be removed (simulated EBUSY from rmdir, then a real chattr +i where
    possible): rollback stops keeping its state; after the cause is gone, a second rollback finishes."""
    site = tree.path
    kernels = site / manifest.DROPIN_ROOT / "kernels"
    engine.apply(site)
    code, out = forked(site, lambda: engine.rollback(site), deny=(kernels.parent, errno.EBUSY, {"rmdir"}))
    subfolders = {d for d in kernels.parent.iterdir() if d.is_dir() and d.name != "__pycache__"}  # kernels, gguf
    stopped_at = Path(out["error"].removeprefix("rollback stopped (").split(":", 1)[0])
    assert stopped_at in subfolders and out["error"] == (
        f"rollback stopped ({stopped_at}: Device or resource busy); the overlay state is kept: fix the cause and "
        "run `apply.py rollback` again to finish"), out
    assert engine.status(site)["state"] == "partially applied"
    result = engine.rollback(site)
    assert (result["restored"], result["message"]) == ([], "rolled back; vLLM is pristine again")
    _assert_clean(tree)

    engine.apply(site)
    why = _chattr("+i", kernels)
    if why:
        pytest.skip(why)
    try:
        proc = cli("rollback", "--vllm-site-packages", site)
    finally:
        _chattr("-i", kernels)
    assert proc.returncode == 2 and proc.stderr.startswith("error: rollback stopped (") and \
        "the overlay state is kept" in proc.stderr, proc.stderr
    assert engine.rollback(site)["message"] == "rolled back; vLLM is pristine again"
    _assert_clean(tree)
    tree.assert_pristine(full=True)

"""File-system primitives of the engine: hashing, the one write primitive, moves, removals, the lock.

Every change the engine makes goes through the `os` calls of this module (`os.open`/`os.write`/`os.replace`/
`os.link`/`os.unlink`/`os.rmdir`/`os.mkdir`), never through `shutil` or `Path.write_*`, so tests can kill the
process or make a call fail before or after any single one of them by patching the `os` module.

- `write_file` stages into a temp file it creates itself (O_CREAT|O_EXCL|O_NOFOLLOW, a random name, so a
  planted file or link is never written through), fsyncs it and renames it over the target: a crash leaves
  either the old or the new file, never a torn one.
- Nothing here follows a symbolic link: reads open with O_NOFOLLOW, `remove_tree` unlinks links instead of
  descending into them, and `first_link` finds a link among the folders of a path before the engine uses it."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat
from contextlib import suppress
from pathlib import Path

from .errors import UserError

# `file_sha256` of something that is there but is not a regular file (a link, a folder, a fifo)
NOT_A_FILE = "not a regular file"
_TEMP_SUFFIX = ".dsa-overlay-tmp"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_regular(path: Path) -> bytes | None:
    """A regular file's bytes, read without following a link; None when nothing is there. Something else
    in its place raises OSError: ELOOP for a link, EISDIR for a folder, fifo or device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError:  # a parent is a file
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise IsADirectoryError(errno.EISDIR, "not a regular file", str(path))
        return f.read()


def read_or_none(path: Path) -> bytes | None:
    """A regular file's bytes; None when there is no such file or it is a link, folder or device."""
    try:
        return read_regular(path)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            return None
        raise


def file_sha256(path: Path) -> str | None:
    """sha256 of a regular file; None when absent; NOT_A_FILE for a link, folder or device."""
    try:
        data = read_regular(path)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            return NOT_A_FILE
        raise
    return None if data is None else sha256(data)


def is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(_TEMP_SUFFIX)


def _temp_candidate(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{_TEMP_SUFFIX}")


def temps_of(path: Path) -> list[Path]:
    """Staging files `write_file` left beside `path` (a process killed mid-write): regular files only."""
    prefix = f".{path.name}."
    found = []
    with suppress(OSError):
        with os.scandir(path.parent) as entries:
            for e in entries:
                if e.name.startswith(prefix) and e.name.endswith(_TEMP_SUFFIX) and e.is_file(follow_symlinks=False):
                    rest = e.name[len(prefix): -len(_TEMP_SUFFIX)]
                    if len(rest) == 8 and all(c in "0123456789abcdef" for c in rest):
                        found.append(path.parent / e.name)
    return sorted(found)


def write_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Atomically make `path` hold `data` with permission bits `mode` (replacing a link, never following it)."""
    for attempt in range(16):
        tmp = _temp_candidate(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:
            if attempt == 15:
                raise
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)  # not the umask's bits: the mode we were asked for
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):  # a removal that fails here is found on disk by `temps_of` and reported
            os.unlink(tmp)
        raise


def move(src: Path, dest: Path) -> None:
    """Rename `src` over `dest` (same file system): needs no free space, so it works on a full disk."""
    os.replace(src, dest)


def link_or_copy(src: Path, dest: Path, data: bytes, mode: int) -> None:
    """Make `dest` a second name of `src`'s file (no data written: the original inode, mode and times are
    kept), or a copy of `data` where the file system has no hard links."""
    try:
        os.link(src, dest, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES):
            raise
        write_file(dest, data, mode)


def make_dir(path: Path) -> None:
    os.mkdir(path, 0o755)


def make_dirs(path: Path, stop: Path) -> None:
    """Create `path` and its missing parents below `stop` (which must exist)."""
    missing = []
    p = path
    while p != stop and not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        make_dir(p)


def remove_file(path: Path) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def remove_tree(path: Path, keep_last: str | None = None) -> None:
    """Delete the folder `path` and everything in it, bottom up, unlinking links instead of following them.
    `keep_last` names a file directly in `path` removed after everything else (just before the folder)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    last = None
    with os.scandir(path) as entries:
        children = sorted(entries, key=lambda e: e.name)
    for e in children:
        if e.name == keep_last:
            last = Path(e.path)
        elif e.is_dir(follow_symlinks=False):
            remove_tree(Path(e.path))
        else:
            os.unlink(e.path)
    if last is not None:
        os.unlink(last)
    os.rmdir(path)


def remove_pycache(source: Path) -> None:
    """Delete `__pycache__/<stem>.*.pyc` of a source file (and the folder if that empties it); best effort."""
    cache = source.parent / "__pycache__"
    if not cache.is_dir() or cache.is_symlink():
        return
    for pyc in sorted(cache.glob(f"{source.stem}.*.pyc")):
        with suppress(OSError):
            os.unlink(pyc)
    with suppress(OSError):
        if not any(cache.iterdir()):
            os.rmdir(cache)


def first_link(root: Path, rel: str, skip: int = 1) -> Path | None:
    """The first symbolic link among `root/rel`'s components after the first `skip` (the `vllm/` package
    folder itself is trusted), or None. Stops at the first component that does not exist."""
    p = root
    for i, part in enumerate(Path(rel).parts):
        p = p / part
        if i < skip:
            continue
        if p.is_symlink():
            return p
        if not p.exists():
            return None
    return None


def writable_problem(path: Path) -> str | None:
    """Why the directory `path` (or, if absent, its nearest existing parent) cannot be written; None if it can."""
    probe = path
    while not os.path.lexists(probe):
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None


def space_problem(folder: Path, need_bytes: int, need_inodes: int) -> str | None:
    """Why the file system of `folder` cannot hold `need_bytes` and `need_inodes` more; None if it can
    (or does not say: a file system reporting no inode counts is not checked for inodes)."""
    st = os.statvfs(folder)
    free_bytes = st.f_bavail * st.f_frsize
    short = []
    if free_bytes < need_bytes:
        short.append(f"{_mib(need_bytes)} needed, {_mib(free_bytes)} free")
    if st.f_files and st.f_favail < need_inodes:
        short.append(f"{need_inodes} inodes needed, {st.f_favail} free")
    return f"{folder}: not enough free space ({'; '.join(short)})" if short else None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Lock:
    """An exclusive `flock` on the `vllm/` package directory itself, held for a whole apply or rollback.

    Locking the directory (which is never created or removed by the engine) instead of a lock file means
    nothing is left behind after a rollback, and there is no window in which a waiting process could lock
    a lock file that the holder is deleting."""

    def __init__(self, package_dir: Path, wait: bool = False):
        self.path = package_dir
        self.wait = wait
        self.fd: int | None = None

    def __enter__(self) -> "Lock":
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UserError(
                    f"{self.path}: another dsa-overlay apply/rollback is running on this vLLM; "
                    "wait for it to finish (or pass --wait)"
                ) from None
            raise
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

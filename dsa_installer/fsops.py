"""File-system primitives of the engine: hashing, the one write primitive, removals, the lock.

Every byte the engine puts on disk goes through `write_file` (temp file in the same directory, fsync,
`os.replace`), so a crash leaves either the old or the new file, never a torn one, and tests can make
the n-th write fail by replacing this one function."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
from contextlib import suppress
from pathlib import Path

from .errors import UserError


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_or_none(path: Path) -> bytes | None:
    """A regular file's bytes, or None when there is no such file."""
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def file_sha256(path: Path) -> str | None:
    data = read_or_none(path)
    return None if data is None else sha256(data)


def temp_path(path: Path) -> Path:
    """Where `write_file` stages `path` (left behind only if the process dies mid-write)."""
    return path.with_name(f".{path.name}.dsa-overlay-tmp")


def write_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Atomically make `path` hold `data` with permission bits `mode`."""
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # O_CREAT applies the umask; keep the mode we were asked for
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def remove_file(path: Path) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def remove_pycache(source: Path) -> None:
    """Delete `__pycache__/<stem>.*.pyc` of a source file (and the folder if that empties it)."""
    cache = source.parent / "__pycache__"
    for pyc in cache.glob(f"{source.stem}.*.pyc"):
        remove_file(pyc)
    with suppress(OSError):
        cache.rmdir()


def writable_problem(path: Path) -> str | None:
    """Why the directory `path` (or, if absent, its nearest existing parent) cannot be written; None if it can."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None


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

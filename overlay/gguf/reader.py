"""A GGUF header reader: metadata and tensor infos of one file or of a split set, never tensor data.

Nothing here is glm-dsa specific; it needs only the standard library.  The ggml type table sizes every
tensor, so a truncated shard is found from its header alone.

Any file gets an answer: the header is read with bounded reads (never a mapping of the whole file),
every count and length is checked against the bytes left in the file and against the limits below
before anything is allocated, and every problem (no such file, a directory, a FIFO, an unreadable
file, a header that runs past the end, ...) is a one-line ``GGUFError``.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any

# ggml types: id -> (name, block size in elements, bytes per block).  Stable ids from ggml.h.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
DENSE_TYPES = {"F32", "F16", "BF16"}
# what vLLM's GGUF linear/embedding/MoE kernels take (vllm/model_executor/layers/quantization/gguf.py:
# UNQUANTIZED_TYPES | DEQUANT_TYPES, identical in 0.16.0 and 0.23.0)
VLLM_GGUF_TYPES = DENSE_TYPES | {
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_M", "IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL",
}
GGML_ID = {name: i for i, (name, _, _) in GGML_TYPES.items()}

# Limits a header must keep to be read at all: far above any real model (GLM-5: under 2,000 tensors, a
# 154,880-token vocabulary with its types and merges), low enough that a hostile header costs well under a
# second and little memory.
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16
MAX_ARRAY_ELEMENTS = 1 << 21      # all metadata array elements of one file together
MAX_STRING = 1 << 26              # bytes of one metadata string (embedded tokenizer.json files are ~10 MB)
MAX_NAME = 1 << 10                # bytes of one tensor name (ggml's own limit is 64)
MAX_NESTING = 3                   # arrays of arrays of arrays
MAX_DIMS = 4                      # GGML_MAX_DIMS
MAX_SHARDS = 99999                # llama-gguf-split numbers parts with five digits
_CHUNK = 1 << 20


class GGUFError(ValueError):
    """A problem with a GGUF file; the message is one line naming the file/tensor and what to do."""


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]       # numpy / torch order (ggml ne reversed): HF layout
    ggml_type: int
    offset: int                  # absolute byte offset in its shard
    path: str                    # the shard holding it

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type{self.ggml_type}", 0, 0))[0]

    @property
    def nbytes(self) -> int:
        name, block, size = GGML_TYPES.get(self.ggml_type, ("?", 0, 0))
        if not block:
            return -1
        n = 1
        for d in self.shape:
            n *= d
        return n // block * size

    def layout_problem(self) -> str | None:
        """Why ggml cannot hold this tensor as declared (unknown type, rows that are not whole blocks)."""
        if self.ggml_type not in GGML_TYPES:
            return (f"tensor {self.name} has unknown ggml type id {self.ggml_type}; re-quantize it with a "
                    "llama.cpp type vLLM supports (e.g. Q4_K)")
        name, block, _ = GGML_TYPES[self.ggml_type]
        row = self.shape[-1] if self.shape else 1
        if row % block:
            return (f"tensor {self.name}: ggml type {name} packs rows in blocks of {block} elements, but its "
                    f"rows have {row}; the file is corrupt, re-convert it")
        return None


@dataclass
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int
    file_size: int

    @property
    def arch(self) -> str | None:
        return self.metadata.get("general.architecture")


# metadata value types (gguf.h): id -> struct format of one scalar
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


def _open_problem(path: str, exc: OSError, shard_of: int = 0) -> str:
    """One line saying why ``path`` cannot be opened (shard_of: the part count when it is a missing shard)."""
    if exc.errno == errno.ENOENT:
        if os.path.islink(path):
            return f"{path}: broken symlink (its target {os.readlink(path)} does not exist)"
        if shard_of:
            return (f"{path}: shard missing ({shard_of} expected); download every -of- part into "
                    f"{os.path.dirname(path) or '.'}")
        return f"{path}: no such file"
    if exc.errno == errno.ELOOP:
        return f"{path}: symlink loop (the link resolves back to itself); point it at the .gguf file"
    if exc.errno == errno.ENOTDIR:
        return f"{path}: a part of the path is a file, not a folder"
    if exc.errno == errno.EACCES or exc.errno == errno.EPERM:
        return f"{path}: permission denied; make the file (and its folders) readable to this user"
    return f"{path}: cannot read ({exc.strerror or exc})"


_KIND = ((stat.S_ISDIR, "a directory, not a GGUF file; give the .gguf file (of a split model: its -00001-of- part)"),
         (stat.S_ISFIFO, "a named pipe (FIFO), not a GGUF file; give the downloaded .gguf file"),
         (stat.S_ISCHR, "a character device, not a GGUF file"),
         (stat.S_ISBLK, "a block device, not a GGUF file"),
         (stat.S_ISSOCK, "a socket, not a GGUF file"))


def _kind_problem(path: str, mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return f"{path}: " + next((f"is {what}" for test, what in _KIND if test(mode)), "is not a regular file")


def _open_regular(path: str, shard_of: int = 0) -> tuple[int, int]:
    """(fd, size) of a regular file, opened without blocking (a FIFO never hangs us)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise GGUFError(_open_problem(path, exc, shard_of)) from None
    if (msg := _kind_problem(path, st.st_mode)) is not None:
        raise GGUFError(msg)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise GGUFError(_open_problem(path, exc, shard_of)) from None
    st = os.fstat(fd)
    if (msg := _kind_problem(path, st.st_mode)) is not None:   # swapped after the stat
        os.close(fd)
        raise GGUFError(msg)
    return fd, st.st_size


class _Header:
    """Sequential reads from the header of an open file: bounded, checked against the file size."""

    def __init__(self, fd: int, path: str, size: int):
        self.fd, self.path, self.size = fd, path, size
        self.buf, self.base, self.pos = b"", 0, 0
        self.elements = 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> int:
        """Make bytes [pos, pos+n) available; the offset of pos in self.buf."""
        if n > self.size - self.pos:
            raise self.fail(f"{what} at byte {self.pos} runs past the end of the file ({self.size} bytes): "
                            "truncated download or not a GGUF file")
        i = self.pos - self.base
        if i + n > len(self.buf):
            keep = self.buf[i:]
            want = max(n - len(keep), _CHUNK)
            try:
                more = os.pread(self.fd, want, self.pos + len(keep))
            except OSError as exc:
                raise self.fail(f"cannot read ({exc.strerror or exc})") from None
            self.buf, self.base, i = keep + more, self.pos, 0
            if len(self.buf) < n:
                raise self.fail(f"{what} at byte {self.pos}: the file ended while being read (it is changing?)")
        return i

    def unpack(self, fmt: str, what: str) -> tuple:
        n = struct.calcsize(fmt)
        i = self.need(n, what)
        self.pos += n
        return struct.unpack_from(fmt, self.buf, i)

    def string(self, what: str, limit: int = MAX_STRING) -> str:
        n, = self.unpack("<Q", what)
        if n > limit:
            raise self.fail(f"{what} at byte {self.pos - 8} claims {n} bytes (at most {limit} accepted): "
                            "corrupt header")
        i = self.need(n, what)
        self.pos += n
        return self.buf[i:i + n].decode("utf-8", errors="replace")

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` strings: the plain ``string`` inlined for those already in the buffer (tokenizer arrays)."""
        out, unpack = [], _U64.unpack_from
        for _ in range(n):
            buf, i = self.buf, self.pos - self.base
            if i + 8 <= len(buf):
                length, = unpack(buf, i)
                if length <= MAX_STRING and i + 8 + length <= len(buf):
                    out.append(buf[i + 8:i + 8 + length].decode("utf-8", errors="replace"))
                    self.pos += 8 + length
                    continue
            out.append(self.string(what))
        return out

    def count(self, n: int, min_bytes: int, what: str) -> None:
        """Refuse an element count the rest of the file cannot hold or the limits do not allow."""
        self.elements += n
        if n * min_bytes > self.size - self.pos or self.elements > MAX_ARRAY_ELEMENTS:
            raise self.fail(f"{what} at byte {self.pos} claims {n} elements, more than the file can hold "
                            f"or than {MAX_ARRAY_ELEMENTS} in all: corrupt header")

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string(f"the string of {key}")
        if vtype in _SCALAR:
            return self.unpack("<" + _SCALAR[vtype], f"the value of {key}")[0]
        if vtype != _ARRAY:
            raise self.fail(f"metadata key {key} has unknown value type {vtype} at byte {self.pos - 4}: "
                            "corrupt header or a newer GGUF format")
        if depth >= MAX_NESTING:
            raise self.fail(f"metadata key {key} nests arrays deeper than {MAX_NESTING} levels: corrupt header")
        etype, n = self.unpack("<IQ", f"the array header of {key}")
        if etype == _STRING:
            self.count(n, 8, f"the string array {key}")
            return self.strings(n, f"a string of {key}")
        if etype in _SCALAR:
            fmt = _SCALAR[etype]
            self.count(n, struct.calcsize(fmt), f"the array {key}")
            return list(self.unpack(f"<{n}{fmt}", f"the array {key}"))
        if etype == _ARRAY:
            self.count(n, 12, f"the array {key}")
            return [self.value(_ARRAY, key, depth + 1) for _ in range(n)]
        raise self.fail(f"metadata key {key} is an array of unknown value type {etype}: corrupt header")


def _alignment(path: str, meta: dict[str, Any]) -> int:
    align = meta.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align > 1 << 30 \
            or align & (align - 1):
        raise GGUFError(f"{path}: general.alignment is {show(align)}, expected a power of two: corrupt header")
    return align


def show(v: Any, width: int = 40) -> str:
    """A metadata value for a one-line message: short, with its kind."""
    kind = ("a boolean" if isinstance(v, bool) else "an integer" if isinstance(v, int) else
            "a float" if isinstance(v, float) else "a string" if isinstance(v, str) else
            f"an array of {len(v)}" if isinstance(v, list) else type(v).__name__)
    text = repr(v)
    return f"{text[:width] + '...' if len(text) > width else text} ({kind})"


def read_header(path: str | os.PathLike, shard_of: int = 0) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor infos (bounded reads, no tensor data touched).

    ``shard_of``: the part count when ``path`` is a shard named by another part (a missing one says so)."""
    path = os.fspath(path)
    fd, size = _open_regular(path, shard_of)
    try:
        return _parse(_Header(fd, path, size))
    finally:
        os.close(fd)


def _parse(h: _Header) -> GGUFHeader:
    path, size = h.path, h.size
    if size < 24:
        raise h.fail(f"{size} bytes is too short for a GGUF file (truncated download?)")
    magic, version, n_tensors, n_kv = h.unpack("<4sIQQ", "the file header")
    if magic != b"GGUF":
        raise h.fail(f"not a GGUF file (magic {magic!r})")
    if version not in (2, 3):
        raise h.fail(f"GGUF version {version} (big-endian or unsupported); re-convert with a current llama.cpp")
    # a key takes >= 13 bytes (length, one byte of name, type), a tensor info >= 32
    if n_kv > MAX_KV or n_kv * 13 > size - 24:
        raise h.fail(f"the header claims {n_kv} metadata keys, more than the file can hold: corrupt header")
    if n_tensors > MAX_TENSORS or n_tensors * 32 > size - 24:
        raise h.fail(f"the header claims {n_tensors} tensors, more than the file can hold "
                     f"(or than {MAX_TENSORS}): corrupt header")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = h.string("a metadata key", MAX_NAME)
        vtype, = h.unpack("<I", f"the value type of {key}")
        if key in meta:
            raise h.fail(f"metadata key {key} appears twice: corrupt header")
        meta[key] = h.value(vtype, key)
    raw = []
    names = set()
    for _ in range(n_tensors):
        name = h.string("a tensor name", MAX_NAME)
        n_dims, = h.unpack("<I", f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise h.fail(f"tensor {name} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS}): corrupt header")
        *ne, gtype, off = h.unpack(f"<{n_dims}QIQ", f"the tensor info of {name}")
        n = 1
        for d in ne:
            n *= d
        if n >= 1 << 63:
            raise h.fail(f"tensor {name} has {n} elements (dimensions {ne}): corrupt header")
        if name in names:
            raise h.fail(f"tensor {name} appears twice: corrupt header")
        names.add(name)
        raw.append((name, tuple(int(x) for x in reversed(ne)), gtype, off))
    align = _alignment(path, meta)
    data_start = (h.pos + align - 1) // align * align
    tensors = {n: TensorInfo(n, shp, t, data_start + off, path) for n, shp, t, off in raw}
    return GGUFHeader(path, version, meta, tensors, data_start, size)


_SPLIT_RE = re.compile(r"-(\d+)-of-(\d+)\.gguf$")


def shard_paths(path: str | os.PathLike) -> list[str]:
    """All shard paths of a split GGUF (given any shard), or ``[path]``; missing shards included."""
    path = os.fspath(path)
    m = _SPLIT_RE.search(path)
    if not m:
        return [path]
    width, index, total = len(m.group(1)), int(m.group(1)), int(m.group(2))
    if not 1 <= index <= total <= MAX_SHARDS:
        raise GGUFError(f"{path}: the name says part {index} of {total}, which no split set has "
                        "(llama-gguf-split names them -00001-of-0000N.gguf); rename the file")
    prefix, suffix = path[:m.start(1)], path[m.end(2):]
    return [f"{prefix}{i:0{width}d}-of-{total:0{len(m.group(2))}d}{suffix}" for i in range(1, total + 1)]


def read_model(path: str | os.PathLike) -> list[GGUFHeader]:
    """Headers of every shard (first shard first); a missing shard is a one-line GGUFError."""
    paths = shard_paths(path)
    given = os.fspath(path)
    return [read_header(p, 0 if p == given else len(paths)) for p in paths]


def merged_tensors(headers: list[GGUFHeader]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for h in headers:
        out.update(h.tensors)
    return out

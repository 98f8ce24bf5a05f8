"""A GGUF header reader: metadata and tensor infos of one file or of a split set, never tensor data.

Nothing here is glm-dsa specific; it needs only the standard library.  The ggml type table sizes every
tensor, so a truncated shard is found from its header alone.
"""
from __future__ import annotations

import mmap
import os
import re
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


class GGUFError(ValueError):
    """A problem with a GGUF file; the message is one line naming the file/tensor and what to do."""


# ----------------------------------------------------------------------------------------------
# header parsing (no tensor data is read)

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


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor infos (memory-mapped, no tensor data touched)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes is too short for a GGUF file (truncated download?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r})")
        version, = struct.unpack_from("<I", mm, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} (big-endian or unsupported); "
                            "re-convert with a current llama.cpp")
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        pos = 24

        def need(n: int) -> None:
            if pos + n > size:
                raise GGUFError(f"{path}: header ends past the end of the file (truncated at {size} bytes)")

        def string() -> str:
            nonlocal pos
            need(8)
            n, = struct.unpack_from("<Q", mm, pos)
            need(8 + n)
            s = mm[pos + 8:pos + 8 + n].decode("utf-8", errors="replace")
            pos += 8 + n
            return s

        def value(vtype: int) -> Any:
            nonlocal pos
            if vtype == 8:
                return string()
            if vtype == 9:
                need(12)
                etype, count = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if etype == 8:
                    return [string() for _ in range(count)]
                if etype in _ARRAY_FMT:
                    fmt = f"<{count}{_ARRAY_FMT[etype]}"
                    need(struct.calcsize(fmt))
                    out = list(struct.unpack_from(fmt, mm, pos))
                    pos += struct.calcsize(fmt)
                    return out
                return [value(etype) for _ in range(count)]
            if vtype not in _SCALAR:
                raise GGUFError(f"{path}: unknown metadata value type {vtype} at byte {pos}")
            need(struct.calcsize(_SCALAR[vtype]))
            v, = struct.unpack_from(_SCALAR[vtype], mm, pos)
            pos += struct.calcsize(_SCALAR[vtype])
            return v

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            need(4)
            vtype, = struct.unpack_from("<I", mm, pos)
            pos += 4
            meta[key] = value(vtype)
        raw = []
        for _ in range(n_tensors):
            name = string()
            need(4)
            n_dims, = struct.unpack_from("<I", mm, pos)
            need(4 + 8 * n_dims + 12)
            ne = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            gtype, off = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw.append((name, tuple(int(x) for x in reversed(ne)), gtype, off))
        align = int(meta.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
    tensors = {n: TensorInfo(n, shp, t, data_start + off, path) for n, shp, t, off in raw}
    return GGUFHeader(path, version, meta, tensors, data_start, size)


_SPLIT_RE = re.compile(r"-(\d+)-of-(\d+)\.gguf$")


def shard_paths(path: str | os.PathLike) -> list[str]:
    """All shard paths of a split GGUF (given any shard), or ``[path]``; missing shards included."""
    path = os.fspath(path)
    m = _SPLIT_RE.search(path)
    if not m:
        return [path]
    width, total = len(m.group(1)), int(m.group(2))
    prefix, suffix = path[:m.start(1)], path[m.end(2):]
    return [f"{prefix}{i:0{width}d}-of-{total:0{len(m.group(2))}d}{suffix}" for i in range(1, total + 1)]


def read_model(path: str | os.PathLike) -> list[GGUFHeader]:
    """Headers of every shard (first shard first); a missing shard is a one-line GGUFError."""
    headers = []
    for p in shard_paths(path):
        if not os.path.isfile(p):
            raise GGUFError(f"{p}: shard missing; download every *-of-* part into {os.path.dirname(p) or '.'}")
        headers.append(read_header(p))
    return headers


def merged_tensors(headers: list[GGUFHeader]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for h in headers:
        out.update(h.tensors)
    return out


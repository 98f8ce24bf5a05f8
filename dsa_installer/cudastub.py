"""A stand-in `libcuda.so.1` so vLLM's extension modules import on a machine without the NVIDIA driver.

vLLM's `*.so` files (and torch's CUDA libraries) link against the driver library. Without it `import
vllm.platforms.cuda` and everything behind it fails with "libcuda.so.1: cannot open shared object file",
which hides the real question verify asks (do the patched modules import?). The stub exports every
driver-API symbol (`cuXxx`) those libraries import, each returning 100 (CUDA_ERROR_NO_DEVICE), so the
libraries load and any actual CUDA use fails cleanly as "no device".

Symbols are read from the ELF dynamic symbol tables directly (no binutils needed); the library is
built with the system C compiler into ~/.cache/dsa-overlay/cudastub/<key>/libcuda.so.1."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

CUDA_ERROR_NO_DEVICE = 100
_DRIVER_SYMBOL = re.compile(rb"cu[A-Z]\w*")  # driver API; excludes cudaXxx (runtime), cublasXxx, ...
_CACHE = Path(os.environ.get("DSA_OVERLAY_CACHE", Path.home() / ".cache" / "dsa-overlay")) / "cudastub"


def have_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def libraries(site: Path) -> list[Path]:
    globs = ("vllm/*.so", "vllm/vllm_flash_attn/*.so", "torch/lib/*.so")
    return sorted(p for g in globs for p in site.glob(g) if p.is_file())


def undefined_symbols(lib: Path) -> set[str]:
    """Names of the undefined symbols in an ELF64 little-endian shared object's .dynsym."""
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:6] != b"\x7fELF\x02\x01":  # ELF, 64-bit, little-endian
            return set()
        return _undefined(data)


def _undefined(data) -> set[str]:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 11 or not entsize:  # SHT_DYNSYM
            continue
        stroff = sections[link][4]
        for i in range(1, size // entsize):
            st_name, _, _, st_shndx = struct.unpack_from("<IBBH", data, off + i * entsize)
            if st_shndx == 0 and st_name:  # SHN_UNDEF
                end = data.find(b"\0", stroff + st_name)
                names.add(data[stroff + st_name : end].decode())
    return names


def driver_symbols(site: Path) -> list[str]:
    found = set()
    for lib in libraries(site):
        found |= {s for s in undefined_symbols(lib) if _DRIVER_SYMBOL.fullmatch(s.encode())}
    return sorted(found)


def build(symbols: list[str], cc: str | None = None) -> Path:
    """The directory holding a stub libcuda.so.1 exporting `symbols` (built once per symbol set)."""
    key = hashlib.sha256("\n".join(symbols).encode()).hexdigest()[:16]
    out = _CACHE / key
    if (out / "libcuda.so.1").is_file():
        return out
    compiler = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc) to build the libcuda stub; install gcc")
    out.mkdir(parents=True, exist_ok=True)
    source = "".join(f"int {s}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for s in symbols)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        (Path(tmp) / "stub.c").write_text(source)
        lib = Path(tmp) / "libcuda.so.1"
        subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
                        str(Path(tmp) / "stub.c")], check=True, capture_output=True)
        os.replace(lib, out / "libcuda.so.1")
    return out


def stub_dir_for(site: Path) -> Path | None:
    """A directory to prepend to LD_LIBRARY_PATH for importing `site`'s vLLM, or None when a real driver
    is present (or nothing there imports the driver)."""
    if have_driver():
        return None
    symbols = driver_symbols(site)
    return build(symbols) if symbols else None

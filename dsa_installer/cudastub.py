"""A stand-in `libcuda.so.1` so vLLM's extension modules import on a machine without the NVIDIA driver.

vLLM's `*.so` files (and torch's CUDA libraries) link against the driver library. Without it `import
vllm.platforms.cuda` and everything behind it fails with "libcuda.so.1: cannot open shared object file",
which hides the real question verify asks (do the patched modules import?). The stub exports every
driver-API symbol (`cuXxx`) those libraries import, each returning 100 (CUDA_ERROR_NO_DEVICE), so the
libraries load and any actual CUDA use fails cleanly as "no device".

A venv whose torch is the CPU build (this machine serves torch 2.13.0's: vLLM 0.27+ venvs) has no
`libtorch_cuda.so` / `libc10_cuda.so`, which vLLM's extensions also link against; there the stub directory gets
those two as well, exporting the torch-CUDA symbols vLLM's libraries import and the CPU torch does not define
(c10::cuda streams, the AOTI CUDA shims, cuBLAS: ~10 names), each aborting with its name if it is ever called.

Symbols are read from the ELF dynamic symbol tables directly (no binutils needed); the libraries are
built with the system C compiler into ~/.cache/dsa-overlay/cudastub/<key>/."""

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


_MARKER = "dsa_overlay_cudastub"  # exported by the stub: a libcuda.so.1 that has it is not a driver


def have_driver() -> bool:
    """A real libcuda.so.1 loads here. Not the stub: once a process has loaded the stub by path, loading
    "libcuda.so.1" by name returns it."""
    try:
        return not hasattr(ctypes.CDLL("libcuda.so.1"), _MARKER)
    except OSError:
        return False


def libraries(site: Path) -> list[Path]:
    globs = ("vllm/*.so", "vllm/vllm_flash_attn/*.so", "torch/lib/*.so")
    return sorted(p for g in globs for p in site.glob(g) if p.is_file())


def undefined_symbols(lib: Path) -> set[str]:
    """Names of the undefined symbols in an ELF64 little-endian shared object's .dynsym."""
    return _dynsyms(lib, defined=False)


def defined_symbols(lib: Path) -> set[str]:
    """Names of the symbols an ELF64 little-endian shared object defines (exports) in its .dynsym."""
    return _dynsyms(lib, defined=True)


def _dynsyms(lib: Path, defined: bool) -> set[str]:
    with open(lib, "rb") as f:
        if f.read(6) != b"\x7fELF\x02\x01" or os.fstat(f.fileno()).st_size == 0:  # ELF, 64-bit, little-endian
            return set()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _symbols(data, defined)


def _symbols(data, defined: bool) -> set[str]:
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
            if st_name and (st_shndx != 0) == defined:  # SHN_UNDEF = 0
                end = data.find(b"\0", stroff + st_name)
                names.add(data[stroff + st_name : end].decode())
    return names


def driver_symbols(site: Path) -> list[str]:
    found = set()
    for lib in libraries(site):
        found |= {s for s in undefined_symbols(lib) if _DRIVER_SYMBOL.fullmatch(s.encode())}
    return sorted(found)


# What a CUDA build of torch exports and vLLM's extensions import from it (libtorch_cuda.so, libc10_cuda.so and the
# CUDA libraries they pull in); the libc / libstdc++ / Python symbols they import are found elsewhere.
_TORCH_CUDA_SYMBOL = re.compile(rb"(_ZN3c104cuda|_ZNK3c104cuda|_ZN2at4cuda|_ZNK2at4cuda|aoti_torch_\w*cuda|"
                                rb"torch_c10_cuda_|torch_get_current_cuda|cublas|cudnn|nccl|cusparse|curand|cufft|"
                                rb"cusolver)\w*")
TORCH_CUDA_LIBS = ("libtorch_cuda.so", "libc10_cuda.so")


def torch_cuda_symbols(site: Path) -> list[str]:
    """The torch-CUDA symbols `site`'s vLLM libraries import that its torch does not provide: none with a CUDA
    build of torch, a few with the CPU build (which lacks libtorch_cuda.so)."""
    if (site / "torch" / "lib" / TORCH_CUDA_LIBS[0]).exists():
        return []
    wanted = set()
    for lib in libraries(site):
        if "torch" not in lib.parts:
            wanted |= {s for s in undefined_symbols(lib) if _TORCH_CUDA_SYMBOL.fullmatch(s.encode())}
    if not wanted:
        return []
    have = set()
    for lib in [*site.glob("torch/lib/*.so*"), *site.glob("nvidia/**/lib*.so*")]:
        if lib.is_file():
            have |= defined_symbols(lib)
    return sorted(wanted - have)


def _compile(compiler: str, source: str, soname: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        (Path(tmp) / "stub.c").write_text(source)
        lib = Path(tmp) / soname
        subprocess.run([compiler, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{soname}", "-o", str(lib),
                        str(Path(tmp) / "stub.c")], check=True, capture_output=True)
        os.replace(lib, out / soname)


def build(symbols: list[str], cc: str | None = None, torch_cuda: list[str] = ()) -> Path:
    """The directory holding a stub libcuda.so.1 exporting the driver `symbols` and, given `torch_cuda` symbols,
    stub libtorch_cuda.so / libc10_cuda.so exporting those (built once per symbol set)."""
    key = hashlib.sha256("\n".join([_MARKER, *symbols, "--", *torch_cuda]).encode()).hexdigest()[:16]
    out = _CACHE / key
    names = ["libcuda.so.1", *(TORCH_CUDA_LIBS if torch_cuda else ())]
    if all((out / n).is_file() for n in names):
        return out
    compiler = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc) to build the libcuda stub; install gcc")
    out.mkdir(parents=True, exist_ok=True)
    _compile(compiler, f"int {_MARKER}(void) {{ return 1; }}\n"
             + "".join(f"int {s}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for s in symbols), "libcuda.so.1", out)
    if torch_cuda:
        body = "".join(f'void {s}(void) {{ stub("{s}"); }}\n' for s in torch_cuda)
        _compile(compiler, '#include <stdio.h>\n#include <stdlib.h>\nstatic void stub(const char *n) { fprintf(stderr, '
                 '"dsa-overlay cudastub: %s called: this torch is the CPU build\\n", n); abort(); }\n' + body,
                 TORCH_CUDA_LIBS[0], out)
        _compile(compiler, "", TORCH_CUDA_LIBS[1], out)
    return out


def stub_dir_for(site: Path) -> Path | None:
    """A directory to prepend to LD_LIBRARY_PATH for importing `site`'s vLLM, or None when a real driver
    is present (or nothing there imports the driver)."""
    if have_driver():
        return None
    symbols, torch_cuda = driver_symbols(site), torch_cuda_symbols(site)
    return build(symbols, torch_cuda=torch_cuda) if symbols or torch_cuda else None

"""Fixtures for the GGUF tests: tiny GLM-5 files made by llama.cpp's own tools (built once, cached).

The builder (tests/fixtures/make_glm_dsa_gguf.py) runs in its own venv (transformers >= 5), downloads
the llama-cpp-python sdist and builds llama-quantize/llama-gguf-split on first use; afterwards the
files come from ~/.cache/dsa-overlay/fixtures/<key>/.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "tests" / "fixtures" / "make_glm_dsa_gguf.py"


def build_fixture(variant: str) -> Path:
    proc = subprocess.run([sys.executable, str(BUILDER), "--variant", variant], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.fail(f"fixture builder failed ({variant}):\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


class Fixture:
    def __init__(self, root: Path):
        self.root = root
        self.info = json.loads((root / "fixture.json").read_text())
        self.hf = root / self.info["hf"]
        self.config = json.loads((self.hf / "config.json").read_text())

    def gguf(self, tag: str) -> str:
        return str(self.root / self.info["gguf"][tag])

    @property
    def split_first(self) -> str:
        return str(self.root / self.info["split"][0])


@pytest.fixture(scope="session")
def tiny() -> Fixture:
    return Fixture(build_fixture("tiny"))


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint (format: u64 header length, JSON header, data)."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        raw = f.read_bytes()
        n, = struct.unpack_from("<Q", raw, 0)
        header = json.loads(raw[8:8 + n])
        base = 8 + n
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            a, b = spec["data_offsets"]
            buf = bytearray(raw[base + a:base + b])
            out[name] = torch.frombuffer(buf, dtype=_ST_DTYPES[spec["dtype"]]).reshape(spec["shape"])
    return out


@pytest.fixture(scope="session")
def tiny_ref(tiny) -> dict[str, torch.Tensor]:
    return load_safetensors(tiny.hf)


@pytest.fixture(scope="session")
def fixtures_python() -> str:
    """The interpreter the builder used (it has transformers >= 5 and tokenizers)."""
    venv = os.environ.get("DSA_OVERLAY_FIXTURES_VENV")
    if venv:
        return str(Path(venv) / "bin" / "python")
    root = Path(os.environ.get("DSA_OVERLAY_FIXTURES", Path.home() / ".cache" / "dsa-overlay" / "fixtures"))
    py = root / "venv" / "bin" / "python"
    return str(py) if py.exists() else sys.executable

"""Stage a patched vLLM for CPU tests: a symlink copy of an installed `vllm` package with this
branch's diffs applied to real copies of the target files and the overlay dropped in as
`vllm/_dsa_overlay/` (kernels in `vllm/_dsa_overlay/kernels/`). The installed venv is never
written: every patched file is first replaced by a private copy.

Used until the engine's `apply.py` is available in the same checkout; it reads the same
`patches/<version>/manifest.toml`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBCUDA_STUB = Path("/work/venvs/libcuda-stub")


def venv_site_packages(venv: Path) -> Path | None:
    hits = sorted(venv.glob("lib/python3*/site-packages"))
    return hits[0] if hits and (hits[0] / "vllm").is_dir() else None


def apply_unified_diff(text: str, diff: str, name: str = "diff") -> str:
    """Apply a one-file unified diff whose context must match exactly (no fuzz); a hunk may
    have moved by a few lines. Raises ValueError naming the hunk otherwise."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    hunks = re.split(r"^(?=@@ )", diff, flags=re.M)[1:]
    for hunk in hunks:
        header, *body = hunk.splitlines(keepends=True)
        start = int(re.match(r"@@ -(\d+)", header).group(1)) - 1
        old = [l[1:] for l in body if l[:1] in (" ", "-")]
        new = [l[1:] for l in body if l[:1] in (" ", "+")]
        for offset in sorted(range(-50, 51), key=abs):
            at = start + offset
            if at >= pos and lines[at : at + len(old)] == old:
                break
        else:
            raise ValueError(f"{name}: hunk {header.strip()} does not match")
        out += lines[pos:at] + new
        pos = at + len(old)
    return "".join(out + lines[pos:])


def stage(site_packages: Path, version: str, dest: Path) -> Path:
    """Return a directory to put first on PYTHONPATH."""
    manifest = tomllib.loads((REPO / "patches" / version / "manifest.toml").read_text())
    subprocess.run(["cp", "-rs", str(site_packages / "vllm"), str(dest / "vllm")], check=True)
    for entry in manifest.get("patch", []):
        target = dest / entry["target"]
        real = target.resolve()
        digest = hashlib.sha256(real.read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            raise RuntimeError(f"{entry['target']}: sha256 {digest} is not the manifest's")
        target.unlink()
        shutil.copyfile(real, target)
        diff = REPO / "patches" / version / entry["diff"]
        target.write_text(apply_unified_diff(target.read_text(), diff.read_text(), diff.name))
    pkg = dest / "vllm" / "_dsa_overlay"
    (pkg / "kernels").mkdir(parents=True)
    for src in (REPO / "overlay").glob("*.py"):
        shutil.copyfile(src, pkg / src.name)
    for src in (REPO / "dsa_overlay" / "kernels").glob("*.py"):
        shutil.copyfile(src, pkg / "kernels" / src.name)
    for entry in manifest.get("dropin", []):
        shutil.copyfile(REPO / "patches" / version / entry["src"], dest / entry["dest"])
    return dest


def run_python(venv: Path, staged: Path, code: str, env_extra=None, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(staged)
    env["LD_LIBRARY_PATH"] = str(LIBCUDA_STUB)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(env_extra or {})
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True,
        timeout=timeout, cwd=str(staged),
    )


if __name__ == "__main__":  # manual use: python tests/backend/vllm_stage.py VENV VERSION DEST
    venv, version, dest = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dest.mkdir(parents=True, exist_ok=True)
    print(stage(venv_site_packages(venv), version, dest))

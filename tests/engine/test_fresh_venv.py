"""The README's first command on a real, fresh venv: bootstrap (pip install vllm, apply, verify), the
speculators hook proven inside the real vLLM, rollback, verify again, every installed file as pip wrote it."""

import base64
import csv
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from dsa_installer import cli as dsa_cli
from dsa_installer import cudastub, fsops

from .conftest import cli

pytestmark = pytest.mark.slow

PROBE = r"""
import os, sys, tempfile
import gguf
from vllm.transformers_utils.config import maybe_override_with_speculators
d = tempfile.mkdtemp()
for arch in ("glm-dsa", "deepseek2"):
    path = os.path.join(d, f"tiny-{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file(); w.close()
    try:
        print(arch, "->", maybe_override_with_speculators(path, "tok", False))
    except Exception as e:
        print(arch, "raised", type(e).__name__, str(e).splitlines()[0])
try:
    maybe_override_with_speculators(os.path.join(d, "missing-dir", "x.gguf"), None, False)
    print("missing -> no error")
except Exception as e:
    print("missing raised", type(e).__name__)
"""


def _probe(python: Path, site: Path) -> list[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    stub = cudastub.stub_dir_for(site)
    if stub:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(stub), env.get("LD_LIBRARY_PATH")]))
    proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=env, cwd=site.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if " -> " in line or " raised " in line]


def _record_problems(site: Path, version: str) -> list[str]:
    """Files of the vllm distribution that differ from pip's RECORD, and files under vllm/ it does not list
    (bytecode caches aside)."""
    record = site / f"vllm-{version}.dist-info" / "RECORD"
    listed, problems = set(), []
    for rel, digest, _ in csv.reader(record.read_text().splitlines()):
        listed.add(os.path.normpath(rel))
        if digest.startswith("sha256="):
            want = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4)).hex()
            if fsops.file_sha256(site / rel) != want:
                problems.append(f"changed {rel}")
    for path in (site / "vllm").rglob("*"):
        rel = os.path.relpath(path, site)
        if path.is_file() and "__pycache__" not in path.parts and rel not in listed:
            problems.append(f"extra {rel}")
    return problems


def test_bootstrap_apply_verify_rollback_in_a_fresh_venv():
    version = dsa_cli.DEFAULT_VLLM
    venv = Path(tempfile.mkdtemp(prefix="dsa-overlay-fresh-venv-"))
    shutil.rmtree(venv)
    try:
        boot = cli("bootstrap", "--venv", venv, "--vllm", version, timeout=1800)
        assert boot.returncode == 0, (boot.stdout + boot.stderr)[-3000:]
        assert "verify: all ok" in boot.stderr and "applied and verified" in boot.stdout
        (site,) = (venv / "lib").glob("python3*/site-packages")
        python = venv / "bin" / "python"

        st = json.loads(cli("status", "--vllm-site-packages", site, "--json").stdout)
        assert (st["state"], st["vllm_version"]) == ("applied", version)
        out = _probe(python, site)
        assert out[0].startswith("glm-dsa -> (") and out[0].endswith("tiny-glm-dsa.gguf', 'tok', None)"), out
        assert out[1].startswith("deepseek2 -> (") and out[1].endswith("tiny-deepseek2.gguf', 'tok', None)"), out
        assert out[2] == "missing raised OSError", out

        checked = cli("--vllm-site-packages", site, script="verify.py")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.rstrip().endswith("verify: all ok")

        rolled = cli("rollback", "--vllm-site-packages", site)
        assert rolled.returncode == 0, rolled.stderr
        assert _probe(python, site) == [
            "glm-dsa raised ValueError GGUF model with architecture glm-dsa is not supported yet.",
            "deepseek2 raised ValueError GGUF model with architecture deepseek2 is not supported yet.",
            "missing raised OSError",
        ]
        again = cli("--vllm-site-packages", site, script="verify.py")
        assert again.returncode == 0 and "no overlay applied (pristine targets)" in again.stdout, again.stdout
        assert _record_problems(site, version) == []
        assert not (site / "vllm/_dsa_overlay").exists() and not (site / "vllm/.dsa_overlay").exists()
    finally:
        shutil.rmtree(venv, ignore_errors=True)

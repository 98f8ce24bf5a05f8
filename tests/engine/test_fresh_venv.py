"""The README's first command as written, on a Python without click or unidiff: `python apply.py bootstrap`
makes a venv, installs this tool and vLLM into it, applies and verifies; that venv then runs `dsa-overlay
status` and `verify.py`, the speculators hook is proven inside the real vLLM, rollback restores every installed
file as pip wrote it. pip installs as configured (PIP_* variables pass through); the summary prints the
bootstrap's time and the venv's size."""

import base64
import csv
import json
import os
import shutil
import subprocess
import tempfile
import time
import venv
from pathlib import Path

import pytest

from dsa_installer import cudastub, fsops, gguf_plugin
from dsa_installer.bootstrap import DEFAULT_VLLM
from tests.conftest import TIMINGS

from .conftest import REPO

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


PLUGIN_PROBE = r"""
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_gguf_plugin import weights_adapter as wa
print("adapters ->", [c.__name__ for c in wa._ADAPTER_REGISTRY])
"""


def _probe(python: Path, site: Path, code: str = PROBE) -> list[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    stub = cudastub.stub_dir_for(site)
    if stub:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(stub), env.get("LD_LIBRARY_PATH")]))
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, cwd=site.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if " -> " in line or " raised " in line]


def _record_problems(site: Path, version: str, dist: str = "vllm", package: str = "vllm") -> list[str]:
    """Files of a distribution that differ from pip's RECORD, and files under its package it does not
    list (bytecode caches aside)."""
    record = site / f"{dist}-{version}.dist-info" / "RECORD"
    listed, problems = set(), []
    for rel, digest, _ in csv.reader(record.read_text().splitlines()):
        listed.add(os.path.normpath(rel))
        if digest.startswith("sha256="):
            want = base64.urlsafe_b64decode(digest[7:] + "=" * (-len(digest[7:]) % 4)).hex()
            if fsops.file_sha256(site / rel) != want:
                problems.append(f"changed {rel}")
    for path in (site / package).rglob("*"):
        rel = os.path.relpath(path, site)
        if path.is_file() and "__pycache__" not in path.parts and rel not in listed:
            problems.append(f"extra {rel}")
    return problems


def _size(path: Path) -> int:
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)


def _in_tree_gguf_probe(python: Path, site: Path) -> None:
    """vLLM <= 0.23.0: the speculators hook lets glm-dsa/deepseek2 GGUF files through vLLM's own loader."""
    out = _probe(python, site)
    assert out[0].startswith("glm-dsa -> (") and out[0].endswith("tiny-glm-dsa.gguf', 'tok', None)"), out
    assert out[1].startswith("deepseek2 -> (") and out[1].endswith("tiny-deepseek2.gguf', 'tok', None)"), out
    assert out[2] == "missing raised OSError", out


def test_readme_bootstrap_on_a_python_without_click():
    version = DEFAULT_VLLM
    work = Path(tempfile.mkdtemp(prefix="dsa-overlay-fresh-venv-"))
    bare, target = work / "bare", work / "venv"
    try:
        venv.create(bare, with_pip=False)  # the user's Python: its base interpreter, nothing installed
        probe = subprocess.run([bare / "bin/python", "-c", "import click"], capture_output=True, text=True)
        assert "No module named 'click'" in probe.stderr
        t0 = time.monotonic()
        boot = subprocess.run([bare / "bin/python", "apply.py", "bootstrap", "--venv", target, "--vllm", version],
                              cwd=REPO, capture_output=True, text=True, timeout=1800)
        seconds = time.monotonic() - t0
        assert boot.returncode == 0, (boot.stdout + boot.stderr)[-3000:]
        TIMINGS.append(f"README bootstrap (Python without click, vLLM {version}): {seconds:.0f} s, "
                       f"venv {_size(target) / 1e9:.1f} GB")
        assert "verify: all ok" in boot.stderr and "applied and verified" in boot.stdout
        assert [f"bootstrap [{n}/5]" in boot.stderr for n in range(1, 6)] == [True] * 5
        (site,) = (target / "lib").glob("python3*/site-packages")
        python, tool = target / "bin/python", target / "bin/dsa-overlay"

        st = subprocess.run([tool, "status", "--json"], capture_output=True, text=True)  # vllm of this venv
        assert st.returncode == 0, st.stderr
        st = json.loads(st.stdout)
        assert (st["state"], st["vllm_version"], st["site"]) == ("applied", version, str(site))
        if gguf_plugin.needed(version):      # vLLM >= 0.24: GGUF through vllm-gguf-plugin
            assert _probe(python, site, PLUGIN_PROBE) == ["adapters -> ['GlmDsaGGUFAdapter', 'Gemma3GGUFAdapter']"]
            plugin = gguf_plugin.installed_version(site)
            assert plugin == "0.0.3" and _record_problems(site, plugin, "vllm_gguf_plugin", "vllm_gguf_plugin") == []
        else:
            _in_tree_gguf_probe(python, site)

        checked = subprocess.run([python, "verify.py"], cwd=REPO, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.rstrip().endswith("verify: all ok")

        rolled = subprocess.run([tool, "rollback"], capture_output=True, text=True)
        assert rolled.returncode == 0, rolled.stderr
        if gguf_plugin.needed(version):
            assert _probe(python, site, PLUGIN_PROBE) == ["adapters -> ['Gemma3GGUFAdapter']"]
            assert _record_problems(site, "0.0.3", "vllm_gguf_plugin", "vllm_gguf_plugin") == []
        else:
            assert _probe(python, site) == [
                "glm-dsa raised ValueError GGUF model with architecture glm-dsa is not supported yet.",
                "deepseek2 raised ValueError GGUF model with architecture deepseek2 is not supported yet.",
                "missing raised OSError",
            ]
        again = subprocess.run([python, "verify.py"], cwd=REPO, capture_output=True, text=True)
        assert again.returncode == 0 and "no overlay applied (pristine targets)" in again.stdout, again.stdout
        assert _record_problems(site, version) == []
        assert not (site / "vllm/_dsa_overlay").exists() and not (site / "vllm/.dsa_overlay").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)

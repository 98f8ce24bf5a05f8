"""bootstrap: a fresh venv with a supported vLLM, the overlay applied and verified, in one command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from . import engine, manifest, verify
from .errors import UserError


def _step(cmd: list[str], what: str) -> None:
    click.echo(f"bootstrap: {what}", err=True)
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode:
        raise UserError(f"{what} failed (exit {proc.returncode}; its output is above); fix that and run bootstrap again")


def bootstrap(venv: Path, version: str) -> dict:
    supported = manifest.supported_versions()
    if version not in supported:
        raise UserError(f"--vllm {version}: no patch set for it (supported: {', '.join(supported)})")
    python = venv / "bin" / "python"
    if not python.exists():
        if venv.exists() and any(venv.iterdir()):
            raise UserError(f"{venv} exists and is not a venv; choose another --venv")
        _step([sys.executable, "-m", "venv", str(venv)], f"create venv {venv}")
    _step([str(python), "-m", "pip", "install", f"vllm=={version}"], f"pip install vllm=={version} into {venv}")
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    site = Path(out.stdout.strip())
    applied = engine.apply(site)
    click.echo(f"bootstrap: {'applied' if applied['changed'] else applied.get('message', 'applied')}", err=True)
    checked = verify.run(site, str(python))
    verify.render(checked, err=True)
    if not checked["ok"]:
        raise UserError(f"verify failed for {site} (table above); roll back with "
                        f"`apply.py rollback --vllm-site-packages {site}`")
    return {"action": "bootstrap", "venv": str(venv), "site": str(site), "vllm_version": version,
            "apply": applied, "verify": checked,
            "message": f"{venv}: vLLM {version} with dsa-overlay applied and verified; "
                       f"activate with `. {venv}/bin/activate`"}

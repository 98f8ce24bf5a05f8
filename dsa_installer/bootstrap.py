"""bootstrap: a venv with a supported vLLM, this tool, the overlay applied and verified, in one command.

It must run on a bare Python (>= 3.10 with pip, nothing else): `apply.py` comes here when click or unidiff
is missing (`main_without_dependencies`), so this module and what it imports use the standard library
only. The work that needs the tool's dependencies (apply, verify) runs inside the new venv, after
`pip install -e <checkout>` has put the tool and its dependencies there.

    [1/5] python -m venv VENV                    (an existing venv is reused)
    [2/5] VENV/bin/python -m pip install -e CHECKOUT   (dsa-overlay, click, unidiff; console script)
    [3/5] VENV/bin/python -m pip install vllm==X (from 0.24.0 with vllm-gguf-plugin and gguf in the same
          command: the plugin requires vllm unpinned, so installed alone it would upgrade vLLM)
    [4/5] VENV/bin/python apply.py --vllm-site-packages SITE
    [5/5] VENV/bin/python verify.py --vllm-site-packages SITE

Progress goes to stderr (one line per phase, pip's own output, apply's and verify's output); stdout gets
one closing line, or the JSON result with --json."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import gguf_plugin, resources
from .errors import UserError

DEFAULT_VLLM = "0.26.0"  # what `bootstrap` installs unless told otherwise (stated in README.md)
DEPENDENCIES = ("click", "unidiff") + (("tomli",) if sys.version_info < (3, 11) else ())
PHASES = 5


def missing_dependencies() -> list[str]:
    """The tool's runtime dependencies this Python cannot import."""
    return [name for name in DEPENDENCIES if importlib.util.find_spec(name) is None]


def supported_versions() -> list[str]:
    from .manifest import supported_versions  # reads folder names only; imports no dependency

    return supported_versions()


def pip_packages(version: str) -> list[str]:
    """What phase 3 installs, in one pip command: vLLM, and from 0.24.0 on the GGUF plugin pinned with it."""
    return [f"vllm=={version}", *(gguf_plugin.PINS if gguf_plugin.needed(version) else ())]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run(cmd: list[str], what: str, capture: bool = False, then: str | None = None) -> str:
    """Run `cmd` with its output on our stderr (stdout captured and returned when `capture`); a failure is
    a UserError saying `what` failed, then `then` (default: fix it and run bootstrap again)."""
    sys.stderr.flush()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE if capture else sys.stderr, stderr=sys.stderr, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout or "")  # what --json captured, shown with the failure
        then = then or "fix that and run `python apply.py bootstrap` again (it reuses the venv)"
        raise UserError(f"{what} failed (exit {proc.returncode}; its output is above); {then}")
    return proc.stdout or ""


def _tool(python: Path, checkout: Path | None, script: str, args: list[str]) -> list[str]:
    """The command line running this tool's `script` (apply.py or verify.py) with `python`."""
    if checkout is not None:
        return [str(python), str(checkout / script), *args]
    module = {"apply.py": "cli", "verify.py": "verify"}[script]
    return [str(python), "-c", f"from dsa_installer.{module} import main; main()", *args]


def bootstrap(venv: Path, version: str, as_json: bool = False, say: Callable[[str], None] = _say) -> dict:
    supported = supported_versions()
    if version not in supported:
        raise UserError(f"--vllm {version}: no patch set for it (supported: {', '.join(supported)})")
    python = venv / "bin" / "python"
    if not python.exists() and venv.exists() and (not venv.is_dir() or any(venv.iterdir())):
        raise UserError(f"{venv} exists and is not a venv; choose another --venv")
    checkout = resources.checkout_root()
    started = time.monotonic()

    def phase(n: int, text: str) -> None:
        say(f"bootstrap [{n}/{PHASES}] {text} ({_elapsed(started)} so far)")

    if python.exists():
        phase(1, f"reusing the venv {venv}")
    else:
        phase(1, f"creating the venv {venv} with {sys.executable}")
        _run([sys.executable, "-m", "venv", str(venv)], f"creating the venv {venv}")
    if checkout is not None:
        phase(2, f"pip install -e {checkout} into {venv} (dsa-overlay and its dependencies)")
        _run([str(python), "-m", "pip", "install", "-e", str(checkout)], f"pip install -e {checkout}")
        tool_python = python
    else:  # an installed dsa-overlay (no checkout to install from): apply and verify run with this Python
        phase(2, f"dsa-overlay is installed in {sys.executable}, not a checkout: apply and verify run from there")
        tool_python = Path(sys.executable)
    packages = pip_packages(version)
    phase(3, f"pip install {' '.join(packages)} into {venv} (minutes and about 10 GB in a fresh venv)")
    _run([str(python), "-m", "pip", "install", *packages], f"pip install {' '.join(packages)}")
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     f"asking {python} for its site-packages", capture=True).strip())
    at = ["--vllm-site-packages", str(site)] + (["--json"] if as_json else [])
    cmd = _tool(tool_python, checkout, "apply.py", ["apply", *at])
    phase(4, "apply: " + " ".join(cmd))
    applied = _run(cmd, "apply", capture=as_json)
    cmd = _tool(tool_python, checkout, "verify.py", at)
    phase(5, "verify: " + " ".join(cmd))
    checked = _run(cmd, f"verify of {site}", capture=as_json,
                   then=f"roll back with `python apply.py rollback --vllm-site-packages {site}`")
    then = (f"activate with `. {venv}/bin/activate`, then `dsa-overlay status`" if checkout is not None
            else f"`dsa-overlay status --vllm-site-packages {site}` shows it")
    return {"action": "bootstrap", "venv": str(venv), "site": str(site), "vllm_version": version,
            "apply": json.loads(applied) if as_json else None, "verify": json.loads(checked) if as_json else None,
            "seconds": round(time.monotonic() - started, 1),
            "message": f"{venv}: vLLM {version} with dsa-overlay applied and verified in {_elapsed(started)}; "
                       f"{then}"}


def _elapsed(since: float) -> str:
    s = int(time.monotonic() - since)
    return f"{s // 60}m{s % 60:02d}s"


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Create a venv, pip install vLLM and this tool, "
                                "apply the overlay, run verify (standard library only).")
    p.add_argument("--venv", type=Path, default=Path(".venv"), help="virtual environment to create or reuse "
                   "(default: .venv)")
    p.add_argument("--vllm", dest="version", default=DEFAULT_VLLM, help=f"vLLM release (default: {DEFAULT_VLLM})")
    p.add_argument("--json", dest="as_json", action="store_true", help="print machine-readable JSON")
    return p


def main_without_dependencies(argv: list[str], missing: list[str], script: str = "apply.py") -> None:
    """`apply.py` on a Python without click/unidiff: run `bootstrap`, refuse anything else in one line."""
    if script != "apply.py" or not argv or argv[0] != "bootstrap":
        command = " ".join([script, *argv[:1]]) if argv and not argv[0].startswith("-") else script
        print(f"error: {command} needs {', '.join(missing)}, which this Python ({sys.executable}) lacks; "
              "run `python apply.py bootstrap` (a venv with everything) or `pip install -e .`", file=sys.stderr)
        sys.exit(2)
    args = _parser(f"{script} bootstrap").parse_args(argv[1:])
    try:
        result = bootstrap(args.venv.absolute(), args.version, args.as_json)
    except UserError as exc:
        if args.as_json:
            print(json.dumps({"error": str(exc)}))
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result, indent=2) if args.as_json else result["message"])

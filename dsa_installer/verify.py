"""verify: import every patched and dropped-in module of a vLLM site-packages, in a subprocess.

The subprocess runs the interpreter of the venv that owns the site-packages (or `--python`), with the
site-packages first on sys.path and, on a machine without the NVIDIA driver, a generated stub
`libcuda.so.1` on LD_LIBRARY_PATH (see cudastub.py). Extension points inside the applied tree:
`vllm/_dsa_overlay/verify_hooks.py` with `report() -> str` (printed after the table), and on a GPU
`vllm/_dsa_overlay/kernels/selftest.py` with `main()` (None/0/True means passed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

import click

from . import cudastub, manifest, state
from .errors import UserError
from .site import default_site_packages, vllm_version

CHILD = Path(__file__).with_name("_verify_child.py")
PROGRESS = "@dsa-verify-progress "  # the marker of the child's progress lines (_verify_child.py)


def module_name(rel: str) -> str | None:
    """`vllm/a/b.py` -> `vllm.a.b`, `vllm/a/__init__.py` -> `vllm.a`; None for non-Python files."""
    if not rel.endswith(".py"):
        return None
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_to_check(site: Path) -> tuple[str, list[str]]:
    """(what is checked, module names): the applied files per the state, else the pristine targets."""
    current = state.load(site)
    if current is not None:
        rels = [f["path"] for f in current["patched"]] + [f["path"] for f in current["added"]]
        what = f"overlay applied (patch set {current['patch_set']})"
    else:
        version = vllm_version(site)
        if version not in manifest.supported_versions():
            raise UserError(f"vLLM {version} at {site} has no patch set and no overlay applied; nothing to verify")
        rels = [p.target for p in manifest.load(version).patches]
        what = "no overlay applied (pristine targets)"
    names = [m for m in map(module_name, rels) if m]
    return what, list(dict.fromkeys(names))


def interpreter_for(site: Path) -> str:
    """The python of the venv that owns `site` (…/lib/pythonX.Y/site-packages), else this one."""
    if site.name == "site-packages" and len(site.parents) > 2:
        venv = site.parents[2]
        exe = venv / "bin" / "python"
        if (venv / "pyvenv.cfg").is_file() and exe.exists():
            return str(exe)
    return sys.executable


def run(site: Path, python: str | None = None, timeout: float = 900,
        progress: Callable[[str], None] | None = None) -> dict:
    """Import the modules in a subprocess; `progress` gets one line as each step starts or ends."""
    say = progress or (lambda text: None)
    version = vllm_version(site)
    what, modules = modules_to_check(site)
    python = python or interpreter_for(site)
    env = dict(os.environ)
    stub = cudastub.stub_dir_for(site)
    if stub is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(stub), env.get("LD_LIBRARY_PATH")]))
    say(f"verify: vLLM {version} at {site}, {what}: importing {len(modules)} modules with {python} "
        "(the first one loads torch and vLLM: 5-20 s) ...")
    with tempfile.TemporaryDirectory(prefix="dsa-verify-") as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.Popen([python, "-I", str(CHILD), str(site), str(out), *modules], cwd=tmp, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed: list[bool] = []
        timer = threading.Timer(timeout, lambda: killed.append(True) or proc.kill())
        timer.start()
        try:
            log = _follow(proc, len(modules), say)
        finally:
            timer.cancel()
        if not out.is_file():
            tail = ([line.strip() for line in log if line.strip()] or ["no output"])[-1]
            why = f"took longer than {timeout:.0f} s" if killed else f"died with exit code {proc.returncode}: {tail}"
            raise UserError(f"verify subprocess ({python}) {why}")
        result = json.loads(out.read_text())
    ok = all(m["ok"] for m in result["modules"]) and all(
        (result[k] or {"ok": True})["ok"] for k in ("hooks", "selftest"))
    return {"site": str(site), "interpreter": python, "checked": what, "libcuda": str(stub) if stub else "system",
            "ok": ok, **result}


def _follow(proc: subprocess.Popen, total: int, say: Callable[[str], None]) -> list[str]:
    """Read the child's output to its end: progress lines go to `say`, the rest is returned."""
    log, done = [], 0
    for line in proc.stdout:
        if PROGRESS not in line:
            log.append(line)
            continue
        event = json.loads(line.split(PROGRESS, 1)[1])
        if event["step"] == "module":
            done += 1
            state = "ok" if event["ok"] else f"FAIL  {event['error']}"
            say(f"verify: [{done:{len(str(total))}}/{total}] {event['seconds']:6.2f} s  {event['module']}  {state}")
        else:
            say({"hooks": "verify: running vllm/_dsa_overlay/verify_hooks.py report() ...",
                 "selftest": "verify: running the kernel self-test on the GPU ..."}[event["step"]])
    proc.wait()
    return log


def render(r: dict, err: bool = False) -> None:
    echo = lambda text: click.echo(text, err=err)
    echo(f"{r['site']}: {r['checked']}; interpreter {r['interpreter']}; libcuda: {r['libcuda']}")
    width = max([len(m["module"]) for m in r["modules"]] + [6])
    echo(f"{'module':<{width}}  result  seconds")
    for m in r["modules"]:
        echo(f"{m['module']:<{width}}  {'ok' if m['ok'] else 'FAIL':<6}  {m['seconds']:7.2f}"
                   + ("" if m["ok"] else f"  {m['error']}"))
    for key, title in (("hooks", "verify hooks"), ("selftest", "kernel self-test")):
        if r[key] is not None:
            echo(f"{title}: {'ok' if r[key]['ok'] else 'FAIL'}\n{r[key]['report']}")
    echo("verify: all ok" if r["ok"] else "verify: FAILED")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--vllm-site-packages", "site", type=click.Path(path_type=Path),
              help="site-packages directory holding vllm/ (default: where this Python finds vllm).")
@click.option("--python", help="Interpreter for the import checks (default: the venv owning the site-packages).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def cli(site, python, as_json) -> None:
    """Import-time smoke test of every patched and dropped-in module (and a GPU kernel self-test)."""
    try:
        r = run((site or default_site_packages()).absolute(), python, progress=lambda t: click.echo(t, err=True))
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(json.dumps(r, indent=2)) if as_json else render(r)
    sys.exit(0 if r["ok"] else 1)


def main() -> None:
    cli(prog_name="verify.py")

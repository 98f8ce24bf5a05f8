"""The `apply.py` / `dsa-overlay` command line.

    apply.py [--vllm-site-packages PATH] [--dry-run] [--json] [--force-version X] [--wait]   (apply)
    apply.py rollback [--vllm-site-packages PATH] [--force] [--json] [--wait]
    apply.py status   [--vllm-site-packages PATH] [--json]
    apply.py bootstrap [--venv DIR] [--vllm VERSION]

A user mistake prints one line `error: ...` (plus `{"error": ...}` on stdout with --json) and exits 2.
More subcommands: define a click command (use `site_option`/`json_option`, `inherit` and `run`) and
register it with `cli.add_command(...)` at the bottom of this file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import click

from . import __version__, engine
from .errors import UserError
from .site import default_site_packages

DEFAULT_VLLM = "0.23.0"  # what `bootstrap` installs unless told otherwise (stated in README.md)


def site_option(f: Callable) -> Callable:
    return click.option(
        "--vllm-site-packages", "site", type=click.Path(path_type=Path, file_okay=False),
        help="site-packages directory holding vllm/ (default: where this Python finds vllm).",
    )(f)


def json_option(f: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(f)


def wait_option(f: Callable) -> Callable:
    return click.option("--wait", is_flag=True, help="Wait for a concurrent apply/rollback instead of failing.")(f)


def run(as_json: bool, action: Callable[[], dict], render: Callable[[dict], None]) -> None:
    """Call `action`; print its result as JSON or through `render`; a UserError becomes `error: ...`, exit 2."""
    try:
        result = action()
    except UserError as exc:
        if as_json:
            click.echo(json.dumps({"error": str(exc)}))
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        render(result)


def inherit(ctx: click.Context, **given) -> list:
    """A subcommand's options, each falling back to the same option given before the subcommand."""
    parent = ctx.obj or {}
    return [value or parent.get(name) for name, value in given.items()]


def resolve_site(site: Path | None) -> Path:
    return (site or default_site_packages()).absolute()


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@site_option
@click.option("--dry-run", is_flag=True, help="Print the unified diff and the files it would add; change nothing.")
@json_option
@click.option("--force-version", metavar="X", help="Use patch set X on another vLLM release (exact context only).")
@wait_option
@click.version_option(__version__, prog_name="dsa-overlay")
@click.pass_context
def cli(ctx, site, dry_run, as_json, force_version, wait) -> None:
    """Apply the dsa-overlay patch set to an installed vLLM (the default action), or roll it back."""
    if ctx.invoked_subcommand is not None:
        if dry_run or force_version:
            raise click.UsageError("--dry-run and --force-version belong to apply; use them without a subcommand")
        ctx.obj = {"site": site, "as_json": as_json, "wait": wait}  # `apply.py --vllm-site-packages P status`
        return
    run(as_json, lambda: engine.apply(resolve_site(site), force_version, wait, dry_run), _render_apply)


@cli.command()
@site_option
@click.option("--force", is_flag=True, help="Restore pristine files even where they were edited after apply.")
@json_option
@wait_option
@click.pass_context
def rollback(ctx, site, force, as_json, wait) -> None:
    """Restore every patched file byte for byte and remove every added file."""
    site, as_json, wait = inherit(ctx, site=site, as_json=as_json, wait=wait)
    run(as_json, lambda: engine.rollback(resolve_site(site), force, wait), _render_rollback)


@cli.command()
@site_option
@json_option
@click.pass_context
def status(ctx, site, as_json) -> None:
    """Show the vLLM version, whether it is supported, and the overlay state per file."""
    site, as_json = inherit(ctx, site=site, as_json=as_json)
    run(as_json, lambda: engine.status(resolve_site(site)), _render_status)


@cli.command()
@click.option("--venv", type=click.Path(path_type=Path, file_okay=False), default=Path(".venv"), show_default=True,
              help="Virtual environment to create (or reuse).")
@click.option("--vllm", "version", default=DEFAULT_VLLM, show_default=True, help="vLLM release to install.")
@json_option
def bootstrap(venv, version, as_json) -> None:
    """Create a venv, pip install vLLM, apply the overlay, run verify."""
    from . import bootstrap as boot

    run(as_json, lambda: boot.bootstrap(venv.absolute(), version), lambda r: click.echo(r["message"]))


def _render_apply(r: dict) -> None:
    head = f"vLLM {r['vllm_version']} at {r['site']}"
    if r["action"] == "dry-run":
        click.echo(r["diff"], nl=False)
        for path in r["added"]:
            click.echo(f"would add {path}")
        click.echo(f"{head}: dry run of patch set {r['patch_set']}{_forced(r)}; nothing changed")
        return
    if not r["changed"]:
        click.echo(f"{head}: {r['message']} (dsa-overlay {r['overlay_version']}, patch set {r['patch_set']})")
        return
    for f in r["patched"]:
        moved = [o for o in f["offsets"] if o]
        click.echo(f"patched  {f['path']}" + (f"  (hunks shifted by {moved})" if moved else ""))
    for path in r["added"]:
        click.echo(f"added    {path}")
    click.echo(f"{head}: applied patch set {r['patch_set']}{_forced(r)} (dsa-overlay {__version__}); "
               "undo with `apply.py rollback`")


def _render_rollback(r: dict) -> None:
    for path in r.get("restored", []):
        click.echo(f"restored {path}")
    for path in r.get("removed", []):
        click.echo(f"removed  {path}")
    click.echo(f"{r['site']}: {r['message']}")


def _render_status(r: dict) -> None:
    support = "supported" if r["supported"] else f"not supported (supported: {', '.join(r['supported_versions'])})"
    click.echo(f"vLLM {r['vllm_version']} at {r['site']}: {support}")
    state = r["state"]
    if "overlay_version" in r:
        state += f" (dsa-overlay {r['overlay_version']}, patch set {r['patch_set']}{_forced(r)})"
    click.echo(f"state: {state}")
    for f in r["files"]:
        click.echo(f"  {f['status']:<22} {f['path']}")


def _forced(r: dict) -> str:
    return f", forced onto vLLM {r['vllm_version']} by --force-version" if r.get("forced_version") else ""


def _register_extensions() -> None:
    from .gguf_check import check_gguf

    cli.add_command(check_gguf)


_register_extensions()


def main() -> None:
    cli(prog_name="apply.py")

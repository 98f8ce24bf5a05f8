"""The `apply.py` / `dsa-overlay` command line.

    apply.py [apply] [--vllm-site-packages PATH] [--dry-run] [--json] [--force-version X] [--wait]
    apply.py rollback [--vllm-site-packages PATH] [--force] [--json] [--wait]
    apply.py status   [--vllm-site-packages PATH] [--json]
    apply.py bootstrap [--venv DIR] [--vllm VERSION] [--json]   (also on a Python without click: bootstrap.py)

A user mistake prints one line `error: ...` (plus `{"error": ...}` on stdout with --json) and exits 2.
More subcommands: define a click command (use `site_option`/`json_option`, `inherit` and `run`) and
register it with `cli.add_command(...)` at the bottom of this file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import click

from . import __version__, engine, fsops, gguf_plugin
from .bootstrap import DEFAULT_VLLM
from .errors import UserError
from .site import default_site_packages


def site_option(f: Callable) -> Callable:
    # a plain path: a file or a missing folder is the engine's one-line `error:`, not a click usage error
    return click.option(
        "--vllm-site-packages", "site", type=click.Path(path_type=Path),
        help="site-packages directory holding vllm/ (default: where this Python finds vllm).",
    )(f)


def json_option(f: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(f)


def wait_option(f: Callable) -> Callable:
    return click.option("--wait", is_flag=True, help="Wait for a concurrent apply/rollback instead of failing.")(f)


def apply_options(f: Callable) -> Callable:
    """The options of apply, taken by the group (`apply.py [OPTIONS]`) and by `apply.py apply [OPTIONS]`."""
    f = wait_option(f)
    f = click.option("--force-version", metavar="X",
                     help="Use patch set X on another vLLM release (exact context only).")(f)
    f = json_option(f)
    f = click.option("--dry-run", is_flag=True, help="Print the unified diff and the files it would add; "
                     "change nothing.")(f)
    return site_option(f)


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


def announce_wait(site: Path, wait: bool) -> None:
    """With --wait, say before blocking that another apply/rollback holds the lock.

    The probe takes the free lock and drops it at once; an apply without --wait starting in that instant
    reports the lock as held, which is what it would report a moment later anyway."""
    if not wait:
        return
    try:
        with fsops.Lock(site / "vllm"):
            return
    except UserError:
        click.echo(f"waiting for the lock held by another apply/rollback on {site} ...", err=True)
    except OSError:  # no vllm/ folder: the engine reports it
        return


def _apply(site: Path | None, dry_run: bool, as_json: bool, force_version: str | None, wait: bool) -> None:
    def action() -> dict:
        where = resolve_site(site)
        if not dry_run:  # a dry run takes no lock
            announce_wait(where, wait)
        return _with_plugin(where, engine.apply(where, force_version, wait, dry_run))

    run(as_json, action, _render_apply)


def _with_plugin(site: Path, result: dict) -> dict:
    """`result` with what GGUF needs on this release (vllm-gguf-plugin from vLLM 0.24.0 on)."""
    plugin = gguf_plugin.describe(site, result["vllm_version"])
    return {**result, "gguf_plugin": plugin} if plugin is not None else result


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@apply_options
@click.version_option(__version__, prog_name="dsa-overlay")
@click.pass_context
def cli(ctx, site, dry_run, as_json, force_version, wait) -> None:
    """Apply the dsa-overlay patch set to an installed vLLM (the default action), or roll it back."""
    if ctx.invoked_subcommand is None:
        _apply(site, dry_run, as_json, force_version, wait)
        return
    if (dry_run or force_version) and ctx.invoked_subcommand != "apply":
        raise click.UsageError("--dry-run and --force-version belong to apply; use them without a subcommand")
    # `apply.py --vllm-site-packages P status`: options given before the subcommand
    ctx.obj = {"site": site, "as_json": as_json, "wait": wait, "dry_run": dry_run, "force_version": force_version}


@cli.command("apply")
@apply_options
@click.pass_context
def apply_command(ctx, site, dry_run, as_json, force_version, wait) -> None:
    """Apply the patch set for the installed vLLM (what `apply.py` without a subcommand does)."""
    _apply(*inherit(ctx, site=site, dry_run=dry_run, as_json=as_json, force_version=force_version, wait=wait))


@cli.command()
@site_option
@click.option("--force", is_flag=True, help="Restore pristine files even where they were edited after apply.")
@json_option
@wait_option
@click.pass_context
def rollback(ctx, site, force, as_json, wait) -> None:
    """Restore every patched file byte for byte and remove every added file."""
    site, as_json, wait = inherit(ctx, site=site, as_json=as_json, wait=wait)

    def action() -> dict:
        where = resolve_site(site)
        announce_wait(where, wait)
        return engine.rollback(where, force, wait)

    run(as_json, action, _render_rollback)


@cli.command()
@site_option
@json_option
@click.pass_context
def status(ctx, site, as_json) -> None:
    """Show the vLLM version, whether it is supported, and the overlay state per file."""
    site, as_json = inherit(ctx, site=site, as_json=as_json)
    def action() -> dict:
        where = resolve_site(site)
        return _with_plugin(where, engine.status(where))

    run(as_json, action, _render_status)


@cli.command()
@click.option("--venv", type=click.Path(path_type=Path), default=Path(".venv"), show_default=True,
              help="Virtual environment to create (or reuse).")
@click.option("--vllm", "version", default=DEFAULT_VLLM, show_default=True, help="vLLM release to install.")
@json_option
def bootstrap(venv, version, as_json) -> None:
    """Create a venv, pip install this tool and vLLM into it, apply the overlay, run verify."""
    from . import bootstrap as boot

    run(as_json, lambda: boot.bootstrap(venv.absolute(), version, as_json), lambda r: click.echo(r["message"]))


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
        _render_plugin(r, missing_only=True)
        return
    for f in r["patched"]:
        moved = [o for o in f["offsets"] if o]
        click.echo(f"patched  {f['path']}" + (f"  (hunks shifted by {moved})" if moved else ""))
    for path in r["added"]:
        click.echo(f"added    {path}")
    click.echo(f"{head}: applied patch set {r['patch_set']}{_forced(r)} (dsa-overlay {__version__}); "
               "undo with `apply.py rollback`")
    _render_plugin(r, missing_only=True)


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
    _render_plugin(r)


def _render_plugin(r: dict, missing_only: bool = False) -> None:
    plugin = r.get("gguf_plugin")
    if plugin is not None and not (missing_only and plugin["installed"]):
        click.echo(plugin["line"])


def _forced(r: dict) -> str:
    return f", forced onto vLLM {r['vllm_version']} by --force-version" if r.get("forced_version") else ""


def _register_extensions() -> None:
    from .gguf_check import check_gguf

    cli.add_command(check_gguf)


_register_extensions()


def main() -> None:
    cli(prog_name="apply.py")

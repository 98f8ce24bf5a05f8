"""Find the site-packages that holds vLLM and read vLLM's version, never importing vLLM."""

from __future__ import annotations

import importlib.util
import re
from email.parser import HeaderParser
from pathlib import Path

from .errors import UserError

# a release as pip writes it (letters, digits, . + ! _ -): never '/', spaces or '..' on its own
VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}")


def default_site_packages() -> Path:
    """The site-packages where the running Python finds `vllm` (find_spec does not execute vllm)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "no vllm package is importable by this Python; pass --vllm-site-packages PATH "
            "(the site-packages directory that contains vllm/)"
        )
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def vllm_version(site: Path) -> str:
    """The version in `site/vllm-*.dist-info/METADATA`; refuses a PATH without exactly one vLLM."""
    if not (site / "vllm").is_dir():
        raise UserError(f"{site}: no vllm/ package here; pass the site-packages directory of the venv that has vLLM")
    infos = sorted(site.glob("vllm-*.dist-info"))
    if not infos:
        raise UserError(f"{site}: vllm/ has no vllm-*.dist-info; reinstall vLLM with pip so its version is known")
    if len(infos) > 1:
        names = ", ".join(p.name for p in infos)
        raise UserError(f"{site}: several vLLM installs are recorded ({names}); reinstall vLLM with pip to clean up")
    meta = infos[0] / "METADATA"
    try:
        # only the ASCII headers matter; bytes that are not UTF-8 elsewhere (the description) are replaced
        headers = HeaderParser().parsestr(meta.read_bytes().decode("utf-8", errors="replace"), headersonly=True)
    except OSError as exc:
        raise UserError(f"{meta}: cannot read ({exc.strerror}); reinstall vLLM with pip") from None
    name, version = str(headers.get("Name", "")), str(headers.get("Version", "")).strip()
    if name.strip().lower() != "vllm" or not version:
        raise UserError(f"{meta}: no 'Name: vllm' / 'Version:' header; reinstall vLLM with pip")
    if not VERSION.fullmatch(version):
        shown = version if len(version) <= 40 else version[:40] + "..."
        raise UserError(f"{meta}: malformed version {shown!r} (expected one like 0.23.0); reinstall vLLM with pip")
    return version

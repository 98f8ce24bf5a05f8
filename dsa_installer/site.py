"""Find the site-packages that holds vLLM and read vLLM's version, never importing vLLM."""

from __future__ import annotations

import importlib.util
from email.parser import HeaderParser
from pathlib import Path

from .errors import UserError


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
        headers = HeaderParser().parsestr(meta.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{meta}: cannot read ({exc.strerror}); reinstall vLLM with pip") from None
    if headers.get("Name", "").lower() != "vllm" or not headers.get("Version"):
        raise UserError(f"{meta}: no 'Name: vllm' / 'Version:' header; reinstall vLLM with pip")
    return headers["Version"].strip()

"""vllm-gguf-plugin: the GGUF loader of vLLM releases without one in their tree (0.24.0 and later).

The overlay's glm-dsa adapter registers itself with the plugin from a hook in ``vllm/plugins/__init__.py``
(``overlay/gguf/plugin.py``); the plugin is never patched or written to. Read here without importing
anything (standard library only: ``bootstrap`` uses the pins on a bare Python)."""

from __future__ import annotations

from email.parser import HeaderParser
from pathlib import Path

FIRST_RELEASE = (0, 24)   # vLLM releases from here on have no in-tree GGUF loader
# The pins that load beside vLLM 0.20-0.26's torch 2.11 (0.0.4 and 0.0.5's _C_gguf.abi3.so do not:
# "undefined symbol: torch_exception_get_what_without_backtrace"). The plugin requires `vllm` unpinned,
# so these go into the same pip command as `vllm==X`, never on their own.
PINS = ("vllm-gguf-plugin==0.0.3", "gguf>=0.17")


def needed(vllm_version: str) -> bool:
    """True for a vLLM release whose GGUF loading needs the plugin."""
    head = []
    for part in vllm_version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            return False
        head.append(int(digits))
    return tuple(head) >= FIRST_RELEASE


def installed_version(site: Path) -> str | None:
    """The plugin's version from ``site/vllm_gguf_plugin-*.dist-info/METADATA`` (None: not installed)."""
    for info in sorted(site.glob("vllm_gguf_plugin-*.dist-info")):
        try:
            text = (info / "METADATA").read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        version = str(HeaderParser().parsestr(text, headersonly=True).get("Version", "")).strip()
        if version:
            return version
    return None


def describe(site: Path, vllm_version: str) -> dict | None:
    """For status and apply: whether GGUF files need the plugin here and whether it is installed, with
    the one line to print when it is missing (None for releases with an in-tree GGUF loader)."""
    if not needed(vllm_version):
        return None
    version = installed_version(site)
    if version is not None:
        return {"installed": version, "line": f"GGUF: vllm-gguf-plugin {version} installed; glm-dsa files load "
                                              "through it with the overlay's adapter"}
    return {"installed": None,
            "line": f"GGUF: vllm-gguf-plugin is not installed, so vLLM {vllm_version} cannot load GGUF files "
                    f"(everything else is unaffected); for GGUF run pip install vllm=={vllm_version} "
                    + " ".join(f"'{p}'" for p in PINS) + " in one command"}

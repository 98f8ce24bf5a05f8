"""Where the patch sets and the runtime tree live: next to a checkout, or inside an installed wheel.

In a checkout (or an editable install) `patches/`, `overlay/` and `dsa_installer/` sit side by side in the
repository root. The runtime tree `overlay/` is a plain package in both layouts (the tool imports its GGUF
reader like any module); a regular wheel carries `patches/` as package data under `dsa_installer/_data/`
(see pyproject.toml). Manifests name drop-in sources relative to the repository root (`overlay`, ...);
`source()` maps such a name to the file that exists in either layout."""

from __future__ import annotations

from pathlib import Path

import overlay

PACKAGE_DIR = Path(__file__).resolve().parent
RUNTIME_DIR = Path(overlay.__file__).resolve().parent


def checkout_root() -> Path | None:
    """The repository root when running from a checkout, else None."""
    root = PACKAGE_DIR.parent
    return root if (root / "patches" / "common.toml").is_file() else None


def source(rel: str) -> Path:
    """A path named relative to the repository root (`patches/0.23.0/x.diff`, `overlay`, ...)."""
    root = checkout_root()
    if root is not None:
        return root / rel
    parts = Path(rel).parts
    if parts[0] == "overlay":
        return RUNTIME_DIR.joinpath(*parts[1:])
    return PACKAGE_DIR / "_data" / rel


def patches_dir() -> Path:
    return source("patches")


def display(path: Path) -> str:
    """A path as users should read it in messages: relative to the checkout/package when inside it."""
    for base in filter(None, (checkout_root(), PACKAGE_DIR / "_data", PACKAGE_DIR.parent)):
        try:
            return str(path.relative_to(base))
        except ValueError:
            continue
    return str(path)

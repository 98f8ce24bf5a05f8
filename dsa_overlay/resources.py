"""Where the patch sets and overlay modules live: next to a checkout, or inside an installed wheel.

In a checkout (or an editable install) `patches/`, `overlay/` and `dsa_overlay/` sit side by side in the
repository root. A regular wheel carries `patches/` and `overlay/` as package data under
`dsa_overlay/_data/` (see pyproject.toml), while `dsa_overlay/` itself is the package. Manifests name drop-in
sources relative to the repository root (`overlay`, `dsa_overlay/kernels`); `source()` maps such a name
to the file that exists in either layout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def checkout_root() -> Path | None:
    """The repository root when running from a checkout, else None."""
    root = PACKAGE_DIR.parent
    return root if (root / "patches" / "common.toml").is_file() else None


def source(rel: str) -> Path:
    """A path named relative to the repository root (`patches/0.23.0/x.diff`, `overlay`, ...)."""
    root = checkout_root()
    if root is not None:
        return root / rel
    first = Path(rel).parts[0]
    if first == "dsa_overlay":
        return PACKAGE_DIR.parent / rel
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


def load_overlay_module(name: str):
    """Import `overlay/<name>.py` (checkout or wheel layout) as `dsa_overlay._overlay_<name>`.

    Overlay modules import without vLLM by design, so the tool can reuse their logic (e.g. check-gguf
    reads GGUF headers with the same name table the loader hook uses) without a top-level `overlay` package."""
    qual = f"dsa_overlay._overlay_{name}"
    if qual in sys.modules:
        return sys.modules[qual]
    spec = importlib.util.spec_from_file_location(qual, source(f"overlay/{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[qual] = mod
    spec.loader.exec_module(mod)
    return mod

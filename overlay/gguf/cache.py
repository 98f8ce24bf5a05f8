"""Directories written once per content under the overlay's cache (``DSA_OVERLAY_CACHE``, default
``~/.cache/dsa-overlay``): the tokenizer and the config a glm-dsa GGUF carries, as files vLLM can read."""
from __future__ import annotations

import hashlib
import os
import shutil


def cache_root() -> str:
    return os.environ.get("DSA_OVERLAY_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsa-overlay"))


def cached_dir(kind: str, files: dict[str, str]) -> str:
    """``<cache>/<kind>/<hash of files>/`` holding ``files`` (name -> text); written atomically (a temp
    folder renamed into place), reused when it exists."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    out = os.path.join(cache_root(), kind, digest.hexdigest()[:16])
    if all(os.path.isfile(os.path.join(out, name)) for name in files):
        return out
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            f.write(text)
    try:
        os.rename(tmp, out)
    except OSError:     # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out

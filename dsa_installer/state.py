"""The engine's record of an apply, kept in `<site-packages>/vllm/.dsa_overlay/state.json`.

    {"format": 1, "overlay_version": "0.1.0", "vllm_version": "0.23.0", "patch_set": "0.23.0",
     "forced_version": null, "complete": true,
     "patched": [{"path": "vllm/...", "before": sha256, "after": sha256, "mode": 420}],
     "added":   [{"path": "vllm/_dsa_overlay/...", "sha256": sha256}],
     "added_dirs": ["vllm/_dsa_overlay", ...]}

`complete` is false while an apply is under way: a state found that way was interrupted (the process
was killed) and `rollback` finishes the job from the backups in `backup/`."""

from __future__ import annotations

import json
from pathlib import Path

from . import fsops
from .errors import UserError

STATE_DIR = "vllm/.dsa_overlay"
FORMAT = 1


def state_dir(site: Path) -> Path:
    return site / STATE_DIR


def backup_path(site: Path, target: str) -> Path:
    return state_dir(site) / "backup" / target


def load(site: Path) -> dict | None:
    path = state_dir(site) / "state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable overlay state ({exc}); reinstall vLLM and delete {state_dir(site)}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UserError(f"{path}: overlay state of an unknown format; use the dsa-overlay version that applied it")
    return state


def save(site: Path, state: dict) -> None:
    data = (json.dumps(state, indent=1, sort_keys=True) + "\n").encode()
    fsops.write_file(state_dir(site) / "state.json", data)

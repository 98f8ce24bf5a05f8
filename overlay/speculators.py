"""Let vLLM's speculators probe pass over GGUF files that transformers' GGUF config reader cannot read.

`vllm.transformers_utils.config.maybe_override_with_speculators` asks transformers for the checkpoint's
config dict only to look for a `speculators_config` key. For a GGUF file transformers builds that dict
from the GGUF metadata and raises `ValueError("GGUF model with architecture glm-dsa is not supported
yet.")` for every architecture its reader lacks (glm-dsa, and deepseek2 too, which vLLM's own GGUF loader
handles), so vLLM fails before it ever reaches its loader. GGUF metadata never carries a speculators
config, so for exactly that error the probe's answer is "no speculators" (an empty dict). Any other
error, and that error for a non-GGUF model, still propagates.

Imports nothing from vLLM; the hook in `patches/<version>/config.diff` calls `probe_config_dict`."""

from __future__ import annotations

import re
from typing import Any, Callable

_UNREADABLE_GGUF = re.compile(r"GGUF model with architecture (?P<arch>\S+?)\.? is not supported yet")


def unreadable_gguf_architecture(exc: BaseException) -> str | None:
    """The architecture named by transformers' "GGUF model with architecture X is not supported yet"
    ValueError, or None when `exc` is anything else."""
    if not isinstance(exc, ValueError):
        return None
    match = _UNREADABLE_GGUF.search(str(exc))
    return match.group("arch") if match else None


def probe_config_dict(
    get_config_dict: Callable[..., tuple[dict[str, Any], dict[str, Any]]],
    is_gguf: bool,
    *args: Any,
    **kwargs: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`get_config_dict(*args, **kwargs)`, except that for a GGUF model (`is_gguf`) whose architecture
    transformers cannot read it returns `({}, {})`: no config, hence no speculators."""
    try:
        return get_config_dict(*args, **kwargs)
    except ValueError as exc:
        if not is_gguf or unreadable_gguf_architecture(exc) is None:
            raise
        return {}, {}

"""Config fields that checkpoints leave out but vLLM reads with a wrong default, filled in by the
`get_config` hook (patches/<version>/config.diff) for every config it returns, HF and GGUF alike.

GLM-5 (`glm_moe_dsa`): transformers' `GlmMoeDsaIndexer` always rotates the indexer's rope dims
interleaved, and `GlmMoeDsaConfig.save_pretrained` (transformers 5.x) writes no `indexer_rope_interleave`
key; vLLM's deepseek_v2.py reads a missing key as False (neox-style rotation), a silently different
indexer (on an H200 with vLLM 0.23.0 such a checkpoint gave mean |dlogprob| 0.07 and top-1 agreement 0.65
against the same weights with the key set). A key the checkpoint or `hf_overrides` sets is kept."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)  # vllm._dsa_overlay.config_defaults inside vLLM: vLLM's handlers

# model_type -> {field: value the model's reference implementation always uses}
DEFAULTS = {"glm_moe_dsa": {"indexer_rope_interleave": True}}


def fill_defaults(config):
    """Set each of DEFAULTS' fields that `config` (a transformers config) lacks; returns `config`."""
    for field, value in DEFAULTS.get(getattr(config, "model_type", None), {}).items():
        if not hasattr(config, field):
            setattr(config, field, value)
            logger.info("dsa-overlay: %s config has no %s; set to %s (what the model's reference "
                        "implementation does)", config.model_type, field, value)
    return config

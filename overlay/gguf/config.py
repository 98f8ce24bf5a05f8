"""GLM-5's Hugging Face config from a glm-dsa GGUF's ``glm-dsa.*`` metadata alone.

``config_dict`` gives the ``GlmMoeDsaConfig`` fields, ``hf_config`` a transformers config object;
``register_config`` and ``config_for_gguf`` are the hooks vLLM's ``transformers_utils/config.py`` calls
(through ``gguf_glm_dsa``).  transformers is imported only where a config object is made.
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterable

from .cache import cached_dir
from .reader import GGUFError, merged_tensors, read_model, show
from .tensors import ARCH, HF_ARCH, MODEL_TYPE, is_glm_dsa


# Bounds every glm-dsa key must keep, checked before anything is sized by it: far above any released
# model (GLM-5: 79 blocks, widths up to 154,880), so only a corrupt header fails them.
MAX_BLOCKS = 4096
_WIDTH = 1 << 24
_A = ARCH + "."


def _bad(key: str, v: Any, expected: str) -> GGUFError:
    return GGUFError(f"{key} is {show(v)}, expected {expected}: corrupt metadata; re-download or re-convert the file")


def meta_int(meta: dict, key: str, default: Any = None, lo: int = 0, hi: int = _WIDTH) -> Any:
    v = meta.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, v, "an integer")
    if not lo <= v <= hi:
        raise _bad(key, v, f"{lo} to {hi}")
    return v


def _float(meta: dict, key: str, default: float, positive: bool = False) -> float:
    v = meta.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise _bad(key, v, "a finite positive number" if positive else "a finite number")
    return float(v)


def _bool(meta: dict, key: str, default: bool) -> bool:
    v = meta.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or v not in (0, 1):     # True, False, or a 0/1 integer
        raise _bad(key, v, "a boolean")
    return bool(v)


def _str(meta: dict, key: str) -> str | None:
    v = meta.get(key)
    if v is not None and not isinstance(v, str):
        raise _bad(key, v, "a string")
    return v


def meta_list(meta: dict, key: str, kind: type) -> list | None:
    """A metadata array whose elements are all ``kind`` (str, or int: booleans count), or None."""
    v = meta.get(key)
    if v is not None and (not isinstance(v, list) or not all(isinstance(x, kind) for x in v)):
        raise _bad(key, v, f"an array of {'strings' if kind is str else 'integers'}")
    return v


def config_dict(meta: dict[str, Any], tensor_names: Iterable[str] = ()) -> dict[str, Any]:
    """HF ``GlmMoeDsaConfig`` fields from ``glm-dsa.*`` metadata (and which tensors exist).

    Every key's type and range is checked first: a corrupt value is a one-line GGUFError."""
    names = set(tensor_names)
    if meta.get("general.architecture") not in (ARCH, None):
        raise GGUFError(f"architecture {show(meta.get('general.architecture'))} is not {ARCH!r}")
    required = ("block_count", "embedding_length", "attention.head_count", "attention.kv_lora_rank",
                "rope.dimension_count", "attention.key_length_mla", "attention.value_length_mla")
    missing = [_A + k for k in required if meta.get(_A + k) is None]
    if missing:
        raise GGUFError(f"metadata lacks {', '.join(missing)}; re-convert with a llama.cpp that writes "
                        "glm-dsa MLA keys, or pass --hf-config-path")
    blocks = meta_int(meta, _A + "block_count", lo=1, hi=MAX_BLOCKS)
    n_mtp = meta_int(meta, _A + "nextn_predict_layers", 0, hi=blocks - 1)
    n_layers = blocks - n_mtp
    rope = meta_int(meta, _A + "rope.dimension_count")
    heads = meta_int(meta, _A + "attention.head_count", lo=1)
    experts = meta_int(meta, _A + "expert_count", 0)
    tokens = meta_list(meta, "tokenizer.ggml.tokens", str)
    vocab = meta_int(meta, _A + "vocab_size") or len(tokens or ()) or None
    q_lora = meta_int(meta, _A + "attention.q_lora_rank")
    cfg: dict[str, Any] = {
        "architectures": [HF_ARCH],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab,
        "hidden_size": meta_int(meta, _A + "embedding_length", lo=1),
        "intermediate_size": meta_int(meta, _A + "feed_forward_length", 0),
        "moe_intermediate_size": meta_int(meta, _A + "expert_feed_forward_length", 0),
        "num_hidden_layers": n_layers,
        "num_nextn_predict_layers": n_mtp,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,    # MLA: llama.cpp stores 1 (MQA view); HF counts heads
        "n_routed_experts": experts,
        "num_experts_per_tok": meta_int(meta, _A + "expert_used_count", 0, hi=experts),
        "n_shared_experts": meta_int(meta, _A + "expert_shared_count", 0),
        "routed_scaling_factor": _float(meta, _A + "expert_weights_scale", 1.0),
        "norm_topk_prob": _bool(meta, _A + "expert_weights_norm", False),
        "n_group": meta_int(meta, _A + "expert_group_count", 1) or 1,
        "topk_group": meta_int(meta, _A + "expert_group_used_count", 1) or 1,
        "scoring_func": {1: "softmax", 2: "sigmoid"}.get(meta_int(meta, _A + "expert_gating_func", 2), "sigmoid"),
        "first_k_dense_replace": meta_int(meta, _A + "leading_dense_block_count", 0, hi=n_layers),
        "q_lora_rank": q_lora or None,
        "kv_lora_rank": meta_int(meta, _A + "attention.kv_lora_rank", lo=1),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": meta_int(meta, _A + "attention.key_length_mla", lo=rope) - rope,
        "v_head_dim": meta_int(meta, _A + "attention.value_length_mla", lo=1),
        "index_n_heads": meta_int(meta, _A + "attention.indexer.head_count", 0),
        "index_head_dim": meta_int(meta, _A + "attention.indexer.key_length", 0),
        "index_topk": meta_int(meta, _A + "attention.indexer.top_k", 0, hi=1 << 31),
        # GLM-5 rotates the indexer's rope dims interleaved (transformers' GlmMoeDsaIndexer)
        "indexer_rope_interleave": True,
        "max_position_embeddings": meta_int(meta, _A + "context_length", 4096, lo=1, hi=1 << 31),
        "rms_norm_eps": _float(meta, _A + "attention.layer_norm_rms_epsilon", 1e-5, positive=True),
        "rope_theta": _float(meta, _A + "rope.freq_base", 10000.0, positive=True),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": bool(names) and "output.weight" not in names,
        "torch_dtype": "bfloat16",
    }
    if any(n.endswith("exp_probs_b.bias") for n in names):
        # FACTS (routing-bias trap): vLLM builds gate.e_score_correction_bias only for noaux_tc
        cfg["topk_method"] = "noaux_tc"
        cfg["scoring_func"] = "sigmoid"
    types = meta_list(meta, _A + "attention.indexer.types", int)
    if types is not None:
        cfg["indexer_types"] = ["full" if t else "shared" for t in types]
    rope_params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    scaling = _str(meta, _A + "rope.scaling.type")
    if scaling and scaling != "none":
        rope_params = {
            "rope_type": scaling, "rope_theta": cfg["rope_theta"],
            "factor": _float(meta, _A + "rope.scaling.factor", 1.0, positive=True),
            "original_max_position_embeddings": meta_int(meta, _A + "rope.scaling.original_context_length",
                                                     cfg["max_position_embeddings"], lo=1, hi=1 << 31),
        }
        if meta.get(_A + "rope.scaling.yarn_log_multiplier") is not None:
            # llama.cpp writes 0.1 * mscale_all_dim for deepseek2-style yarn
            rope_params["mscale_all_dim"] = _float(meta, _A + "rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        cfg["rope_scaling"] = dict(rope_params)
    cfg["rope_parameters"] = rope_params
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        if (v := meta_int(meta, f"tokenizer.ggml.{key}", hi=1 << 31)) is not None:
            cfg[hf_key] = v
    return cfg


_FALLBACK_CLASS = None


def _fallback_config_class():
    """A ``glm_moe_dsa`` config for transformers releases without one (e.g. 4.57.6 in vLLM 0.23.0)."""
    global _FALLBACK_CLASS
    if _FALLBACK_CLASS is not None:
        return _FALLBACK_CLASS
    from transformers import PretrainedConfig

    class GlmMoeDsaConfig(PretrainedConfig):
        model_type = MODEL_TYPE
        keys_to_ignore_at_inference = ["past_key_values"]
        attribute_map = {"num_local_experts": "n_routed_experts"}

        def __init__(self, vocab_size=154880, hidden_size=6144, intermediate_size=12288,
                     moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64,
                     num_key_value_heads=64, n_shared_experts=1, n_routed_experts=256,
                     routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=2048,
                     qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, n_group=1,
                     topk_group=1, num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu",
                     max_position_embeddings=202752, initializer_range=0.02, rms_norm_eps=1e-5,
                     use_cache=True, tie_word_embeddings=False, rope_theta=10000.0,
                     rope_scaling=None, rope_parameters=None, attention_bias=False,
                     attention_dropout=0.0, index_topk=2048, index_head_dim=128, index_n_heads=32,
                     first_k_dense_replace=3, indexer_types=None, mlp_layer_types=None, **kwargs):
            self.vocab_size = vocab_size
            self.hidden_size = hidden_size
            self.intermediate_size = intermediate_size
            self.moe_intermediate_size = moe_intermediate_size
            self.num_hidden_layers = num_hidden_layers
            self.num_attention_heads = num_attention_heads
            self.num_key_value_heads = num_key_value_heads
            self.n_shared_experts = n_shared_experts
            self.n_routed_experts = n_routed_experts
            self.routed_scaling_factor = routed_scaling_factor
            self.kv_lora_rank = kv_lora_rank
            self.q_lora_rank = q_lora_rank
            self.qk_rope_head_dim = qk_rope_head_dim
            self.v_head_dim = v_head_dim
            self.qk_nope_head_dim = qk_nope_head_dim
            self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
            self.head_dim = qk_rope_head_dim
            self.n_group = n_group
            self.topk_group = topk_group
            self.num_experts_per_tok = num_experts_per_tok
            self.norm_topk_prob = norm_topk_prob
            self.hidden_act = hidden_act
            self.max_position_embeddings = max_position_embeddings
            self.initializer_range = initializer_range
            self.rms_norm_eps = rms_norm_eps
            self.use_cache = use_cache
            self.attention_bias = attention_bias
            self.attention_dropout = attention_dropout
            self.index_topk = index_topk
            self.index_head_dim = index_head_dim
            self.index_n_heads = index_n_heads
            self.first_k_dense_replace = first_k_dense_replace
            self.indexer_types = indexer_types or ["full"] * num_hidden_layers
            self.mlp_layer_types = mlp_layer_types or (
                ["dense"] * min(first_k_dense_replace, num_hidden_layers)
                + ["sparse"] * max(num_hidden_layers - first_k_dense_replace, 0))
            if rope_parameters is None:
                rope_parameters = dict(rope_scaling or {}, rope_theta=rope_theta)
                rope_parameters.setdefault("rope_type", rope_parameters.pop("type", "default"))
            self.rope_parameters = rope_parameters
            self.rope_theta = rope_parameters.get("rope_theta", rope_theta)
            self.rope_scaling = rope_scaling
            super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    _FALLBACK_CLASS = GlmMoeDsaConfig
    return GlmMoeDsaConfig


def config_class():
    """transformers' ``GlmMoeDsaConfig`` when installed (>= 5), else this module's fallback."""
    try:
        from transformers import GlmMoeDsaConfig  # type: ignore[attr-defined]
        return GlmMoeDsaConfig
    except Exception:
        return _fallback_config_class()


def register_config(registry: dict | None = None) -> None:
    """Make ``glm_moe_dsa`` known: to ``AutoConfig`` and, if given, to vLLM's ``_CONFIG_REGISTRY``.

    Only when the installed transformers lacks it (a fresh vLLM 0.23.0 venv has 4.57.6: FACTS)."""
    try:
        from transformers import GlmMoeDsaConfig  # type: ignore[attr-defined]  # noqa: F401
        return
    except Exception:
        pass
    cls = _fallback_config_class()
    from transformers import AutoConfig
    AutoConfig.register(MODEL_TYPE, cls, exist_ok=True)
    if registry is not None:
        registry.setdefault(MODEL_TYPE, cls)


def hf_config(path: str | os.PathLike, overrides: dict | None = None):
    """A transformers config for a glm-dsa GGUF from its metadata alone."""
    headers = read_model(path)
    meta = headers[0].metadata
    cfg = config_dict(meta, merged_tensors(headers))
    extras = {k: cfg.pop(k) for k in ("topk_method", "scoring_func", "num_nextn_predict_layers",
                                      "indexer_rope_interleave", "torch_dtype", "rope_theta",
                                      "rope_scaling") if k in cfg}
    config = config_class()(**{k: v for k, v in cfg.items() if v is not None})
    config.update(extras)
    if overrides:
        config.update(overrides)
    return config


def config_dir(path: str | os.PathLike) -> str:
    """A directory holding ``config.json`` made from a glm-dsa GGUF's metadata (cached): what
    vllm-gguf-plugin's config parser reads when no config.json sits beside the file."""
    return cached_dir("gguf-configs", {"config.json": hf_config(path).to_json_string(use_diff=False)})


def config_for_gguf(model: str | os.PathLike, hf_overrides_kw: dict | None = None, hf_overrides_fn=None):
    """The hook in ``get_config``: a config from a local glm-dsa GGUF's metadata, else None."""
    if not isinstance(model, (str, os.PathLike)) or not os.fspath(model).endswith(".gguf"):
        return None
    if not is_glm_dsa(model):
        return None
    config = hf_config(model, hf_overrides_kw)
    if hf_overrides_fn is not None:
        config = hf_overrides_fn(config)
    try:   # inside vLLM: normalise rope fields the way get_config does for every config
        from vllm.transformers_utils.config import patch_rope_parameters
    except ImportError:
        return config
    patch_rope_parameters(config)
    return config


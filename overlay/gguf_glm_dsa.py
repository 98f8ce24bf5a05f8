"""GLM-5 (``glm_moe_dsa``) from llama.cpp ``glm-dsa`` GGUF files, for vLLM.

Dropped into vLLM as ``vllm._dsa_overlay.gguf_glm_dsa``; imports without vLLM (``torch``, ``gguf`` and
``transformers`` are imported lazily, where tensors or configs are made), so it is unit-tested from a
checkout and ``check-gguf`` reads headers with nothing but the standard library.

What it provides
- ``read_header`` / ``read_model``: a GGUF header parser (metadata + tensor infos, no tensor data) and
  the shard set of a split file (``*-00001-of-0000N.gguf``); shards after the first carry no
  ``general.architecture``.
- ``config_dict`` / ``hf_config``: the Hugging Face ``GlmMoeDsaConfig`` fields from ``glm-dsa.*``
  metadata alone, and ``register_config`` for transformers releases that lack ``glm_moe_dsa``.
- ``plan``: the project's own name table from llama.cpp tensor names to the HF/vLLM parameter names
  ``DeepseekV2ForCausalLM.load_weights`` (GlmMoeDsaForCausalLM) consumes, with the per-release dense
  ("force-dequant") policy.
- ``hf_tensors``: every HF checkpoint tensor rebuilt from the GGUF (dequantized; experts per expert).
- ``GlmDsaNameMap``: what the vLLM hooks use; a ``gguf name -> hf name`` dict (as vLLM's own map)
  that also yields vLLM's GGUF weight stream (``qweight_type`` first, then data; ``kv_b_proj`` rebuilt
  from ``attn_k_b`` + ``attn_v_b``; experts as merged 3-D tensors).
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

ARCH = "glm-dsa"
HF_ARCH = "GlmMoeDsaForCausalLM"
MODEL_TYPE = "glm_moe_dsa"

# ----------------------------------------------------------------------------------------------
# ggml types: id -> (name, block size in elements, bytes per block).  Stable ids from ggml.h.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}
DENSE_TYPES = {"F32", "F16", "BF16"}
# what vLLM's GGUF linear/embedding/MoE kernels take (vllm/model_executor/layers/quantization/gguf.py:
# UNQUANTIZED_TYPES | DEQUANT_TYPES, identical in 0.16.0 and 0.23.0)
VLLM_GGUF_TYPES = DENSE_TYPES | {
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_M", "IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL",
}
GGML_ID = {name: i for i, (name, _, _) in GGML_TYPES.items()}


class GGUFError(ValueError):
    """A problem with a GGUF file; the message is one line naming the file/tensor and what to do."""


# ----------------------------------------------------------------------------------------------
# header parsing (no tensor data is read)

@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]       # numpy / torch order (ggml ne reversed): HF layout
    ggml_type: int
    offset: int                  # absolute byte offset in its shard
    path: str                    # the shard holding it

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type{self.ggml_type}", 0, 0))[0]

    @property
    def nbytes(self) -> int:
        name, block, size = GGML_TYPES.get(self.ggml_type, ("?", 0, 0))
        if not block:
            return -1
        n = 1
        for d in self.shape:
            n *= d
        return n // block * size


@dataclass
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int
    file_size: int

    @property
    def arch(self) -> str | None:
        return self.metadata.get("general.architecture")


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor infos (memory-mapped, no tensor data touched)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes is too short for a GGUF file (truncated download?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r})")
        version, = struct.unpack_from("<I", mm, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} (big-endian or unsupported); "
                            "re-convert with a current llama.cpp")
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        pos = 24

        def need(n: int) -> None:
            if pos + n > size:
                raise GGUFError(f"{path}: header ends past the end of the file (truncated at {size} bytes)")

        def string() -> str:
            nonlocal pos
            need(8)
            n, = struct.unpack_from("<Q", mm, pos)
            need(8 + n)
            s = mm[pos + 8:pos + 8 + n].decode("utf-8", errors="replace")
            pos += 8 + n
            return s

        def value(vtype: int) -> Any:
            nonlocal pos
            if vtype == 8:
                return string()
            if vtype == 9:
                need(12)
                etype, count = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if etype == 8:
                    return [string() for _ in range(count)]
                if etype in _ARRAY_FMT:
                    fmt = f"<{count}{_ARRAY_FMT[etype]}"
                    need(struct.calcsize(fmt))
                    out = list(struct.unpack_from(fmt, mm, pos))
                    pos += struct.calcsize(fmt)
                    return out
                return [value(etype) for _ in range(count)]
            if vtype not in _SCALAR:
                raise GGUFError(f"{path}: unknown metadata value type {vtype} at byte {pos}")
            need(struct.calcsize(_SCALAR[vtype]))
            v, = struct.unpack_from(_SCALAR[vtype], mm, pos)
            pos += struct.calcsize(_SCALAR[vtype])
            return v

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            need(4)
            vtype, = struct.unpack_from("<I", mm, pos)
            pos += 4
            meta[key] = value(vtype)
        raw = []
        for _ in range(n_tensors):
            name = string()
            need(4)
            n_dims, = struct.unpack_from("<I", mm, pos)
            need(4 + 8 * n_dims + 12)
            ne = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            gtype, off = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw.append((name, tuple(int(x) for x in reversed(ne)), gtype, off))
        align = int(meta.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
    tensors = {n: TensorInfo(n, shp, t, data_start + off, path) for n, shp, t, off in raw}
    return GGUFHeader(path, version, meta, tensors, data_start, size)


_SPLIT_RE = re.compile(r"-(\d+)-of-(\d+)\.gguf$")


def shard_paths(path: str | os.PathLike) -> list[str]:
    """All shard paths of a split GGUF (given any shard), or ``[path]``; missing shards included."""
    path = os.fspath(path)
    m = _SPLIT_RE.search(path)
    if not m:
        return [path]
    width, total = len(m.group(1)), int(m.group(2))
    prefix, suffix = path[:m.start(1)], path[m.end(2):]
    return [f"{prefix}{i:0{width}d}-of-{total:0{len(m.group(2))}d}{suffix}" for i in range(1, total + 1)]


def read_model(path: str | os.PathLike) -> list[GGUFHeader]:
    """Headers of every shard (first shard first); a missing shard is a one-line GGUFError."""
    headers = []
    for p in shard_paths(path):
        if not os.path.isfile(p):
            raise GGUFError(f"{p}: shard missing; download every *-of-* part into {os.path.dirname(p) or '.'}")
        headers.append(read_header(p))
    return headers


def is_glm_dsa(path: str | os.PathLike) -> bool:
    """True for a local GGUF (first shard of a split, or any shard) whose architecture is glm-dsa."""
    try:
        first = shard_paths(path)[0]
        return os.path.isfile(first) and read_header(first).arch == ARCH
    except (GGUFError, OSError):
        return False


def merged_tensors(headers: list[GGUFHeader]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for h in headers:
        out.update(h.tensors)
    return out


# ----------------------------------------------------------------------------------------------
# config from metadata

def _m(meta: dict, key: str, default: Any = None) -> Any:
    return meta.get(f"{ARCH}.{key}", default)


def config_dict(meta: dict[str, Any], tensor_names: Iterable[str] = ()) -> dict[str, Any]:
    """HF ``GlmMoeDsaConfig`` fields from ``glm-dsa.*`` metadata (and which tensors exist)."""
    names = set(tensor_names)
    if meta.get("general.architecture") not in (ARCH, None):
        raise GGUFError(f"architecture {meta.get('general.architecture')!r} is not {ARCH!r}")
    required = ("block_count", "embedding_length", "attention.head_count", "attention.kv_lora_rank",
                "rope.dimension_count", "attention.key_length_mla", "attention.value_length_mla")
    missing = [f"{ARCH}.{k}" for k in required if _m(meta, k) is None]
    if missing:
        raise GGUFError(f"metadata lacks {', '.join(missing)}; re-convert with a llama.cpp that writes "
                        "glm-dsa MLA keys, or pass --hf-config-path")
    n_mtp = int(_m(meta, "nextn_predict_layers", 0) or 0)
    n_layers = int(_m(meta, "block_count")) - n_mtp
    rope = int(_m(meta, "rope.dimension_count"))
    heads = int(_m(meta, "attention.head_count"))
    vocab = _m(meta, "vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or None
    cfg: dict[str, Any] = {
        "architectures": [HF_ARCH],
        "model_type": MODEL_TYPE,
        "vocab_size": int(vocab) if vocab else None,
        "hidden_size": int(_m(meta, "embedding_length")),
        "intermediate_size": int(_m(meta, "feed_forward_length", 0)),
        "moe_intermediate_size": int(_m(meta, "expert_feed_forward_length", 0)),
        "num_hidden_layers": n_layers,
        "num_nextn_predict_layers": n_mtp,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,    # MLA: llama.cpp stores 1 (MQA view); HF counts heads
        "n_routed_experts": int(_m(meta, "expert_count", 0)),
        "num_experts_per_tok": int(_m(meta, "expert_used_count", 0)),
        "n_shared_experts": int(_m(meta, "expert_shared_count", 0)),
        "routed_scaling_factor": float(_m(meta, "expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(_m(meta, "expert_weights_norm", False)),
        "n_group": int(_m(meta, "expert_group_count", 1) or 1),
        "topk_group": int(_m(meta, "expert_group_used_count", 1) or 1),
        "scoring_func": {1: "softmax", 2: "sigmoid"}.get(int(_m(meta, "expert_gating_func", 2)), "sigmoid"),
        "first_k_dense_replace": int(_m(meta, "leading_dense_block_count", 0)),
        "q_lora_rank": int(_m(meta, "attention.q_lora_rank")) if _m(meta, "attention.q_lora_rank") else None,
        "kv_lora_rank": int(_m(meta, "attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(_m(meta, "attention.key_length_mla")) - rope,
        "v_head_dim": int(_m(meta, "attention.value_length_mla")),
        "index_n_heads": int(_m(meta, "attention.indexer.head_count", 0)),
        "index_head_dim": int(_m(meta, "attention.indexer.key_length", 0)),
        "index_topk": int(_m(meta, "attention.indexer.top_k", 0)),
        # GLM-5 rotates the indexer's rope dims interleaved (transformers' GlmMoeDsaIndexer)
        "indexer_rope_interleave": True,
        "max_position_embeddings": int(_m(meta, "context_length", 4096)),
        "rms_norm_eps": float(_m(meta, "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_m(meta, "rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": bool(names) and "output.weight" not in names,
        "torch_dtype": "bfloat16",
    }
    if any(n.endswith("exp_probs_b.bias") for n in names):
        # FACTS (routing-bias trap): vLLM builds gate.e_score_correction_bias only for noaux_tc
        cfg["topk_method"] = "noaux_tc"
        cfg["scoring_func"] = "sigmoid"
    types = _m(meta, "attention.indexer.types")
    if types is not None:
        cfg["indexer_types"] = ["full" if t else "shared" for t in types]
    rope_params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    scaling = _m(meta, "rope.scaling.type")
    if scaling and scaling != "none":
        rope_params = {
            "rope_type": scaling, "rope_theta": cfg["rope_theta"],
            "factor": float(_m(meta, "rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(_m(meta, "rope.scaling.original_context_length",
                                                        cfg["max_position_embeddings"])),
        }
        if _m(meta, "rope.scaling.yarn_log_multiplier") is not None:
            # llama.cpp writes 0.1 * mscale_all_dim for deepseek2-style yarn
            rope_params["mscale_all_dim"] = float(_m(meta, "rope.scaling.yarn_log_multiplier")) / 0.1
        cfg["rope_scaling"] = dict(rope_params)
    cfg["rope_parameters"] = rope_params
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        if (v := meta.get(f"tokenizer.ggml.{key}")) is not None:
            cfg[hf_key] = int(v)
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


# ----------------------------------------------------------------------------------------------
# the name table (llama.cpp glm-dsa -> HF / vLLM parameter names), owned here

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# per block: gguf suffix -> HF suffix under model.layers.<i>.
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # NextN / MTP block (model.layers.<num_hidden_layers>.*)
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
}
# merged 3-D experts [n_expert, out, in]; HF stores model.layers.<i>.mlp.experts.<e>.<proj>.weight
EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
FUSED_GATE_UP_EXPS = "ffn_gate_up_exps.weight"   # convert_hf_to_gguf --fuse-gate-up-exps
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# Layers built without a quant method (vLLM keeps them dense): their weights are dequantized.
#   mlp.gate: GateLinear(quant_config=None); eh_proj: nn.Linear (MTP);
#   indexer.weights_proj: quant_config=None in both releases;
#   indexer.wk: merged into wk_weights_proj (quant_config=None) from 0.23.0 on, quantizable in 0.16.0;
#   kv_b_proj: rebuilt from two differently-quantized halves, so always dense.
DENSE_SUFFIXES_COMMON = ("mlp.gate.weight", "eh_proj.weight", "self_attn.indexer.weights_proj.weight",
                         "self_attn.kv_b_proj.weight")
DENSE_SUFFIXES = {
    "0.16.0": DENSE_SUFFIXES_COMMON,
    "0.23.0": DENSE_SUFFIXES_COMMON + ("self_attn.indexer.wk.weight",),
}
# vLLM fuses these into one layer whose shards must all be quantized or all dense
FUSED_GROUPS = (("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
                ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"))


def vllm_release() -> str:
    """The vLLM release this module runs inside (policy key); the newest known one outside vLLM."""
    try:
        import vllm  # noqa: F401
        v = getattr(vllm, "__version__", "")
    except Exception:
        v = ""
    for rel in DENSE_SUFFIXES:
        if v.startswith(rel):
            return rel
    return max(DENSE_SUFFIXES, key=lambda r: tuple(int(x) for x in r.split(".")))


@dataclass
class Entry:
    """One vLLM parameter load: ``hf_name`` filled from ``sources`` (kind: plain, kv_b, experts)."""
    hf_name: str
    kind: str
    sources: list[TensorInfo]
    dense: bool = False
    why: str = ""
    expert_proj: str = ""          # experts: gate_proj / up_proj / down_proj
    gate_up_half: int = -1         # experts from a fused gate_up tensor: 0 gate, 1 up

    @property
    def layer(self) -> int | None:
        m = re.match(r"model\.layers\.(\d+)\.", self.hf_name)
        return int(m.group(1)) if m else None


@dataclass
class Plan:
    entries: list[Entry]
    unmapped: list[str] = field(default_factory=list)     # gguf tensors with no HF name
    problems: list[str] = field(default_factory=list)     # one line each


def plan(tensors: dict[str, TensorInfo], release: str | None = None) -> Plan:
    """Map every GGUF tensor to the vLLM load it feeds, and decide what must be dense."""
    release = release or vllm_release()
    dense_suffixes = DENSE_SUFFIXES.get(release, DENSE_SUFFIXES_COMMON)
    entries: list[Entry] = []
    unmapped: list[str] = []
    problems: list[str] = []
    kv_parts: dict[int, dict[str, TensorInfo]] = {}
    for name, t in tensors.items():
        if name in GLOBAL_NAMES:
            entries.append(Entry(GLOBAL_NAMES[name], "plain", [t]))
            continue
        m = _BLK_RE.match(name)
        if not m:
            unmapped.append(name)
            continue
        bid, rest = int(m.group(1)), m.group(2)
        pre = f"model.layers.{bid}."
        if rest in BLOCK_NAMES:
            entries.append(Entry(pre + BLOCK_NAMES[rest], "plain", [t]))
        elif rest in EXPERT_NAMES:
            proj = EXPERT_NAMES[rest]
            entries.append(Entry(pre + f"mlp.experts.0.{proj}.weight", "experts", [t], expert_proj=proj))
        elif rest == FUSED_GATE_UP_EXPS:
            for half, proj in enumerate(("gate_proj", "up_proj")):
                entries.append(Entry(pre + f"mlp.experts.0.{proj}.weight", "experts", [t],
                                     expert_proj=proj, gate_up_half=half))
        elif rest in KV_B_PARTS:
            kv_parts.setdefault(bid, {})[rest] = t
        else:
            unmapped.append(name)
    for bid, parts in sorted(kv_parts.items()):
        if len(parts) != 2:
            have = next(iter(parts))
            problems.append(f"blk.{bid}.{have}: its partner "
                            f"blk.{bid}.{[p for p in KV_B_PARTS if p != have][0]} is missing")
            continue
        entries.append(Entry(f"model.layers.{bid}.self_attn.kv_b_proj.weight", "kv_b",
                             [parts["attn_k_b.weight"], parts["attn_v_b.weight"]],
                             dense=True, why="kv_b_proj rebuilt from attn_k_b + attn_v_b"))

    by_name = {e.hf_name: e for e in entries if e.kind != "experts"}
    for e in entries:
        types = {s.type_name for s in e.sources}
        if e.kind == "kv_b":
            continue
        if e.kind == "experts":
            if not types <= VLLM_GGUF_TYPES:
                e.dense, e.why = True, f"ggml type {'/'.join(sorted(types))} not in vLLM's GGUF MoE kernels"
            elif types <= DENSE_TYPES:
                e.dense, e.why = True, "dense experts"
            continue
        if types <= DENSE_TYPES:
            e.dense, e.why = True, "stored dense"
        elif any(e.hf_name.endswith(s) for s in dense_suffixes):
            e.dense, e.why = True, f"vLLM {release} builds this layer without a quant method"
        elif not types <= VLLM_GGUF_TYPES:
            e.dense, e.why = True, f"ggml type {'/'.join(sorted(types))} not in vLLM's GGUF kernels"
    # a fused layer takes all shards quantized or all dense
    for e in list(by_name.values()):
        fused = _fused_shard(e.hf_name)
        if fused is None:
            continue
        prefix, group, _ = fused
        members = [by_name.get(prefix + g) for g in group]
        if any(x is not None and x.dense for x in members):
            for x in members:
                if x is not None and not x.dense:
                    x.dense, x.why = True, "fused with a dense shard"
    # vLLM's merged w13 holds one ggml type
    exp = {}
    for e in entries:
        if e.kind == "experts":
            exp.setdefault(e.layer, {})[e.expert_proj] = e
    for bid, d in sorted(exp.items()):
        g, u = d.get("gate_proj"), d.get("up_proj")
        if g and u and (g.sources[0].type_name != u.sources[0].type_name or g.dense != u.dense):
            problems.append(f"blk.{bid}.ffn_gate_exps ({g.sources[0].type_name}) and blk.{bid}.ffn_up_exps "
                            f"({u.sources[0].type_name}) differ: vLLM's GGUF MoE needs one type for both; "
                            "re-quantize with the same type for gate and up experts")
    entries.sort(key=_load_order)
    return Plan(entries, sorted(unmapped), problems)


def _fused_shard(hf_name: str) -> tuple[str, tuple[str, ...], int] | None:
    """(``model.layers.N.`` prefix, its FUSED_GROUPS group, shard index) for a shard of a layer vLLM
    fuses; None for any other parameter."""
    m = re.match(r"(model\.layers\.\d+\.)(.+)$", hf_name)
    if m:
        for group in FUSED_GROUPS:
            if m.group(2) in group:
                return m.group(1), group, group.index(m.group(2))
    return None


def _load_order(e: Entry) -> tuple:
    """Per layer, by name, except that the shards of a fused layer follow its shard index: vLLM's
    GGUF linear method concatenates the shard outputs in the order the shards were loaded (an
    alphabetical kv_a_proj_with_mqa before q_a_proj swaps the halves of fused_qkv_a_proj)."""
    layer = e.layer if e.layer is not None else -1
    fused = _fused_shard(e.hf_name)
    if fused is not None:
        prefix, group, index = fused
        return layer, prefix + group[0], index
    return layer, e.hf_name, 0


# ----------------------------------------------------------------------------------------------
# tensor data (gguf-py for reading and dequantizing)

_READERS: dict[str, Any] = {}


def _raw(t: TensorInfo):
    """The tensor's bytes/values as numpy, in gguf-py's layout (quantized: [..., rows, bytes])."""
    import gguf
    r = _READERS.get(t.path)
    if r is None:
        r = _READERS[t.path] = gguf.GGUFReader(t.path)
        r._dsa_index = {rt.name: rt for rt in r.tensors}
    return r._dsa_index[t.name].data


def dequantized(t: TensorInfo):
    """float32 torch tensor in HF layout (``t.shape``)."""
    import numpy as np
    import torch
    data = _raw(t)
    if t.type_name == "F32":
        arr = np.asarray(data, dtype=np.float32)
    elif t.type_name == "F16":
        arr = np.asarray(data, dtype=np.float16).astype(np.float32)
    elif t.type_name == "BF16":
        u16 = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        arr = u16.view(np.float32)
    else:
        import gguf
        try:
            arr = gguf.quants.dequantize(np.asarray(data), gguf.GGMLQuantizationType(t.ggml_type))
        except NotImplementedError as exc:
            raise GGUFError(f"{t.path}: tensor {t.name} has ggml type {t.type_name}, which vLLM's GGUF "
                            "kernels cannot use and gguf-py cannot dequantize; re-quantize it") from exc
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(t.shape))


def _native(t: TensorInfo):
    """Undecoded tensor for vLLM's GGUF path: dense types as torch float tensors, else raw uint8."""
    import numpy as np
    import torch
    data = np.array(_raw(t))   # a copy: the reader's arrays are read-only memory maps
    if t.type_name == "BF16":
        return torch.from_numpy(data.view(np.uint16)).view(torch.bfloat16).reshape(t.shape)
    return torch.from_numpy(data)


def kv_b_from_parts(k_b, v_b):
    """Inverse of llama.cpp's split: k_b [H, kv_lora, nope] (transposed per head), v_b [H, v, kv_lora]
    -> kv_b_proj.weight [H * (nope + v), kv_lora]."""
    import torch
    n_head, kv_lora, _ = k_b.shape
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, kv_lora)


def _entry_dense(e: Entry):
    """float32 HF-layout tensor for an entry (experts: the merged [E, out, in] tensor)."""
    if e.kind == "kv_b":
        return kv_b_from_parts(dequantized(e.sources[0]), dequantized(e.sources[1]))
    w = dequantized(e.sources[0])
    if e.gate_up_half >= 0:
        w = w.chunk(2, dim=1)[e.gate_up_half]
    return w


def hf_tensors(path: str | os.PathLike, release: str | None = None) -> Iterator[tuple[str, Any]]:
    """Every HF checkpoint tensor (name, float32 tensor) rebuilt from a glm-dsa GGUF (all shards)."""
    headers = read_model(path)
    p = plan(merged_tensors(headers), release)
    if p.problems:
        raise GGUFError(f"{headers[0].path}: {p.problems[0]}")
    for e in p.entries:
        w = _entry_dense(e)
        if e.kind == "experts":
            for i in range(w.shape[0]):
                yield e.hf_name.replace(".experts.0.", f".experts.{i}."), w[i]
        else:
            yield e.hf_name, w


# ----------------------------------------------------------------------------------------------
# the vLLM hooks' side

def _dense_dtype():
    import torch
    dt = torch.get_default_dtype()   # vLLM loads under set_default_torch_dtype(model dtype)
    return dt if dt in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


def _mtp_alias(hf_name: str, n_layers: int | None) -> str | None:
    """The MTP draft model's module name (DeepSeekMTP puts the block under ``mtp_block``)."""
    m = re.match(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(.*)$", hf_name)
    if m and n_layers is not None and int(m.group(1)) >= n_layers:
        return f"model.layers.{m.group(1)}.mtp_block.{m.group(2)}.{m.group(3)}"
    return None


class GlmDsaNameMap(dict):
    """vLLM's ``gguf_to_hf_name_map`` for a glm-dsa file, with the loads vLLM's iterators delegate.

    As a dict it maps present GGUF names (plus ``output.weight``, for vLLM's tied-embedding check)
    to HF names, so vLLM code that only reads the map keeps working."""

    def __init__(self, path: str | os.PathLike, release: str | None = None):
        self.headers = read_model(path)
        self.release = release or vllm_release()
        self.plan = plan(merged_tensors(self.headers), self.release)
        if self.plan.problems:
            raise GGUFError(f"{self.headers[0].path}: {self.plan.problems[0]}")
        super().__init__({"output.weight": "lm_head.weight"})
        for e in self.plan.entries:
            for s in e.sources:
                self[s.name] = e.hf_name
        try:
            self.num_hidden_layers = config_dict(self.headers[0].metadata)["num_hidden_layers"]
        except GGUFError:
            self.num_hidden_layers = None

    def _entries_in(self, files: Iterable[str] | None) -> list[Entry]:
        if files is None:
            return self.plan.entries
        wanted = {os.path.realpath(f) for f in files}
        # an entry is loaded with the file holding its first source (kv_b may span two shards)
        return [e for e in self.plan.entries if os.path.realpath(e.sources[0].path) in wanted]

    def dsa_weight_type_map(self, gguf_file: str | os.PathLike | None = None) -> dict[str, str]:
        """HF name -> ggml type name as vLLM will see it (dense loads report BF16)."""
        out = {}
        for e in self._entries_in(None if gguf_file is None else [os.fspath(gguf_file)]):
            t = "BF16" if e.dense else e.sources[0].type_name
            out[e.hf_name] = t
            if (alias := _mtp_alias(e.hf_name, self.num_hidden_layers)) is not None:
                out[alias] = t
        return out

    def dsa_extra_tensor_names(self) -> list[str]:
        """HF names the file lacks (vLLM ties lm_head to the embedding when it lacks output.weight)."""
        present = set(merged_tensors(self.headers))
        return [] if "output.weight" in present else ["lm_head.weight"]

    def dsa_weights(self, gguf_files: Iterable[str | os.PathLike] | None = None) -> Iterator[tuple[str, Any]]:
        """vLLM's GGUF weight stream: every ``*.qweight_type`` first, then the data."""
        import torch
        files = None if gguf_files is None else [os.fspath(f) for f in gguf_files]
        entries = self._entries_in(files)
        dense_dt = _dense_dtype()

        def suffixed(name: str, new: str) -> str:
            return name[: -len("weight")] + new if name.endswith("weight") else name

        def qtype_of(e: Entry) -> int | None:
            if e.kind == "experts":   # vLLM's GGUF MoE takes qweight + qweight_type, dense or not
                return {torch.float16: 1, torch.bfloat16: 30, torch.float32: 0}[dense_dt] if e.dense \
                    else e.sources[0].ggml_type
            return None if e.dense else e.sources[0].ggml_type

        for e in entries:
            q = qtype_of(e)
            if q is not None:
                yield suffixed(e.hf_name, "qweight_type"), torch.tensor(q)
        for e in entries:
            q = qtype_of(e)
            if e.kind == "experts":
                if e.dense:
                    w = _entry_dense(e).to(dense_dt)
                else:
                    w = _native(e.sources[0])
                    if e.gate_up_half >= 0:
                        w = w.chunk(2, dim=1)[e.gate_up_half]
                yield suffixed(e.hf_name, "qweight"), w.contiguous()
            elif e.dense:
                src = e.sources[0]
                if e.kind == "plain" and src.type_name in DENSE_TYPES:
                    yield e.hf_name, _native(src) if src.type_name == "BF16" else dequantized(src)
                else:
                    yield e.hf_name, _entry_dense(e)
            else:
                yield suffixed(e.hf_name, "qweight"), _native(e.sources[0])


def weights_map(model_path: str | os.PathLike) -> GlmDsaNameMap | None:
    """The hook in ``GGUFModelLoader._get_gguf_weights_map``: our map for a glm-dsa file, else None."""
    path = os.fspath(model_path)
    if not is_glm_dsa(path):
        return None
    return GlmDsaNameMap(path)


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


# ----------------------------------------------------------------------------------------------
# tokenizer from the GGUF metadata (llama.cpp "gpt2" byte-level BPE)

# llama.cpp pre-tokenizer name -> the split regex its tokenizer.json carries
PRE_TOKENIZER_SPLITS = {
    "glm4": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_json(meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config dict) rebuilt from ``tokenizer.ggml.*`` metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(f"cannot rebuild a tokenizer from tokenizer.ggml.model={model!r} pre={pre!r}; "
                        "pass --tokenizer <directory of the original model's tokenizer.json>")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty in (_CONTROL, _USER_DEFINED) and not t.startswith("[PAD")]
    tok.add_special_tokens(special)
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                           "model_max_length": int(_m(meta, "context_length", 4096))}
    for key, name in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"),
                      ("padding_token_id", "pad_token"), ("unknown_token_id", "unk_token")):
        if (i := meta.get(f"tokenizer.ggml.{key}")) is not None and 0 <= int(i) < len(tokens):
            cfg[name] = tokens[int(i)]
    if (tmpl := meta.get("tokenizer.chat_template")) is not None:
        cfg["chat_template"] = tmpl
    return tok.to_str(), cfg


def tokenizer_dir(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> str:
    """A directory holding the GGUF's tokenizer (tokenizer.json + tokenizer_config.json), cached."""
    import hashlib
    import json
    meta = read_header(shard_paths(path)[0]).metadata
    text, cfg = tokenizer_json(meta)
    key = hashlib.sha256((text + json.dumps(cfg, sort_keys=True)).encode()).hexdigest()[:16]
    root = cache or os.environ.get("DSA_OVERLAY_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dsa-overlay"))
    out = os.path.join(root, "gguf-tokenizers", key)
    if not os.path.isfile(os.path.join(out, "tokenizer_config.json")):
        tmp = f"{out}.tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
            f.write(text)
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        try:
            os.rename(tmp, out)
        except OSError:     # another process won the race
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def tokenizer_for_gguf(tokenizer_name):
    """The hook in vLLM's tokenizer loader: a glm-dsa GGUF's own tokenizer as a directory.

    transformers cannot read a glm-dsa GGUF's tokenizer; anything else passes through unchanged."""
    if not isinstance(tokenizer_name, (str, os.PathLike)) or not os.fspath(tokenizer_name).endswith(".gguf"):
        return tokenizer_name
    if not is_glm_dsa(tokenizer_name):
        return tokenizer_name
    return tokenizer_dir(tokenizer_name)

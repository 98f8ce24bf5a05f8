"""The glm-dsa tensor table: every tensor llama.cpp writes for GLM-5, once.

Each row names the GGUF tensor, the HF/vLLM parameter it feeds (``DeepseekV2ForCausalLM.load_weights``,
as GlmMoeDsaForCausalLM), its shape in HF (numpy) order as a function of the config, and which blocks
hold it.  The loader's name map (``weights.plan``) and check-gguf's expected tensor set are both read
from these rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Container

from .reader import GGUFError, read_header, shard_paths

ARCH = "glm-dsa"
HF_ARCH = "GlmMoeDsaForCausalLM"
MODEL_TYPE = "glm_moe_dsa"


@dataclass(frozen=True)
class Dims:
    """The sizes tensor shapes are made of, from an HF config dict (``config.config_dict``)."""
    hidden: int
    vocab: int
    heads: int
    q_lora: int            # 0: no q LoRA (attn_q instead of attn_q_a/attn_q_b)
    kv_lora: int
    rope: int
    nope: int
    v: int
    ffn: int               # dense FFN width
    experts: int
    expert_ffn: int
    shared_ffn: int        # moe_intermediate_size * n_shared_experts
    index_heads: int       # 0: no DSA indexer
    index_dim: int
    layers: int            # num_hidden_layers (the MTP blocks follow them)
    mtp: int
    first_dense: int

    @classmethod
    def of(cls, cfg: dict) -> "Dims":
        return cls(hidden=cfg["hidden_size"], vocab=cfg["vocab_size"] or 0, heads=cfg["num_attention_heads"],
                   q_lora=cfg["q_lora_rank"] or 0, kv_lora=cfg["kv_lora_rank"], rope=cfg["qk_rope_head_dim"],
                   nope=cfg["qk_nope_head_dim"], v=cfg["v_head_dim"], ffn=cfg["intermediate_size"],
                   experts=cfg["n_routed_experts"], expert_ffn=cfg["moe_intermediate_size"],
                   shared_ffn=cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
                   index_heads=cfg["index_n_heads"], index_dim=cfg["index_head_dim"],
                   layers=cfg["num_hidden_layers"], mtp=cfg["num_nextn_predict_layers"],
                   first_dense=cfg["first_k_dense_replace"])


@dataclass(frozen=True)
class GlmDsaTensor:
    gguf: str          # model-wide: the whole name; per block: the name under ``blk.<i>.``
    hf: str            # model-wide: the HF name; per block: under ``model.layers.<i>.`` (experts: the projection)
    shape: Callable[[Dims], tuple[int, ...]]
    when: str = "always"   # which blocks hold it: a key of _WHEN
    role: str = "plain"    # plain | experts | experts_fused | kv_b_part
    optional: bool = False


def _moe(d: Dims, i: int, has: Container[str]) -> bool:
    return i >= d.first_dense


_WHEN: dict[str, Callable[[Dims, int, Container[str]], bool]] = {
    "always": lambda d, i, has: True,
    "q_lora": lambda d, i, has: d.q_lora > 0,
    "no_q_lora": lambda d, i, has: d.q_lora == 0,
    # llama.cpp splits kv_b_proj into attn_k_b + attn_v_b; older conversions kept attn_kv_b
    "kv_b_split": lambda d, i, has: f"blk.{i}.attn_kv_b.weight" not in has,
    "kv_b_whole": lambda d, i, has: f"blk.{i}.attn_kv_b.weight" in has,
    "indexer": lambda d, i, has: d.index_heads > 0,
    "dense_ffn": lambda d, i, has: i < d.first_dense,
    "moe": _moe,
    # convert_hf_to_gguf --fuse-gate-up-exps writes one ffn_gate_up_exps
    "moe_exps_split": lambda d, i, has: _moe(d, i, has) and f"blk.{i}.ffn_gate_up_exps.weight" not in has,
    "moe_exps_fused": lambda d, i, has: _moe(d, i, has) and f"blk.{i}.ffn_gate_up_exps.weight" in has,
    "moe_shared": lambda d, i, has: _moe(d, i, has) and d.shared_ffn > 0,
    "mtp": lambda d, i, has: i >= d.layers,
}

T = GlmDsaTensor
MODEL_TENSORS = (
    T("token_embd.weight", "model.embed_tokens.weight", lambda d: (d.vocab, d.hidden)),
    T("output_norm.weight", "model.norm.weight", lambda d: (d.hidden,)),
    # absent: vLLM ties lm_head to the embedding
    T("output.weight", "lm_head.weight", lambda d: (d.vocab, d.hidden), optional=True),
)
BLOCK_TENSORS = (
    T("attn_norm.weight", "input_layernorm.weight", lambda d: (d.hidden,)),
    T("ffn_norm.weight", "post_attention_layernorm.weight", lambda d: (d.hidden,)),
    T("attn_q.weight", "self_attn.q_proj.weight", lambda d: (d.heads * (d.nope + d.rope), d.hidden), "no_q_lora"),
    T("attn_q_a.weight", "self_attn.q_a_proj.weight", lambda d: (d.q_lora, d.hidden), "q_lora"),
    T("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight", lambda d: (d.q_lora,), "q_lora"),
    T("attn_q_b.weight", "self_attn.q_b_proj.weight", lambda d: (d.heads * (d.nope + d.rope), d.q_lora), "q_lora"),
    T("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight", lambda d: (d.kv_lora + d.rope, d.hidden)),
    T("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", lambda d: (d.kv_lora,)),
    T("attn_kv_b.weight", "self_attn.kv_b_proj.weight", lambda d: (d.heads * (d.nope + d.v), d.kv_lora),
      "kv_b_whole"),
    # kv_b_proj per head, split: k_b transposed [H, kv_lora, nope], v_b [H, v, kv_lora]
    T("attn_k_b.weight", "self_attn.kv_b_proj.weight", lambda d: (d.heads, d.kv_lora, d.nope), "kv_b_split",
      "kv_b_part"),
    T("attn_v_b.weight", "self_attn.kv_b_proj.weight", lambda d: (d.heads, d.v, d.kv_lora), "kv_b_split",
      "kv_b_part"),
    T("attn_output.weight", "self_attn.o_proj.weight", lambda d: (d.hidden, d.heads * d.v)),
    T("indexer.attn_q_b.weight", "self_attn.indexer.wq_b.weight",
      lambda d: (d.index_heads * d.index_dim, d.q_lora or d.hidden), "indexer"),
    T("indexer.attn_k.weight", "self_attn.indexer.wk.weight", lambda d: (d.index_dim, d.hidden), "indexer"),
    T("indexer.k_norm.weight", "self_attn.indexer.k_norm.weight", lambda d: (d.index_dim,), "indexer"),
    T("indexer.k_norm.bias", "self_attn.indexer.k_norm.bias", lambda d: (d.index_dim,), "indexer"),
    T("indexer.proj.weight", "self_attn.indexer.weights_proj.weight", lambda d: (d.index_heads, d.hidden),
      "indexer"),
    T("ffn_gate.weight", "mlp.gate_proj.weight", lambda d: (d.ffn, d.hidden), "dense_ffn"),
    T("ffn_up.weight", "mlp.up_proj.weight", lambda d: (d.ffn, d.hidden), "dense_ffn"),
    T("ffn_down.weight", "mlp.down_proj.weight", lambda d: (d.hidden, d.ffn), "dense_ffn"),
    T("ffn_gate_inp.weight", "mlp.gate.weight", lambda d: (d.experts, d.hidden), "moe"),
    T("exp_probs_b.bias", "mlp.gate.e_score_correction_bias", lambda d: (d.experts,), "moe"),
    # merged 3-D experts [n_expert, out, in]; HF stores model.layers.<i>.mlp.experts.<e>.<proj>.weight
    T("ffn_gate_exps.weight", "gate_proj", lambda d: (d.experts, d.expert_ffn, d.hidden), "moe_exps_split",
      "experts"),
    T("ffn_up_exps.weight", "up_proj", lambda d: (d.experts, d.expert_ffn, d.hidden), "moe_exps_split",
      "experts"),
    T("ffn_gate_up_exps.weight", "gate_proj+up_proj", lambda d: (d.experts, 2 * d.expert_ffn, d.hidden),
      "moe_exps_fused", "experts_fused"),
    T("ffn_down_exps.weight", "down_proj", lambda d: (d.experts, d.hidden, d.expert_ffn), "moe", "experts"),
    T("ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight", lambda d: (d.shared_ffn, d.hidden),
      "moe_shared"),
    T("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight", lambda d: (d.shared_ffn, d.hidden),
      "moe_shared"),
    T("ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight", lambda d: (d.hidden, d.shared_ffn),
      "moe_shared"),
    # NextN / MTP block (model.layers.<num_hidden_layers>.*)
    T("nextn.eh_proj.weight", "eh_proj.weight", lambda d: (d.hidden, 2 * d.hidden), "mtp"),
    T("nextn.enorm.weight", "enorm.weight", lambda d: (d.hidden,), "mtp"),
    T("nextn.hnorm.weight", "hnorm.weight", lambda d: (d.hidden,), "mtp"),
    T("nextn.shared_head_norm.weight", "shared_head.norm.weight", lambda d: (d.hidden,), "mtp"),
    T("nextn.shared_head_head.weight", "shared_head.head.weight", lambda d: (d.vocab, d.hidden), "mtp",
      optional=True),
    T("nextn.embed_tokens.weight", "embed_tokens.weight", lambda d: (d.vocab, d.hidden), "mtp", optional=True),
)
del T
assert all(t.when in _WHEN for t in BLOCK_TENSORS)

# lookups the name map uses
MODEL_BY_NAME = {t.gguf: t for t in MODEL_TENSORS}
BLOCK_BY_NAME = {t.gguf: t for t in BLOCK_TENSORS}
KV_B_PARTS = tuple(t.gguf for t in BLOCK_TENSORS if t.role == "kv_b_part")    # (attn_k_b, attn_v_b)


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    optional: bool


def expected_tensors(cfg: dict, present: Container[str]) -> dict[str, Expected]:
    """GGUF name -> expected HF-order shape for a glm-dsa model with config ``cfg`` (``config_dict``);
    ``present`` (the file's tensor names) picks the variants a conversion may choose (whole or split
    kv_b, fused gate_up experts)."""
    d = Dims.of(cfg)
    out = {t.gguf: Expected(t.shape(d), t.optional) for t in MODEL_TENSORS}
    for i in range(d.layers + d.mtp):
        for t in BLOCK_TENSORS:
            if _WHEN[t.when](d, i, present):
                out[f"blk.{i}.{t.gguf}"] = Expected(t.shape(d), t.optional)
    return out


def tensor_problems(cfg: dict, found: dict, first_path: str) -> list[str]:
    """One line per required tensor ``found`` (name -> ``reader.TensorInfo``) lacks and per tensor whose
    shape differs from ``expected_tensors``: what the loader refuses before vLLM sees a weight."""
    out = []
    for name, want in expected_tensors(cfg, found).items():
        t = found.get(name)
        if t is None:
            if not want.optional:
                out.append(f"{first_path}: tensor {name} missing (expected shape {list(want.shape)})")
        elif tuple(t.shape) != want.shape:
            out.append(f"{t.path}: tensor {name} has shape {list(t.shape)}, expected {list(want.shape)}")
    return out


def is_glm_dsa(path: str | os.PathLike) -> bool:
    """True for a local GGUF (first shard of a split, or any shard) whose architecture is glm-dsa."""
    try:
        first = shard_paths(path)[0]
        return os.path.isfile(first) and read_header(first).arch == ARCH
    except (GGUFError, OSError):
        return False

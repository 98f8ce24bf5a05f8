"""A byte-level GGUF writer for tests: any metadata value type and any tensor info, including the ones no
converter writes (lying counts, wrong types, odd shapes), so check-gguf can be shown hostile files.

Written from the format (llama.cpp's gguf.h: little-endian; magic, version, tensor count, key count;
keys as (string, u32 type, value); tensor infos as (string, u32 n_dims, u64 ne[n_dims] innermost first,
u32 ggml type, u64 offset); data aligned to general.alignment), not from the reader under test.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
# ggml type id -> (elements per block, bytes per block), from ggml.h's type traits
GGML = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210),
        "I16": (25, 1, 2), "BF16": (30, 1, 2), "TQ1_0": (34, 256, 54)}


@dataclass
class Typed:
    """A metadata value with its GGUF type spelled out (ARR: ``value`` is (element type, items))."""
    vtype: int
    value: Any
    count: int | None = None     # ARR: the element count to write (a lie when it differs)


@dataclass
class Raw:
    """A metadata value written as given bytes after its type id (e.g. arrays nested thousands deep)."""
    vtype: int
    data: bytes


def s(x: str | bytes) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def _auto(v: Any) -> Typed:
    if isinstance(v, Typed):
        return v
    if isinstance(v, bool):
        return Typed(BOOL, v)
    if isinstance(v, int):
        return Typed(U32, v)
    if isinstance(v, float):
        return Typed(F32, v)
    if isinstance(v, str):
        return Typed(STR, v)
    if isinstance(v, list):
        return Typed(ARR, (STR if v and isinstance(v[0], str) else I32, v))
    raise TypeError(v)


def value(t: Typed) -> bytes:
    if t.vtype == STR:
        return s(t.value)
    if t.vtype == ARR:
        etype, items = t.value
        out = struct.pack("<IQ", etype, len(items) if t.count is None else t.count)
        return out + b"".join(value(x if isinstance(x, Typed) else Typed(etype, x)) for x in items)
    return struct.pack("<" + _FMT[t.vtype], t.value)


def kv(key: str, v: Any) -> bytes:
    if isinstance(v, Raw):
        return s(key) + struct.pack("<I", v.vtype) + v.data
    t = _auto(v)
    return s(key) + struct.pack("<I", t.vtype) + value(t)


def nbytes(shape: tuple[int, ...], type_name: str) -> int:
    _, block, size = GGML[type_name]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def write(path, meta: dict[str, Any], tensors: list[tuple[str, tuple[int, ...], str | int]], *,
          n_tensors: int | None = None, n_kv: int | None = None, version: int = 3, alignment: int = 32,
          extra_bytes: int = 0) -> None:
    """A GGUF with ``meta`` and tensor infos (name, HF-order shape, ggml type name or raw id); the data
    region is a hole (sparse), sized from the shapes; counts may lie."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                          len(meta) if n_kv is None else n_kv))
    for k, v in meta.items():
        out += kv(k, v)
    off = 0
    for name, shape, t in tensors:
        tid = GGML[t][0] if isinstance(t, str) else t
        out += s(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *reversed(shape))
        out += struct.pack("<IQ", tid, off)
        size = nbytes(shape, t) if isinstance(t, str) else 0
        off += (size + alignment - 1) // alignment * alignment
    data_start = (len(out) + alignment - 1) // alignment * alignment
    with open(path, "wb") as f:
        f.write(out)
    os.truncate(path, data_start + off + extra_bytes)


# --- a glm-dsa model header of any size (the tensor set from the runtime table; the llama.cpp fixtures
# prove that table, these files exercise sizes and hostile values) ---

GLM5 = dict(hidden_size=6144, vocab_size=154880, num_hidden_layers=78, num_nextn_predict_layers=1,
            num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64,
            qk_nope_head_dim=192, v_head_dim=256, n_routed_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=2048, intermediate_size=12288, n_shared_experts=1,
            first_k_dense_replace=3, index_n_heads=32, index_head_dim=128, index_topk=2048)
# the same shape of model, a few KiB of header and data
SMALL = dict(GLM5, hidden_size=256, vocab_size=512, num_hidden_layers=3, num_attention_heads=2,
             q_lora_rank=256, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
             first_k_dense_replace=1, index_n_heads=2, index_head_dim=32, index_topk=8)


def glm_dsa_meta(c: dict, arch: str = "glm-dsa") -> dict[str, Any]:
    a = arch
    return {"general.architecture": arch,
            f"{a}.block_count": c["num_hidden_layers"] + c["num_nextn_predict_layers"],
            f"{a}.nextn_predict_layers": c["num_nextn_predict_layers"],
            f"{a}.context_length": 202752, f"{a}.embedding_length": c["hidden_size"],
            f"{a}.feed_forward_length": c["intermediate_size"],
            f"{a}.attention.head_count": c["num_attention_heads"], f"{a}.attention.head_count_kv": 1,
            f"{a}.expert_count": c["n_routed_experts"], f"{a}.expert_used_count": c["num_experts_per_tok"],
            f"{a}.expert_shared_count": c["n_shared_experts"],
            f"{a}.expert_feed_forward_length": c["moe_intermediate_size"],
            f"{a}.leading_dense_block_count": c["first_k_dense_replace"],
            f"{a}.attention.q_lora_rank": c["q_lora_rank"], f"{a}.attention.kv_lora_rank": c["kv_lora_rank"],
            f"{a}.rope.dimension_count": c["qk_rope_head_dim"],
            f"{a}.attention.key_length_mla": c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
            f"{a}.attention.value_length_mla": c["v_head_dim"],
            f"{a}.attention.indexer.head_count": c["index_n_heads"],
            f"{a}.attention.indexer.key_length": c["index_head_dim"],
            f"{a}.attention.indexer.top_k": c["index_topk"], f"{a}.vocab_size": c["vocab_size"],
            f"{a}.expert_gating_func": 2, f"{a}.expert_weights_scale": 2.5, f"{a}.expert_weights_norm": True,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.rope.freq_base": 1000000.0}


def glm_dsa_tensors(c: dict, drop=(), expert_type: str | int = "Q4_K") -> list[tuple[str, tuple[int, ...], str | int]]:
    from overlay.gguf import tensors
    out = []
    for name, want in tensors.expected_tensors(c, ()).items():
        if name in drop or (want.optional and name != "output.weight"):
            continue
        shape = want.shape
        t = ("F32" if len(shape) == 1 else expert_type if "_exps" in name else
             "Q4_K" if shape[-1] % 256 == 0 else "Q8_0" if shape[-1] % 32 == 0 else "F16")
        out.append((name, shape, t))
    return out


def glm_dsa_file(path, c: dict = SMALL, *, arch: str = "glm-dsa", meta: dict | None = None, drop=(),
                 expert_type: str | int = "Q4_K", **kw) -> None:
    """A glm-dsa model header (data region sparse) of config ``c``; ``meta`` overrides or adds keys."""
    write(path, {**glm_dsa_meta(c, arch), **(meta or {})}, glm_dsa_tensors(c, drop, expert_type), **kw)

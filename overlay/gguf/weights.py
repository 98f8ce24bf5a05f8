"""The weight plan and stream: which vLLM parameter every glm-dsa tensor feeds, and the tensors.

``plan`` maps GGUF tensors (named by ``tensors``' table) to vLLM loads and decides, per vLLM release,
which must arrive dense ("force-dequant"); ``hf_tensors`` rebuilds every HF checkpoint tensor
(dequantized; experts per expert); ``GlmDsaNameMap`` is what ``weights_map``, the hook in vLLM's
``GGUFModelLoader``, returns: a ``gguf name -> hf name`` dict (as vLLM's own map) that also yields
vLLM's GGUF weight stream (``qweight_type`` first, then data; ``kv_b_proj`` rebuilt from ``attn_k_b`` +
``attn_v_b``; experts as merged 3-D tensors).  torch, numpy and gguf are imported where data is read.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from .config import config_dict
from .reader import DENSE_TYPES, VLLM_GGUF_TYPES, GGUFError, TensorInfo, merged_tensors, read_model
from .tensors import BLOCK_BY_NAME, KV_B_PARTS, MODEL_BY_NAME, is_glm_dsa, tensor_problems

_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# Layers whose weights vLLM must get dense (they are dequantized at load), by the release they start at:
#   mlp.gate: GateLinear(quant_config=None); eh_proj: nn.Linear (MTP);
#   indexer.weights_proj: quant_config=None in every release;
#   kv_b_proj: rebuilt from two differently-quantized halves, so always dense;
#   indexer.wk: merged into wk_weights_proj (quant_config=None) from 0.20.0 on, quantizable before;
#   indexer.wq_b: a ReplicatedLinear, whose weight_loader has no GGUF branch from 0.24.0 on (GGUF left vLLM's
#     tree; vllm-gguf-plugin loads it): a quantized load fails there (seen on the H200 with 0.26.0).
DENSE_SUFFIXES_COMMON = ("mlp.gate.weight", "eh_proj.weight", "self_attn.indexer.weights_proj.weight",
                         "self_attn.kv_b_proj.weight")
DENSE_SUFFIXES = {
    "0.16.0": DENSE_SUFFIXES_COMMON,
    "0.20.0": DENSE_SUFFIXES_COMMON + ("self_attn.indexer.wk.weight",),
    "0.24.0": DENSE_SUFFIXES_COMMON + ("self_attn.indexer.wk.weight", "self_attn.indexer.wq_b.weight"),
}
# vLLM fuses these into one layer whose shards must all be quantized or all dense
FUSED_GROUPS = (("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
                ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"))


def _key(version: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in version.split("+")[0].split(".")[:3])


def release_rules(version: str) -> str:
    """The DENSE_SUFFIXES key that governs vLLM `version`: the newest one not after it."""
    at_or_before = [r for r in DENSE_SUFFIXES if _key(r) <= _key(version)]
    return max(at_or_before, key=_key) if at_or_before else min(DENSE_SUFFIXES, key=_key)


def vllm_release() -> str:
    """The DENSE_SUFFIXES key of the vLLM this module runs inside; the newest one outside vLLM."""
    try:
        import vllm  # noqa: F401
        v = getattr(vllm, "__version__", "")
    except Exception:
        v = ""
    return release_rules(v) if v and v[0].isdigit() else max(DENSE_SUFFIXES, key=_key)


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
    dense_suffixes = DENSE_SUFFIXES[release_rules(release)]
    entries: list[Entry] = []
    unmapped: list[str] = []
    problems: list[str] = []
    kv_parts: dict[int, dict[str, TensorInfo]] = {}
    for name, t in tensors.items():
        if name in MODEL_BY_NAME:
            entries.append(Entry(MODEL_BY_NAME[name].hf, "plain", [t]))
            continue
        m = _BLK_RE.match(name)
        row = BLOCK_BY_NAME.get(m.group(2)) if m else None
        if row is None:
            unmapped.append(name)
            continue
        bid = int(m.group(1))
        pre = f"model.layers.{bid}."
        if row.role == "plain":
            entries.append(Entry(pre + row.hf, "plain", [t]))
        elif row.role in ("experts", "experts_fused"):
            projs = row.hf.split("+")
            for half, proj in enumerate(projs):
                entries.append(Entry(pre + f"mlp.experts.0.{proj}.weight", "experts", [t], expert_proj=proj,
                                     gate_up_half=half if len(projs) > 1 else -1))
        else:   # kv_b_part
            kv_parts.setdefault(bid, {})[row.gguf] = t
    for bid, parts in sorted(kv_parts.items()):
        if len(parts) != 2:
            have = next(iter(parts))
            problems.append(f"blk.{bid}.{have}: its partner "
                            f"blk.{bid}.{[p for p in KV_B_PARTS if p != have][0]} is missing")
            continue
        entries.append(Entry(f"model.layers.{bid}.self_attn.kv_b_proj.weight", "kv_b",
                             [parts[p] for p in KV_B_PARTS],
                             dense=True, why="kv_b_proj rebuilt from attn_k_b + attn_v_b"))

    ignored = set(unmapped)
    problems += [msg for name, t in tensors.items() if name not in ignored and (msg := t.layout_problem())]
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
            e.dense, e.why = True, f"vLLM {release} loads this layer dense only"
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
        self.files = [h.path for h in self.headers]    # every shard, first first
        self.release = release or vllm_release()
        found = merged_tensors(self.headers)
        self.plan = plan(found, self.release)
        if self.plan.problems:
            raise GGUFError(f"{self.headers[0].path}: {self.plan.problems[0]}")
        try:
            cfg = config_dict(self.headers[0].metadata, found)
        except GGUFError:
            cfg = None      # no usable glm-dsa keys: the config comes from --hf-config-path
        if cfg is not None and not cfg.get("vocab_size") and (emb := found.get("token_embd.weight")):
            cfg["vocab_size"] = emb.shape[0]      # as check-gguf: files without tokenizer metadata
        if cfg is not None and (bad := tensor_problems(cfg, found, self.headers[0].path)):
            raise GGUFError(bad[0] + (f" (and {len(bad) - 1} more; run check-gguf)" if len(bad) > 1 else ""))
        super().__init__({"output.weight": "lm_head.weight"})
        for e in self.plan.entries:
            for s in e.sources:
                self[s.name] = e.hf_name
        self.num_hidden_layers = None if cfg is None else cfg["num_hidden_layers"]

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

    def dsa_unquantized_modules(self) -> list[str]:
        """Modules vLLM builds without the GGUF quant method: the dense loads of ``dsa_weight_type_map``
        (vLLM's in-tree loader filters that map the same way; the vllm-gguf-plugin adapter calls this)."""
        return [name.removesuffix(".weight") for name, t in self.dsa_weight_type_map().items()
                if t in DENSE_TYPES and name.endswith(".weight")]

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


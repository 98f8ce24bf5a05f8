"""``python apply.py check-gguf PATH [--hf-config-path DIR]``: is this GLM-5 GGUF loadable?

Reads only GGUF headers (metadata and tensor infos, never tensor data), so a 400 GB split model is
checked in seconds: architecture, hyper-parameters, every expected tensor present with the expected
shape and a ggml type vLLM (or the overlay's dequantizer) can use, every shard present, none
truncated.  Prints a summary, then one line per problem naming the tensor or shard; exits 1 on any.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import click

from overlay.gguf import reader, tensors, weights
from overlay.gguf.config import config_dict
from overlay.gguf.tokenizer import PRE_TOKENIZER_SPLITS

# hyper-parameters compared against --hf-config-path
_COMPARED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
             "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
             "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
             "first_k_dense_replace", "index_n_heads", "index_head_dim", "index_topk", "vocab_size")


@dataclass
class Report:
    summary: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _dequantizable(type_name: str) -> bool:
    try:
        import gguf
        return gguf.GGMLQuantizationType[type_name] in gguf.quants._type_traits or type_name in reader.DENSE_TYPES
    except Exception:
        return False


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def check(path: str, hf_config_path: str | None = None, release: str | None = None) -> Report:
    rep = Report()
    paths = reader.shard_paths(path)
    headers: list[reader.GGUFHeader] = []
    for p in paths:
        if not os.path.isfile(p):
            rep.problems.append(f"{p}: shard missing ({len(paths)} expected); download every -of- part")
            continue
        try:
            headers.append(reader.read_header(p))
        except reader.GGUFError as exc:
            rep.problems.append(str(exc))
    if not headers:
        return rep
    first = headers[0]
    if first.path != paths[0]:
        rep.problems.append(f"{paths[0]}: first shard unreadable; its metadata describes the model")
        return rep
    arch = first.arch
    if arch != tensors.ARCH:
        rep.problems.append(f"{first.path}: architecture {arch!r}, expected {tensors.ARCH!r} (a GLM-5 GGUF "
                            "converted by llama.cpp's convert_hf_to_gguf.py)")
        return rep

    # shards: split metadata and truncation
    if len(paths) > 1:
        count = first.metadata.get("split.count")
        if count is not None and int(count) != len(paths):
            rep.problems.append(f"{first.path}: split.count is {count} but the file name says {len(paths)} shards")
        total = first.metadata.get("split.tensors.count")
        have = sum(len(h.tensors) for h in headers)
        if total is not None and len(headers) == len(paths) and int(total) != have:
            rep.problems.append(f"{first.path}: split.tensors.count is {total} but the shards hold {have} tensors")
        for i, h in enumerate(headers):
            no = h.metadata.get("split.no")
            idx = paths.index(h.path)
            if no is not None and int(no) != idx:
                rep.problems.append(f"{h.path}: split.no is {no}, expected {idx}")
    for h in headers:
        end, last = h.data_start, None
        for t in h.tensors.values():
            if t.nbytes < 0:
                continue
            if t.offset + t.nbytes > end:
                end, last = t.offset + t.nbytes, t
        if end > h.file_size:
            what = f"tensor {last.name} ends at byte {end}" if last else f"data starts at byte {end}"
            rep.problems.append(f"{h.path}: truncated: {what} but the file has {h.file_size} bytes "
                                f"({end - h.file_size} missing); re-download it")
    if len(headers) < len(paths):
        return rep      # the tensor set is checked whole only: a missing shard's tensors would all be "missing"

    found = reader.merged_tensors(headers)
    for name, t in found.items():
        if t.ggml_type not in reader.GGML_TYPES:
            rep.problems.append(f"{t.path}: tensor {name} has unknown ggml type id {t.ggml_type}")
    try:
        cfg = config_dict(first.metadata, found)
    except reader.GGUFError as exc:
        rep.problems.append(f"{first.path}: {exc}")
        return rep
    if not cfg.get("vocab_size"):
        emb = found.get("token_embd.weight")
        cfg["vocab_size"] = emb.shape[0] if emb else 0

    if hf_config_path:
        cj = os.path.join(hf_config_path, "config.json")
        try:
            with open(cj) as f:
                hf = json.load(f)
        except (OSError, ValueError) as exc:
            rep.problems.append(f"{cj}: unreadable ({exc})")
            hf = {}
        if hf and hf.get("model_type") not in (tensors.MODEL_TYPE, None):
            rep.problems.append(f"{cj}: model_type {hf.get('model_type')!r}, expected {tensors.MODEL_TYPE!r}")
        for key in _COMPARED:
            if key in hf and hf[key] != cfg.get(key) and not (key == "vocab_size" and hf[key] >= cfg[key]):
                rep.problems.append(f"{cj}: {key} = {hf[key]} but the GGUF says {cfg.get(key)}")

    n_layers, n_mtp = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]
    expected = tensors.expected_tensors(cfg, found)
    for name, want in expected.items():
        t = found.get(name)
        if t is None:
            if not want.optional:
                rep.problems.append(f"{first.path}: tensor {name} missing (expected shape {list(want.shape)})")
            continue
        if tuple(t.shape) != want.shape:
            rep.problems.append(f"{t.path}: tensor {name} has shape {list(t.shape)}, expected {list(want.shape)}")
        tn = t.type_name
        if tn not in reader.VLLM_GGUF_TYPES and t.ggml_type in reader.GGML_TYPES:
            if _dequantizable(tn):
                rep.notes.append(f"{name}: ggml type {tn} is dequantized at load (vLLM has no kernel for it)")
            else:
                rep.problems.append(f"{t.path}: tensor {name} has ggml type {tn}, which neither vLLM's GGUF "
                                    "kernels nor gguf-py's dequantizer support; re-quantize it")
    for name in sorted(set(found) - set(expected)):
        rep.notes.append(f"{name}: not a glm-dsa tensor this overlay loads (ignored)")
    p = weights.plan(found, release)
    rep.problems.extend(f"{first.path}: {msg}" for msg in p.problems)

    # summary
    by_type: dict[str, int] = {}
    for t in found.values():
        by_type[t.type_name] = by_type.get(t.type_name, 0) + max(t.nbytes, 0)
    meta = first.metadata
    dense = [e for e in p.entries if e.dense and not all(s.type_name in reader.DENSE_TYPES for s in e.sources)]
    rep.summary += [
        f"file: {paths[0]}" + (f" (+{len(paths) - 1} shards)" if len(paths) > 1 else ""),
        f"architecture: {arch} ({meta.get('general.name', '?')}), {len(found)} tensors, "
        f"{_fmt_bytes(sum(h.file_size for h in headers))} on disk",
        f"layers: {n_layers} ({cfg['first_k_dense_replace']} dense, {n_layers - cfg['first_k_dense_replace']} MoE),"
        f" hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}, context {cfg['max_position_embeddings']}",
        f"MLA: q_lora {cfg['q_lora_rank']}, kv_lora {cfg['kv_lora_rank']}, qk_nope {cfg['qk_nope_head_dim']}, "
        f"qk_rope {cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}",
        f"MoE: {cfg['n_routed_experts']} experts, top-{cfg['num_experts_per_tok']}, "
        f"{cfg['n_shared_experts']} shared, routing bias {'yes (noaux_tc)' if cfg.get('topk_method') else 'no'}",
        f"indexer (DSA): {cfg['index_n_heads']} heads x {cfg['index_head_dim']}, top-k {cfg['index_topk']}",
        f"MTP: {n_mtp} NextN layer(s)" + (" (usable for MTP speculative decoding)" if n_mtp else ""),
        f"tokenizer: {meta.get('tokenizer.ggml.model', 'none')}/{meta.get('tokenizer.ggml.pre', '-')}, "
        f"{len(meta.get('tokenizer.ggml.tokens', ()))} tokens, " + (
            "rebuilt from the GGUF by the overlay" if meta.get("tokenizer.ggml.model") == "gpt2"
            and meta.get("tokenizer.ggml.pre") in PRE_TOKENIZER_SPLITS
            else "not rebuildable: serve with --tokenizer <original model dir>"),
        "bytes per ggml type: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in
                                            sorted(by_type.items(), key=lambda kv: -kv[1])),
        f"dequantized at load: {len(dense)} tensors ({_fmt_bytes(sum(s.nbytes for e in dense for s in e.sources))} "
        "quantized) - kv_b halves, router/indexer layers vLLM keeps dense, types without a vLLM kernel",
    ]
    return rep


@click.command("check-gguf")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--hf-config-path", type=click.Path(file_okay=False), default=None,
              help="directory with the original config.json to compare hyper-parameters against")
@click.option("-v", "--verbose", is_flag=True, help="also print notes (tensors dequantized at load, ignored)")
def check_gguf(path: str, hf_config_path: str | None, verbose: bool) -> None:
    """Check a GLM-5 (glm-dsa) GGUF before a long load: headers only, takes seconds."""
    rep = check(path, hf_config_path)
    for line in rep.summary:
        click.echo(line)
    if verbose:
        for line in rep.notes:
            click.echo(f"note: {line}")
    for line in rep.problems:
        click.echo(f"PROBLEM {line}")
    if rep.problems:
        click.echo(f"check-gguf: {len(rep.problems)} problem(s); fix them before loading")
        raise SystemExit(1)
    click.echo("check-gguf: OK")

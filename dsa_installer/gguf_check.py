"""``python apply.py check-gguf PATH [--hf-config-path DIR]``: is this GLM-5 GGUF loadable?

Reads only GGUF headers (metadata and tensor infos, never tensor data), so a 400 GB split model is
checked in seconds: architecture, hyper-parameters, every expected tensor present with the expected
shape and a ggml type vLLM (or the overlay's dequantizer) can use, every shard present, none
truncated.  Prints a summary, then one line per problem naming the tensor or shard (the first 40, then
how many more); exits 1 on any.  Any path gets that answer: a missing file, a directory, a FIFO or a
corrupt header is a PROBLEM line too (the reader checks every count and type before it allocates).
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


def _read_shards(path: str, rep: Report) -> tuple[list[str], list[reader.GGUFHeader]]:
    """Every shard's header; each unreadable one is a problem saying why (missing, a FIFO, ...)."""
    try:
        paths = reader.shard_paths(path)
    except reader.GGUFError as exc:
        rep.problems.append(str(exc))
        return [], []
    headers = []
    for p in paths:
        try:
            headers.append(reader.read_header(p, 0 if p == path else len(paths)))
        except reader.GGUFError as exc:
            rep.problems.append(str(exc))
    return paths, headers


def _split_problems(paths: list[str], headers: list[reader.GGUFHeader]) -> list[str]:
    first, out = headers[0], []

    def integer(h: reader.GGUFHeader, key: str) -> int | None:
        v = h.metadata.get(key)
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        out.append(f"{h.path}: {key} is {reader.show(v)}, expected an integer")
        return None

    count = integer(first, "split.count")
    if count is not None and count != len(paths):
        out.append(f"{first.path}: split.count is {count} but the file name says {len(paths)} shards")
    total, have = integer(first, "split.tensors.count"), sum(len(h.tensors) for h in headers)
    if total is not None and len(headers) == len(paths) and total != have:
        out.append(f"{first.path}: split.tensors.count is {total} but the shards hold {have} tensors")
    index = {p: i for i, p in enumerate(paths)}
    for h in headers:
        no = integer(h, "split.no")
        if no is not None and no != index[h.path]:
            out.append(f"{h.path}: split.no is {no}, expected {index[h.path]}")
    return out


def _truncation(h: reader.GGUFHeader) -> str | None:
    end, last = h.data_start, None
    for t in h.tensors.values():
        if t.nbytes >= 0 and t.offset + t.nbytes > end:
            end, last = t.offset + t.nbytes, t
    if end <= h.file_size:
        return None
    what = f"tensor {last.name} ends at byte {end}" if last else f"data starts at byte {end}"
    return (f"{h.path}: truncated: {what} but the file has {h.file_size} bytes ({end - h.file_size} missing); "
            "re-download it")


def _hf_config_problems(hf_config_path: str, cfg: dict) -> list[str]:
    cj = os.path.join(hf_config_path, "config.json")
    if not os.path.isfile(cj):
        return [f"{cj}: not a file; --hf-config-path takes the folder of the original model's config.json"]
    try:
        with open(cj) as f:
            hf = json.load(f)
    except (OSError, ValueError) as exc:
        return [f"{cj}: unreadable ({exc})"]
    if not isinstance(hf, dict):
        return [f"{cj}: not a JSON object"]
    out = []
    if hf.get("model_type") not in (tensors.MODEL_TYPE, None):
        out.append(f"{cj}: model_type {hf.get('model_type')!r}, expected {tensors.MODEL_TYPE!r}")
    for key in _COMPARED:
        if key not in hf or hf[key] == cfg.get(key):
            continue
        if key == "vocab_size" and isinstance(hf[key], int) and hf[key] >= (cfg[key] or 0):
            continue    # HF pads the vocabulary
        out.append(f"{cj}: {key} = {hf[key]} but the GGUF says {cfg.get(key)}")
    return out


def _tensor_problems(rep: Report, cfg: dict, found: dict[str, reader.TensorInfo], first_path: str) -> set[str]:
    """Missing tensors, wrong shapes and unusable types against the runtime table; the expected names."""
    expected = tensors.expected_tensors(cfg, found)
    for name, want in expected.items():
        t = found.get(name)
        if t is None:
            if not want.optional:
                rep.problems.append(f"{first_path}: tensor {name} missing (expected shape {list(want.shape)})")
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
    return set(expected)


def _text(v, default: str) -> str:
    return default if v is None else v[:80] if isinstance(v, str) else reader.show(v)


def check(path: str, hf_config_path: str | None = None, release: str | None = None) -> Report:
    rep = Report()
    path = os.fspath(path)
    paths, headers = _read_shards(path, rep)
    if not headers or headers[0].path != paths[0]:
        return rep          # the first shard's own problem is listed: its metadata describes the model
    first = headers[0]
    arch = first.arch
    if arch != tensors.ARCH:
        shown = repr(arch[:80]) if isinstance(arch, str) else _text(arch, "none")
        rep.problems.append(f"{first.path}: architecture {shown}, expected {tensors.ARCH!r} (a GLM-5 GGUF "
                            "converted by llama.cpp's convert_hf_to_gguf.py)")
        return rep
    if len(paths) > 1:
        rep.problems += _split_problems(paths, headers)
    rep.problems += [msg for h in headers if (msg := _truncation(h))]
    if len(headers) < len(paths):
        return rep      # the tensor set is checked whole only: a missing shard's tensors would all be "missing"

    found = reader.merged_tensors(headers)
    try:
        cfg = config_dict(first.metadata, found)
    except reader.GGUFError as exc:
        rep.problems.append(f"{first.path}: {exc}")
        return rep
    if not cfg.get("vocab_size"):
        emb = found.get("token_embd.weight")
        cfg["vocab_size"] = emb.shape[0] if emb else 0
    if hf_config_path:
        rep.problems += _hf_config_problems(hf_config_path, cfg)
    expected = _tensor_problems(rep, cfg, found, first.path)
    p = weights.plan(found, release)
    rep.problems.extend(f"{first.path}: {msg}" for msg in p.problems)
    unmapped = set(p.unmapped)
    for name in sorted(set(found) - expected):
        if name in unmapped and (msg := found[name].layout_problem()):
            rep.problems.append(f"{found[name].path}: {msg}")     # ignored by the loader, yet a corrupt file
        rep.notes.append(f"{name}: not a glm-dsa tensor this overlay loads (ignored)")
    rep.summary += _summary(paths, headers, found, cfg, p)
    return rep


def _summary(paths, headers, found, cfg, p) -> list[str]:
    first = headers[0]
    meta = first.metadata
    n_layers, n_mtp = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]
    by_type: dict[str, int] = {}
    for t in found.values():
        by_type[t.type_name] = by_type.get(t.type_name, 0) + max(t.nbytes, 0)
    dense = [e for e in p.entries if e.dense and not all(s.type_name in reader.DENSE_TYPES for s in e.sources)]
    tok_model, tok_pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    tokens = meta.get("tokenizer.ggml.tokens")
    return [
        f"file: {paths[0]}" + (f" (+{len(paths) - 1} shards)" if len(paths) > 1 else ""),
        f"architecture: {first.arch} ({_text(meta.get('general.name'), '?')}), {len(found)} tensors, "
        f"{_fmt_bytes(sum(h.file_size for h in headers))} on disk",
        f"layers: {n_layers} ({cfg['first_k_dense_replace']} dense, {n_layers - cfg['first_k_dense_replace']} MoE),"
        f" hidden {cfg['hidden_size']}, heads {cfg['num_attention_heads']}, context {cfg['max_position_embeddings']}",
        f"MLA: q_lora {cfg['q_lora_rank']}, kv_lora {cfg['kv_lora_rank']}, qk_nope {cfg['qk_nope_head_dim']}, "
        f"qk_rope {cfg['qk_rope_head_dim']}, v {cfg['v_head_dim']}",
        f"MoE: {cfg['n_routed_experts']} experts, top-{cfg['num_experts_per_tok']}, "
        f"{cfg['n_shared_experts']} shared, routing bias {'yes (noaux_tc)' if cfg.get('topk_method') else 'no'}",
        f"indexer (DSA): {cfg['index_n_heads']} heads x {cfg['index_head_dim']}, top-k {cfg['index_topk']}",
        f"MTP: {n_mtp} NextN layer(s)" + (" (usable for MTP speculative decoding)" if n_mtp else ""),
        f"tokenizer: {_text(tok_model, 'none')}/{_text(tok_pre, '-')}, "
        f"{len(tokens) if isinstance(tokens, list) else 0} tokens, " + (
            "rebuilt from the GGUF by the overlay" if tok_model == "gpt2" and tok_pre in PRE_TOKENIZER_SPLITS
            else "not rebuildable: serve with --tokenizer <original model dir>"),
        "bytes per ggml type: " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in
                                            sorted(by_type.items(), key=lambda kv: -kv[1])),
        f"dequantized at load: {len(dense)} tensors ({_fmt_bytes(sum(s.nbytes for e in dense for s in e.sources))} "
        "quantized) - kv_b halves, router/indexer layers vLLM keeps dense, types without a vLLM kernel",
    ]


# at most this many problem (and note) lines are printed; the last line counts them all
SHOWN = 40


def _one_line(line: str, width: int = 400) -> str:
    """A line as printed: control characters (a hostile key or tensor name may hold any) escaped, cut."""
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    return line if len(line) <= width else line[:width] + "..."


def _echo_capped(lines: list[str], prefix: str) -> None:
    for line in lines[:SHOWN]:
        click.echo(f"{prefix}{_one_line(line)}")
    if len(lines) > SHOWN:
        click.echo(f"{prefix}... and {len(lines) - SHOWN} more")


@click.command("check-gguf")
@click.argument("path", type=click.Path(readable=False))
@click.option("--hf-config-path", type=click.Path(file_okay=False), default=None,
              help="directory with the original config.json to compare hyper-parameters against")
@click.option("-v", "--verbose", is_flag=True, help="also print notes (tensors dequantized at load, ignored)")
def check_gguf(path: str, hf_config_path: str | None, verbose: bool) -> None:
    """Check a GLM-5 (glm-dsa) GGUF before a long load: headers only, takes seconds."""
    rep = check(path, hf_config_path)
    for line in rep.summary:
        click.echo(line)
    if verbose:
        _echo_capped(rep.notes, "note: ")
    _echo_capped(rep.problems, "PROBLEM ")
    if rep.problems:
        shown = f", the first {SHOWN} shown" if len(rep.problems) > SHOWN else ""
        click.echo(f"check-gguf: {len(rep.problems)} problem(s){shown}; fix them before loading")
        raise SystemExit(1)
    click.echo("check-gguf: OK")

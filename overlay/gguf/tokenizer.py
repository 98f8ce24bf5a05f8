"""The tokenizer of a glm-dsa GGUF rebuilt from its ``tokenizer.ggml.*`` metadata (llama.cpp "gpt2"
byte-level BPE) as a tokenizer.json directory; ``tokenizer_for_gguf`` is the hook in vLLM's tokenizer
loader (through ``gguf_glm_dsa``).  The ``tokenizers`` package is imported only when one is built.
"""
from __future__ import annotations

import os
from typing import Any

from .cache import cached_dir
from .reader import GGUFError, read_header, shard_paths
from .config import meta_int, meta_list
from .tensors import ARCH, is_glm_dsa

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
    tokens = meta_list(meta, "tokenizer.ggml.tokens", str)
    if not tokens:
        raise GGUFError("the GGUF has no tokenizer.ggml.tokens; pass --tokenizer <directory of the original "
                        "model's tokenizer.json>")
    types = meta_list(meta, "tokenizer.ggml.token_type", int) or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta_list(meta, "tokenizer.ggml.merges", str) or []]
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
                           "model_max_length": meta_int(meta, f"{ARCH}.context_length", 4096, lo=1, hi=1 << 31)}
    for key, name in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"),
                      ("padding_token_id", "pad_token"), ("unknown_token_id", "unk_token")):
        if isinstance(i := meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= i < len(tokens):
            cfg[name] = tokens[i]
    if isinstance(tmpl := meta.get("tokenizer.chat_template"), str):
        cfg["chat_template"] = tmpl
    return tok.to_str(), cfg


def tokenizer_dir(path: str | os.PathLike) -> str:
    """A directory holding the GGUF's tokenizer (tokenizer.json + tokenizer_config.json), cached."""
    import json
    meta = read_header(shard_paths(path)[0]).metadata
    text, cfg = tokenizer_json(meta)
    return cached_dir("gguf-tokenizers", {"tokenizer.json": text,
                                          "tokenizer_config.json": json.dumps(cfg, indent=1)})


def tokenizer_for_gguf(tokenizer_name):
    """The hook in vLLM's tokenizer loader: a glm-dsa GGUF's own tokenizer as a directory.

    transformers cannot read a glm-dsa GGUF's tokenizer; anything else passes through unchanged."""
    if not isinstance(tokenizer_name, (str, os.PathLike)) or not os.fspath(tokenizer_name).endswith(".gguf"):
        return tokenizer_name
    if not is_glm_dsa(tokenizer_name):
        return tokenizer_name
    return tokenizer_dir(tokenizer_name)

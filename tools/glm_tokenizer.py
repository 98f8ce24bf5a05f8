"""A GLM-style byte-level BPE tokenizer, trained here (tokenizers only): GLM-4's pre-tokenizer split, which is
llama.cpp's "glm4" pre-tokenizer, and GLM-4.5/5's added tokens, so llama.cpp's converter can make a glm-dsa GGUF of
a model that uses it. Shared by tests/fixtures/make_glm_dsa_gguf.py (tiny random fixtures) and
bench/train_reference.py (the trained reference model of issue 17)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

# GLM-4.5/5's added tokens; the converter's _set_vocab_glm looks four of them up by name.
GLM_SPECIAL = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<think>",
    "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink",
]
# GLM-4's pre-tokenizer split (llama.cpp's "glm4" pre-tokenizer implements the same regex).
GLM4_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> dict[str, int]:
    """Learn `vocab_size` byte-level BPE tokens from `texts`, add GLM_SPECIAL after them, save tokenizer.json and
    tokenizer_config.json into `out`. Returns the special tokens' ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(GLM_SPECIAL)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in GLM_SPECIAL}
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in GLM_SPECIAL}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False, "do_lower_case": False,
        "model_max_length": 4096, "padding_side": "left", "remove_space": False,
    }, indent=2))
    return ids

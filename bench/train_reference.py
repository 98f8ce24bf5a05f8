#!/usr/bin/env python3
"""Train the small GLM-5-shaped quality reference of issue 17 on an offline text corpus (one H200, minutes).

A ``GlmMoeDsaForCausalLM`` (transformers) with GLM-5's attention dims (kv_lora 512 + rope 64 = the 576-wide latent,
qk_nope 192, v_head 256, indexer 32 heads x 128, top-k 256 so it selects on 1024-token contexts), a few layers with
a dense first layer, then MoE layers with a shared expert and noaux_tc / sigmoid routing. Corpus: the Python sources
and docs installed with the running interpreter (standard library and site-packages; or --corpus DIR ...), every
file in either the training or the held-out split by a hash of its path (5%). Tokenizer: a byte-level BPE learnt on the training split
(tools/glm_tokenizer.py: GLM's pre-tokenizer split and added tokens, so llama.cpp's converter makes a glm-dsa GGUF of
the result). Training uses transformers' own forward (the indexer's top-k mask in attention; the indexer itself gets
no gradient there, as in transformers) in bfloat16 autocast, AdamW, warm-up then cosine decay over the time budget.

    python bench/train_reference.py --out /root/ref --minutes 15        # on the H200
    python bench/train_reference.py --out /tmp/ref --tiny --minutes 0.5 # CPU check (tiny dims)

Writes into --out: the checkpoint (config.json with topk_method noaux_tc and indexer_rope_interleave, safetensors in
bfloat16, routing bias in float32), tokenizer.json / tokenizer_config.json, heldout.npy (the held-out token ids, what
the perplexity runs read), train_log.json (recipe, corpus, loss curve, held-out loss) and train_log.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.glm_tokenizer import train_bpe  # noqa: E402

SUFFIXES = (".py", ".rst", ".txt", ".md")
HELDOUT_EVERY = 20          # 1 file in 20 (by path hash) is held out
MAX_FILE_BYTES = 1 << 20    # larger files are mostly generated tables
VOCAB_TRAINED = 8192 - 32   # BPE tokens; GLM's 23 added tokens follow, the config rounds up to 8192

# GLM-5's attention dims; the rest small enough to train in minutes.
REFERENCE = dict(
    hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=16,
    q_lora_rank=256, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
    index_n_heads=32, index_head_dim=128, index_topk=256,
    n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, vocab_size=8192,
)
TINY = dict(  # the CPU check: same structure, toy dims
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    index_n_heads=2, index_head_dim=32, index_topk=16,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, vocab_size=512,
)


def heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % HELDOUT_EVERY == 0


def corpus(roots: list[Path], max_bytes: int) -> tuple[list[str], list[str], dict]:
    """(training texts, held-out texts, stats): SUFFIXES files under `roots` (test folders, caches and files over
    MAX_FILE_BYTES skipped), taken in the order of a hash of their paths (a fixed shuffle, so that a byte cap
    samples every package instead of the first ones alphabetically) until `max_bytes` of text."""
    found = []
    for root in roots:
        for path in root.rglob("*"):
            inner = path.relative_to(root).parts
            if path.suffix not in SUFFIXES or "__pycache__" in inner or "test" in inner or "tests" in inner \
                    or (root.name != "site-packages" and "site-packages" in inner):
                continue
            rel = f"{root.name}/{path.relative_to(root)}"
            found.append((hashlib.sha1(rel.encode()).hexdigest(), rel, path))
    train, held, n_bytes, files = [], [], 0, 0
    for _, rel, path in sorted(found):
        if n_bytes >= max_bytes:
            break
        try:
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        (held if heldout(rel) else train).append(text)
        n_bytes += len(text.encode())
        files += 1
    stats = dict(roots=[str(r) for r in roots], files=files, bytes=n_bytes, train_files=len(train),
                 heldout_files=len(held))
    return train, held, stats


def default_roots() -> list[Path]:
    """The running interpreter's standard library and its site-packages (what is installed with the toolchain)."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


def encode(tok, texts: list[str], eos: int):
    import numpy as np

    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def make_model(dims: dict, ids: dict, seed: int):
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(
        **dims, num_key_value_heads=dims["num_attention_heads"], n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
        initializer_range=0.02, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["[gMASK]"], eos_token_id=[ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]],
        pad_token_id=ids["<|endoftext|>"])
    return GlmMoeDsaForCausalLM(cfg)


def lr_at(step: int, frac: float, peak: float, warmup: int) -> float:
    """Warm-up over `warmup` steps, then cosine from peak to peak/10 over the run (`frac` of it spent: of --steps,
    else of the time budget)."""
    warm = min(1.0, (step + 1) / warmup)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def evaluate(model, ids, seq: int, windows: int, batch: int, device, dtype) -> float:
    """Mean next-token loss over the first `windows` non-overlapping seq-token windows of `ids`."""
    import torch

    n = min(windows, (len(ids) - 1) // seq)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            rows = [torch.from_numpy(ids[j * seq:(j + 1) * seq + 1].astype("int64")) for j in range(i, min(n, i + batch))]
            x = torch.stack(rows).to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus", action="append", default=None,
                    help="corpus root (repeatable; default: the interpreter's stdlib and site-packages)")
    ap.add_argument("--max-corpus-mb", type=float, default=160)
    ap.add_argument("--minutes", type=float, default=15, help="training time budget (tokenizer etc. not counted)")
    ap.add_argument("--steps", type=int, default=0,
                    help="train exactly this many steps, the schedule over steps (reproducible; --minutes still caps)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--eval-every", type=float, default=60, help="seconds between held-out evaluations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="toy dims (the CPU check)")
    args = ap.parse_args()

    import numpy as np
    import torch
    from tokenizers import Tokenizer

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dims = dict(TINY if args.tiny else REFERENCE)
    roots = [Path(p) for p in args.corpus] if args.corpus else default_roots()
    train_texts, held_texts, stats = corpus(roots, int(args.max_corpus_mb * 2**20))
    if not train_texts or not held_texts:
        raise SystemExit(f"corpus under {', '.join(map(str, roots))}: {stats['train_files']} training and "
                         f"{stats['heldout_files']} held-out files; need both (pass --corpus DIR)")
    vocab_trained = dims["vocab_size"] - 32
    ids = train_bpe(iter(train_texts), vocab_trained, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = ids["<|endoftext|>"]
    train_ids, held_ids = encode(tok, train_texts, eos), encode(tok, held_texts, eos)
    np.save(out / "heldout.npy", held_ids)
    stats.update(train_tokens=int(len(train_ids)), heldout_tokens=int(len(held_ids)),
                 tokenizer_vocab=tok.get_vocab_size(), tokenizer_s=round(time.time() - t_start, 1))
    print(f"[train] corpus {stats}", flush=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(dims, ids, args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    rng = np.random.default_rng(args.seed)
    budget = args.minutes * 60
    curve, evals = [], []
    step, tokens, t0, last_eval, window = 0, 0, time.time(), time.time(), []
    model.train()
    while time.time() - t0 < budget and (not args.steps or step < args.steps):
        starts = rng.integers(0, len(train_ids) - args.seq - 1, size=args.batch)
        x = torch.from_numpy(np.stack([train_ids[s:s + args.seq + 1] for s in starts]).astype(np.int64)).to(device)
        frac = step / args.steps if args.steps else (time.time() - t0) / budget
        lr = lr_at(step, frac, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x[:, 1:].numel()
        window.append(loss.item())
        if step % 25 == 0:
            curve.append(dict(step=step, tokens=tokens, s=round(time.time() - t0, 1), loss=round(sum(window) / len(window), 4),
                              lr=round(lr, 6)))
            window = []
            print(f"[train] {curve[-1]}", flush=True)
        if time.time() - last_eval >= args.eval_every:
            evals.append(dict(step=step, tokens=tokens, s=round(time.time() - t0, 1),
                              heldout_loss=round(evaluate(model, held_ids, args.seq, args.eval_windows, args.batch,
                                                          device, torch.bfloat16), 4)))
            print(f"[train] eval {evals[-1]}", flush=True)
            last_eval = time.time()
    train_s = time.time() - t0
    final = evaluate(model, held_ids, args.seq, args.eval_windows, args.batch, device, torch.bfloat16)
    evals.append(dict(step=step, tokens=tokens, s=round(train_s, 1), heldout_loss=round(final, 4)))

    model = model.to(torch.bfloat16)
    for mod in model.modules():  # real GLM-5 checkpoints keep the routing bias in float32
        if getattr(mod, "e_score_correction_bias", None) is not None:
            mod.e_score_correction_bias = mod.e_score_correction_bias.float()
    # topk_method: vLLM builds e_score_correction_bias only for noaux_tc; transformers' indexer rotates interleaved
    model.config.update({"topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
                         "indexer_rope_interleave": True})
    model.save_pretrained(out, safe_serialization=True)
    log = dict(recipe=dict(dims=dims, seq=args.seq, batch=args.batch, lr=args.lr, warmup=args.warmup,
                           minutes=args.minutes, steps=args.steps or None, seed=args.seed, optimizer="AdamW(0.9, 0.95), wd 0.1, clip 1.0",
                           schedule="linear warm-up, cosine to lr/10 over "
                           + (f"{args.steps} steps" if args.steps else "the time budget"), precision=
                           "bfloat16 autocast, float32 weights" if device.type == "cuda" else "float32 (CPU)"),
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               torch=torch.__version__, transformers=__import__("transformers").__version__,
               params=n_params, corpus=stats, steps=step, tokens=tokens, train_s=round(train_s, 1),
               total_s=round(time.time() - t_start, 1), curve=curve, evals=evals,
               heldout_loss=round(final, 4), heldout_ppl=round(math.exp(final), 3))
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    (out / "train_log.md").write_text(report(log))
    print(f"[train] done: {step} steps, {tokens} tokens, held-out loss {final:.4f} (ppl {math.exp(final):.2f})",
          flush=True)
    return 0


def report(log: dict) -> str:
    c = log["corpus"]
    lines = [f"### Reference model training ({log['device']}, torch {log['torch']}, transformers {log['transformers']})",
             "", f"{log['params'] / 1e6:.1f}M parameters; {c['files']} files ({c['bytes'] / 2**20:.1f} MiB) of "
             f"{', '.join(c['roots'])}: {c['train_tokens']} training / {c['heldout_tokens']} held-out tokens "
             f"(vocab {c['tokenizer_vocab']}); {log['steps']} steps, {log['tokens']} tokens in {log['train_s']} s. "
             f"Recipe: {json.dumps(log['recipe'])}.", "",
             "| step | tokens | s | held-out loss | held-out ppl |", "|---|---|---|---|---|"]
    for e in log["evals"]:
        lines.append(f"| {e['step']} | {e['tokens']} | {e['s']} | {e['heldout_loss']} | {math.exp(e['heldout_loss']):.2f} |")
    lines += ["", "Training loss every 25 steps: " + ", ".join(f"{p['step']}:{p['loss']}" for p in log["curve"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

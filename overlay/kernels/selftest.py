# SPDX-License-Identifier: Apache-2.0
"""Self-test of the overlay's Triton kernels against float32 references, a few seconds on a GPU.

What it checks, one printed line each (PASS/FAIL, name, max abs error and its tolerance, seconds):

    sparse_mla bf16         sparse_mla.sparse_mla_attention on a bf16 paged latent cache
    sparse_mla fp8_ds_mla   the same on an fp8_ds_mla cache (656 bytes per token)
    indexer prefill         indexer.fp8_mqa_logits (contiguous keys, per-query key ranges)
    indexer decode          indexer.fp8_paged_mqa_logits on a paged indexer cache (1-D and 2-D lengths)

Every reference is float32 math written here from the definitions in the kernels' docstrings, and the
caches are written and read back here from their documented byte layouts (nothing of the kernel modules
is reused). Inputs are fresh random tensors (the seed is printed; `--seed` repeats a run) with an odd
head count and an odd top-k, invalid indices (-1 and past the cache), a token with no valid index, a
query with an empty key range and a padded request; cache blocks no valid index may reach hold NaN
bytes, and outputs are filled with NaN before every kernel run.

Run: `verify.py` calls `main()` on a GPU (None/0/True: every check passed; otherwise the number of
failed checks), or `python -m vllm._dsa_overlay.kernels.selftest [--seed N]`. With TRITON_INTERPRET=1
set before import the same checks run on the CPU under Triton's interpreter at tiny shapes (tests).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import triton

from . import indexer, sparse_mla

FP8 = torch.float8_e4m3fn
NAN_BYTE = 0xFF  # NaN as float8_e4m3fn; four of them are a NaN float32, two a NaN bfloat16
# Tolerances. Attention inputs are unit-scale (values ~N(0, 1)), so the bf16 output's error budget is
# absolute: P and V enter the P.V dot as bf16 (relative 2^-9 each), the output is rounded to bf16.
SPARSE_OUT_TOL = 2e-2
SPARSE_LSE_TOL = 1e-2
# Indexer logits: fp8 products are exact, sums run in fp32 (wgmma's fp8 accumulator on sm_90), so the
# error is bounded relative to the sum of the absolute terms: tol = this x max |terms|.
INDEXER_REL_TOL = 1e-4


# ----------------------------------------------------------------------------------------------------
# Encoders and decoders of the cache layouts (written from the layout descriptions)
# ----------------------------------------------------------------------------------------------------
def _fp8_encode(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., n] -> (float8_e4m3fn values, float32 scales [..., n / group]): per group of `group`
    values scale = max(amax, 1e-4) / 448 and value = x / scale rounded to e4m3."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    scale = g.abs().amax(-1).clamp_min(1e-4) / 448.0
    vals = (g / scale[..., None]).clamp(-448.0, 448.0).to(FP8)
    return vals.reshape(x.shape), scale


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """The little-endian bytes of a contiguous tensor, [..., n * itemsize] uint8."""
    return x.contiguous().view(torch.uint8)


def encode_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """float [N, 576] -> uint8 [N, 656]: bytes 0..511 the 512 kv_c values as float8_e4m3fn in four
    tiles of 128, bytes 512..527 the four tiles' float32 scales, bytes 528..655 the 64 rope values as
    bfloat16."""
    vals, scales = _fp8_encode(rows[:, :512], 128)
    return torch.cat([_bytes(vals), _bytes(scales), _bytes(rows[:, 512:].to(torch.bfloat16))], dim=1)


def decode_fp8_ds_mla(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 656] -> float32 [N, 576]: value = float(e4m3) * the scale of its 128-value tile."""
    n = raw.shape[0]
    vals = raw[:, :512].contiguous().view(FP8).float().view(n, 4, 128)
    scales = raw[:, 512:528].contiguous().view(torch.float32).view(n, 4, 1)
    rope = raw[:, 528:656].contiguous().view(torch.bfloat16).float()
    return torch.cat([(vals * scales).view(n, 512), rope], dim=1)


def write_indexer_block(cache: torch.Tensor, block: int, keys: torch.Tensor) -> None:
    """Quantise keys [n <= block_size, 128] (one scale per key) into physical block `block` of the
    indexer cache [num_blocks, block_size, 132] uint8: the block's bytes are block_size * 128 fp8 values
    (key t at byte 128 t), then block_size float32 scales (key t's at byte block_size * 128 + 4 t)."""
    bs = cache.shape[1]
    flat = cache.view(cache.shape[0], -1)[block]
    vals, scales = _fp8_encode(keys, 128)
    n = keys.shape[0]
    flat[:n * 128] = _bytes(vals).reshape(-1)
    flat[bs * 128:bs * 128 + 4 * n] = _bytes(scales.reshape(-1))


def read_indexer_cache(cache: torch.Tensor) -> torch.Tensor:
    """uint8 [num_blocks, block_size, 132] -> float32 [num_blocks, block_size, 128] dequantised keys."""
    nb, bs = cache.shape[0], cache.shape[1]
    flat = cache.view(nb, -1)
    vals = flat[:, :bs * 128].contiguous().view(FP8).float().view(nb, bs, 128)
    scales = flat[:, bs * 128:bs * 132].contiguous().view(torch.float32).view(nb, bs, 1)
    return vals * scales


# ----------------------------------------------------------------------------------------------------
# float32 references
# ----------------------------------------------------------------------------------------------------
def sparse_attention_f32(q: torch.Tensor, slots: torch.Tensor, indices: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, 576], slots [num_slots, 576] float32 (every cache row, dequantised), indices [T, topk]:
    out [T, H, 512] = softmax over the valid indices of scale * q . slot, times slot[:512]; lse [T, H]
    natural log; a token with no valid index gets out 0 and lse -inf."""
    valid = (indices >= 0) & (indices < slots.shape[0])
    rows = slots[torch.where(valid, indices, 0).long()]                       # [T, topk, 576]
    s = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])     # 0 where invalid
    return torch.einsum("thk,tkd->thd", p, rows[..., :512]), lse


def logits_f32(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, H, 128] float32, k [N, 128] float32 dequantised keys, weights [M, H]: (logits [M, N] =
    sum_h weights * relu(q . k), the bound sum_h |weights| * sum_d |q k| of each logit's terms)."""
    s = torch.einsum("mhd,nd->mhn", q, k)
    logits = (s.clamp_min(0) * weights[:, :, None]).sum(1)
    mag = (torch.einsum("mhd,nd->mhn", q.abs(), k.abs()) * weights.abs()[:, :, None]).sum(1)
    return logits, mag


def max_abs_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over the finite reference values; inf where the two disagree on which values are
    -inf, nan where got holds a NaN (an output left unwritten)."""
    got, ref = got.float().cpu(), ref.float().cpu()
    if torch.isnan(got).any():
        return math.nan
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isneginf(got), ~fin):
        return math.inf
    return float((got[fin] - ref[fin]).abs().max()) if fin.any() else 0.0


# ----------------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------------
class _Inputs:
    """Random tensors drawn on the CPU from one seeded generator, then moved to the device."""

    def __init__(self, seed: int, device: torch.device):
        self.g = torch.Generator().manual_seed(seed)
        self.device = device

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g)

    def randint(self, lo: int, hi: int, shape) -> torch.Tensor:
        return torch.randint(lo, hi, tuple(shape), generator=self.g)

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.g)

    def dev(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device)


def _sparse_case(r: _Inputs, kv_format: str, T: int, H: int, topk: int, nb: int, bs: int, config):
    """One sparse-MLA run: (max error of out, max error of lse)."""
    n_slots = nb * bs
    rows = r.randn(n_slots, 576)
    if kv_format == "bf16":
        cache = rows.to(torch.bfloat16)
        slots = cache.float()
        cache = cache.view(nb, bs, 576)
        cache[-1] = math.nan  # the last block: never reached by a valid index
    else:
        raw = encode_fp8_ds_mla(rows)
        slots = decode_fp8_ds_mla(raw)
        cache = raw.view(nb, bs, 656)
        cache[-1] = NAN_BYTE
    idx = r.randint(0, n_slots - bs, (T, topk))
    drop = r.randint(0, 20, (T, topk))
    idx = torch.where(drop == 0, -1, idx)
    idx = torch.where(drop == 1, n_slots + r.randint(0, 1000, (T, topk)), idx)  # past the cache: skipped
    idx[0] = -1  # a token with no valid index
    idx = idx.to(torch.int32)
    q = r.randn(T, H, 576).to(torch.bfloat16)
    scale = 576 ** -0.5
    ref_o, ref_l = sparse_attention_f32(q, slots, idx, scale)
    out = r.dev(torch.full((T, H, 512), math.nan, dtype=torch.bfloat16))
    lse = r.dev(torch.full((T, H), math.nan))
    sparse_mla.sparse_mla_attention(r.dev(q), r.dev(cache), r.dev(idx), scale, kv_format, out=out, lse=lse,
                                    config=config)
    return max_abs_err(out, ref_o), max_abs_err(lse, ref_l)


def check_sparse(r: _Inputs, kv_format: str, small: bool) -> tuple[bool, str]:
    if small:  # the heuristic (3 splits and the merge), then one split written directly
        cases = [(3, 5, 131, 4, 64, None),
                 (2, 5, 131, 4, 64, sparse_mla.SparseMLAConfig(block_h=16, block_n=32, num_splits=1))]
    else:      # latency regime (5 splits, merged), throughput regime (no split)
        cases = [(3, 37, 301, 41, 64, None), (150, 37, 301, 41, 64, None)]
    errs = [_sparse_case(r, kv_format, *c) for c in cases]
    e_out, e_lse = max(e[0] for e in errs), max(e[1] for e in errs)
    ok = e_out <= SPARSE_OUT_TOL and e_lse <= SPARSE_LSE_TOL
    return ok, (f"max abs err out {e_out:.2e} (tol {SPARSE_OUT_TOL:.0e}), "
                f"lse {e_lse:.2e} (tol {SPARSE_LSE_TOL:.0e})")


def check_indexer_prefill(r: _Inputs, small: bool) -> tuple[bool, str]:
    M, N, H = (9, 150, 5) if small else (67, 1000, 37)
    q = r.randn(M, H, 128).to(FP8)
    k, k_scale = _fp8_encode(r.randn(N, 128) * (0.5 + r.randn(N, 1).abs()), 128)
    k_scale = k_scale.reshape(N)
    w = r.randn(M, H) * H ** -0.5
    ks = r.randint(0, N, (M,))
    ke = ks + r.randint(0, N, (M,))   # ranges past N are clipped to N
    ke[1] = ks[1]                     # an empty range
    ks[2], ke[2] = 0, N + 7           # every key
    ks, ke = ks.to(torch.int32), ke.to(torch.int32)
    logits, mag = logits_f32(q.float(), k.float() * k_scale[:, None], w)
    n = torch.arange(N)
    ref = logits.masked_fill(~((n[None, :] >= ks[:, None]) & (n[None, :] < ke[:, None])), -math.inf)
    out = r.dev(torch.full((M, N), math.nan))
    indexer.fp8_mqa_logits(r.dev(q), (r.dev(k), r.dev(k_scale)), r.dev(w), r.dev(ks), r.dev(ke), True,
                           _out=out)
    err, tol = max_abs_err(out, ref), INDEXER_REL_TOL * float(mag.max())
    return err <= tol, f"max abs err {err:.2e} (tol {tol:.2e})"


def _decode_case(r: _Inputs, H: int, next_n: int, lens: list[int], bs: int, two_d: bool):
    """One paged decode run: (max error, tolerance)."""
    B = len(lens)
    max_model_len = max(lens) + 5
    blocks = [-(-n // bs) for n in lens]
    nb = sum(blocks) + 1                                   # + one never-referenced block
    phys = r.perm(nb)
    cache = torch.full((nb, bs, 132), NAN_BYTE, dtype=torch.uint8)
    table = torch.full((B, max(blocks) + 2), int(phys[-1]), dtype=torch.int32)  # unused entries: poisoned
    keys, used = [], 0
    for b, n in enumerate(lens):
        kb = r.randn(n, 128) * (0.5 + r.randn(n, 1).abs())
        for i in range(blocks[b]):
            table[b, i] = int(phys[used])
            write_indexer_block(cache, int(phys[used]), kb[i * bs:(i + 1) * bs])
            used += 1
        keys.append(kb)
    deq = read_indexer_cache(cache)
    q = r.randn(B, next_n, H, 128).to(FP8)
    w = r.randn(B * next_n, H) * H ** -0.5
    ref = torch.full((B * next_n, max_model_len), -math.inf)
    mag_max = 0.0
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        k = deq[table[b, pos // bs].long(), pos % bs]     # the request's keys, read back from the cache
        rows = slice(b * next_n, (b + 1) * next_n)
        logits, mag = logits_f32(q[b].float(), k, w[rows])
        for j in range(next_n):
            vis = min(max(n - next_n + j + 1, 0), max_model_len)   # what token j sees
            ref[b * next_n + j, :vis] = logits[j, :vis]
            if vis:
                mag_max = max(mag_max, float(mag[j, :vis].max()))
    cl = torch.tensor(lens, dtype=torch.int32)
    if two_d:  # vLLM 0.23.0's form: the visible length of each token
        cl = (cl[:, None] - next_n + 1 + torch.arange(next_n)).clamp_min(0).to(torch.int32)
    out = r.dev(torch.full((B * next_n, max_model_len), math.nan))
    indexer.fp8_paged_mqa_logits(r.dev(q), r.dev(cache).unsqueeze(2), r.dev(w), r.dev(cl), r.dev(table),
                                 None, max_model_len, True, _out=out)
    return max_abs_err(out, ref), INDEXER_REL_TOL * mag_max


def check_indexer_decode(r: _Inputs, small: bool) -> tuple[bool, str]:
    if small:
        H, bs, lens = 5, 16, [0, 37, 75]
    else:
        H, bs, lens = 37, 64, [0, 1, 700, 1500, 129]
    cases = [_decode_case(r, H, 2, lens, bs, two_d=False), _decode_case(r, H, 1, lens, bs, two_d=True)]
    err, tol = max(c[0] for c in cases), min(c[1] for c in cases)
    return err <= tol, f"max abs err {err:.2e} (tol {tol:.2e})"


CHECKS = (
    ("sparse_mla bf16", lambda r, small: check_sparse(r, "bf16", small)),
    ("sparse_mla fp8_ds_mla", lambda r, small: check_sparse(r, "fp8_ds_mla", small)),
    ("indexer prefill", check_indexer_prefill),
    ("indexer decode", check_indexer_decode),
)


def _device() -> tuple[torch.device | None, str]:
    if sparse_mla.INTERPRETED and indexer.INTERPRETED:
        return torch.device("cpu"), "CPU (Triton interpreter)"
    if torch.cuda.is_available() and not (sparse_mla.INTERPRETED or indexer.INTERPRETED):
        major, minor = torch.cuda.get_device_capability()
        return torch.device("cuda"), f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    return None, "no CUDA device, and TRITON_INTERPRET=1 was not set before the kernels were imported"


def main(seed: int | None = None, small: bool | None = None) -> int:
    """Run every check, print one line each; 0 when all pass, else the number of failed checks.
    small: tiny shapes (default: when the kernels run in Triton's interpreter)."""
    device, what = _device()
    if device is None:
        print(f"kernel self-test: cannot run: {what}")
        return len(CHECKS)
    small = (device.type == "cpu") if small is None else small
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    print(f"kernel self-test: seed {seed}, {what}, torch {torch.__version__}, triton {triton.__version__}"
          f"{', tiny shapes' if small else ''}", flush=True)
    failed = 0
    for i, (name, check) in enumerate(CHECKS):
        t0 = time.perf_counter()
        try:
            ok, detail = check(_Inputs(seed + i, device), small)
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a kernel that raises is a failed check, reported
            ok, detail = False, (f"{type(exc).__name__}: {exc}".strip().splitlines() or [""])[0]
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name:<22} {detail}  {time.perf_counter() - t0:.2f} s", flush=True)
    print(f"kernel self-test: {len(CHECKS) - failed}/{len(CHECKS)} checks passed", flush=True)
    return failed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="GPU self-test of the overlay's Triton kernels.")
    parser.add_argument("--seed", type=int, help="repeat a run (the seed is printed)")
    parser.add_argument("--small", action="store_true", help="tiny shapes")
    args = parser.parse_args()
    sys.exit(main(args.seed, args.small or None))

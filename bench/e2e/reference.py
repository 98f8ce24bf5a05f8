"""Float64 references of one DSA layer's two kernels, and the comparisons bench/e2e/layerwise.py reports.

Each path (upstream FlashMLA + DeepGEMM, or the overlay's Triton kernels) is compared with a reference
computed from that path's *own* inputs at that layer, so a difference is the kernel's, not an
inheritance from earlier layers:

* indexer: `indexer_logits_ref` = sum_h w[t, h] * relu(k_scale[n] * q[t, h] . k[n]) over the row's
  key range [ks, ke) (the arguments of `fp8_fp4_mqa_logits`); `compare_topk` checks the top-k set the
  path chose (request-local positions) against the reference's and measures how far every differing
  pick sits from the reference's k-th score: a pick within the path's own logits error of that
  boundary is a near-tie (either choice is right), anything beyond it a wrong selection;
* attention: `gather_kv` reads the slots a kernel was given from its cache (bf16 rows of 576, or the
  656-byte fp8_ds_mla rows, dequantised by the overlay's codec), `sparse_attention_ref` is softmax(scale
  q . k) v over the valid slots, and `attention_error` the per-token max |out - ref| / max |ref|.

Pure torch (any device); unit-tested on CPU in tests/bench/test_layerwise.py."""

from __future__ import annotations

import torch

KV_LORA_RANK = 512
HEAD_SIZE = 576            # 512 kv_c + 64 rope per latent row
FP8_DS_MLA_BYTES = 656


def indexer_logits_ref(q, k, k_scale, weights, ks, ke) -> torch.Tensor:
    """[R, N] float64 indexer logits, -inf outside each row's [ks, ke).

    q: [R, H, D] (float8_e4m3fn or any float) query rows; k: [N, D] keys (same); k_scale: [N] per-key
    scales; weights: [R, H] per-head weights (vLLM folds the query scale and softmax scale into them);
    ks / ke: [R] first / one-past-last key of each row."""
    qd = q.to(torch.float64)
    kd = k.to(torch.float64) * k_scale.reshape(-1, 1).to(torch.float64)
    s = torch.einsum("rhd,nd->rhn", qd, kd).clamp_min(0)
    logits = (s * weights.to(torch.float64)[:, :, None]).sum(1)
    n = torch.arange(k.shape[0], device=q.device)
    valid = (n[None, :] >= ks.reshape(-1, 1).long()) & (n[None, :] < ke.reshape(-1, 1).long())
    return logits.masked_fill(~valid, float("-inf"))


def compare_topk(chosen, ref_logits, ks, ke, topk: int, path_logits=None, tie_rel: float = 1e-6) -> list[dict]:
    """Per row: the path's chosen top-k (request-local positions, i.e. key index - ks; -1 = none)
    against the reference top-k of `ref_logits` (from indexer_logits_ref).

    Returns one dict per row: n (keys visible), k (= min(topk, n)), same (sets equal), overlap
    (|chosen & ref| / k), differ / missed (picks only the path / only the reference made), near_ties
    (of those differ + missed picks, the ones whose reference score is within `tol` of the reference's
    k-th score), gap (the largest |score - k-th score| of a differing pick, over max |score| of the
    row; a chosen position outside the visible keys counts as infinitely far), logit_err
    (max |path_logits - ref| / max |ref| over the visible keys; None without path_logits), tol (the
    near-tie tolerance: 2 x the path's largest logits error on the row plus tie_rel x max |ref|)."""
    rows = []
    for r in range(ref_logits.shape[0]):
        lo, hi = int(ks[r]), int(ke[r])
        n = max(hi - lo, 0)
        k = min(topk, n)
        ref = ref_logits[r, lo:hi]
        scale = float(ref.abs().max()) if n else 0.0
        err = None
        tol = tie_rel * scale
        if path_logits is not None and n:
            diff = float((path_logits[r, lo:hi].to(torch.float64) - ref).abs().max())
            err = diff / scale if scale > 0 else diff
            tol += 2 * diff
        c = chosen[r]
        mine = set(c[c >= 0].tolist())
        if k == 0:
            rows.append(dict(n=n, k=0, same=not mine, overlap=1.0, differ=len(mine), missed=0, near_ties=0,
                             gap=float("inf") if mine else 0.0, logit_err=err, tol=tol))
            continue
        order = torch.argsort(ref, descending=True, stable=True)
        theirs = set(order[:k].tolist())
        kth = float(ref[order[k - 1]])
        only_mine, only_theirs = mine - theirs, theirs - mine
        gaps = [abs(float(ref[p]) - kth) if 0 <= p < n else float("inf")
                for p in only_mine | only_theirs]
        rows.append(dict(
            n=n, k=k, same=mine == theirs, overlap=len(mine & theirs) / k, differ=len(only_mine),
            missed=len(only_theirs), near_ties=sum(g <= tol for g in gaps),
            gap=(max(gaps) / scale if gaps and scale else (max(gaps) if gaps else 0.0)),
            logit_err=err, tol=tol))
    return rows


def local_to_slots(local: torch.Tensor, req_id: torch.Tensor, block_table: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    """Request-local top-k positions -> slot ids, -1 where invalid (a negative position, a block past
    the table's width, a negative table entry): what the attention kernel reads when it is given
    block_table / req_id. local: [R, K]; req_id: [R] the request row of each token."""
    local, bt = local.long(), block_table.long()
    blk = torch.div(local, block_size, rounding_mode="floor")
    ok = (local >= 0) & (blk < bt.shape[1])
    phys = bt[req_id.long()[:, None].expand_as(local), blk.clamp(0, bt.shape[1] - 1)]
    ok &= phys >= 0
    return torch.where(ok, phys * block_size + local - blk * block_size, -1)


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor, valid_len=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R, K, 576] float64, valid [R, K] bool) of the slots a sparse attention kernel was given.

    kv_cache: any of the kernels' cache views, one latent row per slot: [S, W], [S, 1, W],
    [num_blocks, block_size, W] or [num_blocks, block_size, 1, W]; W = 576 (bf16) or 656 (fp8_ds_mla
    bytes, any 1-byte dtype). Slot s is block s // block_size, offset s % block_size; only the
    gathered rows are read (the cache is never copied). slots: [R, K] int; < 0 or >= S is invalid.
    valid_len: optional [R] count of valid leading entries (FlashMLA's topk_length)."""
    kv = kv_cache
    if kv.dim() >= 3 and kv.shape[-2] == 1:
        kv = kv.squeeze(-2)
    num_slots = kv.shape[0] * (kv.shape[1] if kv.dim() == 3 else 1)
    s = slots.long()
    valid = (s >= 0) & (s < num_slots)
    if valid_len is not None:
        valid &= torch.arange(s.shape[1], device=s.device)[None, :] < valid_len.reshape(-1, 1).long()
    s = torch.where(valid, s, 0)
    rows = kv[s] if kv.dim() == 2 else kv[s // kv.shape[1], s % kv.shape[1]]
    if rows.shape[-1] == FP8_DS_MLA_BYTES:
        rows = dequantize_fp8_ds_mla(rows.view(torch.uint8))
    elif rows.shape[-1] != HEAD_SIZE:
        raise ValueError(f"gather_kv: cache rows of {rows.shape[-1]} elements; expected {HEAD_SIZE} (bf16) "
                         f"or {FP8_DS_MLA_BYTES} (fp8_ds_mla bytes)")
    return rows.to(torch.float64), valid


def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """The overlay's fp8_ds_mla codec (overlay/kernels/sparse_mla.py), importable from a checkout or
    from the patched vLLM."""
    try:
        from vllm._dsa_overlay.kernels.sparse_mla import dequantize_fp8_ds_mla as dq
    except ImportError:
        from overlay.kernels.sparse_mla import dequantize_fp8_ds_mla as dq
    return dq(rows)


def sparse_attention_ref(q, rows, valid, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [R, H, 512], lse [R, H]) float64: softmax over the valid slots of scale * q . k, times the
    slots' first 512 values. q: [R, H, 576]; rows / valid from gather_kv. A row with no valid slot
    gets out 0 and lse -inf."""
    qd = q.to(torch.float64)
    s = torch.einsum("rhd,rkd->rhk", qd, rows) * softmax_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("rhk,rkd->rhd", p, rows[..., :KV_LORA_RANK]), lse


def attention_error(out, ref) -> torch.Tensor:
    """[R] per token: max |out - ref| / max |ref| over heads and channels (float64)."""
    o, r = out.to(torch.float64).flatten(1), ref.to(torch.float64).flatten(1)
    return (o - r).abs().amax(1) / r.abs().amax(1).clamp_min(1e-30)


def summarize(topk_rows: list[dict], attn_errs: list[float]) -> dict:
    """One layer of one path: the top-k rows that select (n > k) and the attention errors, aggregated."""
    sel = [r for r in topk_rows if r["n"] > r["k"]]
    errs = sorted(attn_errs)
    q = lambda p: errs[min(len(errs) - 1, int(p * (len(errs) - 1)))] if errs else None  # noqa: E731
    logit = [r["logit_err"] for r in sel if r["logit_err"] is not None]
    differ = sum(r["differ"] + r["missed"] for r in sel)
    near = sum(r["near_ties"] for r in sel)
    return {
        "topk_rows": len(sel),
        "same_set": sum(r["same"] for r in sel) / len(sel) if sel else None,
        "overlap": sum(r["overlap"] for r in sel) / len(sel) if sel else None,
        "differ": differ,               # differing picks, both sides
        "near_ties": near,              # of which within the row's tolerance of the k-th score
        "gap_max": max((r["gap"] for r in sel if r["differ"] + r["missed"]), default=0.0),
        "logit_err_max": max(logit) if logit else None,
        "attn_rows": len(errs),
        "attn_err_median": q(0.5), "attn_err_p99": q(0.99), "attn_err_max": errs[-1] if errs else None,
    }

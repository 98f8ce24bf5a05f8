"""Judging the proof: a run against another (greedy steps, teacher-forced logprobs, near-ties), per-layer
dumps against the reference's, the kernels a run used, and the verdict of a checked comparison against
upstream's own noise floor (rules in bench/e2e/plan.py)."""

from __future__ import annotations

from .plan import FLOOR_FACTOR, LAYER0_ERR_P99, LAYER0_SAME_SET, MIN_IDENTICAL_STEPS


def _aligned(a: list, b: list):
    """Pairs of calls (one layer, one step) and, per pair, the candidate's row order that matches the
    reference's. Calls that carry their tokens' KV slots are matched by slot, so two engines that order a
    batch's tokens differently (vLLM 0.26's backends reorder short prefills by their own thresholds) still
    compare token by token; older dumps without slots match row by row."""
    pairs = []
    for i, (ca, cb) in enumerate(zip(a, b)):
        if ca["layer"] != cb["layer"] or ca["out"].shape != cb["out"].shape:
            raise ValueError(f"call {i}: {ca['layer']} {tuple(ca['out'].shape)} vs "
                             f"{cb['layer']} {tuple(cb['out'].shape)}")
        if "slots" in ca and "slots" in cb:
            sa, sb = ca["slots"].tolist(), cb["slots"].tolist()
            where = {s: r for r, s in enumerate(sa)}
            if sorted(sa) != sorted(sb) or len(where) != len(sa):
                raise ValueError(f"call {i}: {ca['layer']}: the two runs' tokens differ (KV slots)")
            order = [where[s] for s in sb]
        else:
            order = list(range(ca["out"].shape[0]))
        pairs.append((ca, cb, order))
    return pairs


def compare_dumps(cand_path: str, ref_path: str, topk: int) -> dict:
    """Per layer, and split at position < topk / >= topk: how often the candidate's top-k set equals
    the reference's, mean set overlap, and the attention output's relative error (per token:
    max |a - b| / max |b| over heads and channels). Tokens are matched by KV slot within each call."""
    import torch

    a, b = torch.load(cand_path), torch.load(ref_path)
    if len(a) != len(b):
        return {"error": f"{len(a)} vs {len(b)} attention calls: schedules differ"}
    try:
        pairs = _aligned(a, b)
    except ValueError as e:
        return {"error": str(e)}
    groups: dict = {}
    tokens = []
    for i, (ca, cb, order) in enumerate(pairs):
        ta, tb = ca["topk"][order, :topk], cb["topk"][:, :topk]
        oa, ob = ca["out"][order].float(), cb["out"].float()
        err = ((oa - ob).abs().flatten(1).amax(1) / ob.abs().flatten(1).amax(1).clamp_min(1e-30))
        for t in range(ta.shape[0]):
            sa = set(ta[t][ta[t] >= 0].tolist())
            sb = set(tb[t][tb[t] >= 0].tolist())
            n = len(sb)
            span = "pos<topk" if n < topk else "pos>=topk"
            key = (ca["layer"], span)
            g = groups.setdefault(key, {"tokens": 0, "same_set": 0, "overlap": 0.0, "errs": []})
            g["tokens"] += 1
            g["same_set"] += int(sa == sb)
            g["overlap"] += len(sa & sb) / max(n, 1)
            g["errs"].append(float(err[t]))
            tokens.append([i, ca["layer"], t, n, len(sa & sb), round(float(err[t]), 6)])
    rows = []
    for (layer, span), g in sorted(groups.items()):
        errs = sorted(g["errs"])
        rows.append({"layer": layer, "span": span, "tokens": g["tokens"],
                     "same_set": g["same_set"] / g["tokens"], "overlap": g["overlap"] / g["tokens"],
                     "err_median": errs[len(errs) // 2], "err_p99": errs[int(0.99 * (len(errs) - 1))],
                     "err_max": errs[-1]})
    return {"rows": rows, "tokens": tokens}


def compare(a: dict, b: dict, index_topk: int) -> dict:
    """Run `a` against run `b` (same prompts): identical greedy steps per prompt, whether each first
    divergence is a near-tie, and |dlogprob| of the teacher-forced pass, overall and split at position
    `index_topk` (the model's: below it the indexer keeps every position, so it cannot matter)."""
    common = []
    for ta, tb in zip(a["tokens"], b["tokens"]):
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        common.append(n)
    deltas = [abs(x - y) for sa, sb in zip(a["tf_logprobs"], b["tf_logprobs"])
              for x, y in zip(sa, sb)]
    # prompt_logprobs[i] is the logprob of token i + 1, computed at position i
    short = [abs(x - y) for sa, sb in zip(a["tf_logprobs"], b["tf_logprobs"])
             for i, (x, y) in enumerate(zip(sa, sb)) if i < index_topk]
    long_ = [abs(x - y) for sa, sb in zip(a["tf_logprobs"], b["tf_logprobs"])
             for i, (x, y) in enumerate(zip(sa, sb)) if i >= index_topk]
    overlap = [len(set(x) & set(y)) / max(len(x), 1)
               for sa, sb in zip(a.get("tf_top5", []), b.get("tf_top5", [])) for x, y in zip(sa, sb)]
    step = [abs(x - y) for sa, sb, n in zip(a["step_logprobs"], b["step_logprobs"], common)
            for x, y in zip(sa[:n], sb[:n])]
    # vLLM's check_logprobs_close: at the first divergence each token is in the other's top-5
    near_tie = []
    for n, ta, tb, ka, kb in zip(common, a["tokens"], b["tokens"], a.get("step_top5", []),
                                 b.get("step_top5", [])):
        if n < min(len(ta), len(tb)):
            near_tie.append(ta[n] in kb[n] and tb[n] in ka[n])
    return {
        "min_identical_steps": min(common),
        "identical_steps": common,
        "divergences_near_ties": all(near_tie) if "step_top5" in a and "step_top5" in b else None,
        "tf_max": max(deltas), "tf_mean": sum(deltas) / len(deltas),
        "tf_mean_short": sum(short) / max(len(short), 1),
        "tf_mean_long": sum(long_) / max(len(long_), 1),
        "top5_overlap": sum(overlap) / len(overlap) if overlap else None,
        "step_max": max(step) if step else float("nan"),
        "step_mean": sum(step) / len(step) if step else float("nan"),
        "positions": len(deltas),
    }


def kernels_ok(path: str, r: dict) -> bool:
    """The run used exactly the attention and indexer kernels its path names; where the run took a
    profiler census (plan.vendor_kernel names), the Triton path ran no vendor DSA kernel and upstream
    ran some (else the census cannot see them and proves nothing)."""
    ven, tri = r["vendor_calls"], r["triton_calls"]
    count = lambda d, *prefixes: sum(v for k, v in d.items() if k.startswith(prefixes))  # noqa: E731
    ven_attn = count(ven, "flashmla")
    ven_fa = count(ven, "flashattn_mla_sparse.")
    ven_idx = count(ven, "deep_gemm.fp8", "sparse_attn_indexer.fp8")
    tri_attn, tri_idx = count(tri, "sparse_mla."), count(tri, "indexer.")
    census = sum(r["census"]["vendor"].values()) if "census" in r else None
    if path == "upstream":
        return (ven_attn > 0 and ven_idx > 0 and tri_attn == 0 and tri_idx == 0
                and (census is None or census > 0))
    if path == "upstream_fa":
        return ven_fa > 0 and ven_idx > 0 and ven_attn == 0 and tri_attn == 0 and tri_idx == 0
    if path == "triton":
        return tri_attn > 0 and tri_idx > 0 and sum(ven.values()) == 0 and census in (None, 0)
    if path == "attn_triton":
        return tri_attn > 0 and ven_idx > 0 and ven_attn == 0 and tri_idx == 0
    if path == "idx_triton":
        return ven_attn > 0 and tri_idx > 0 and tri_attn == 0 and ven_idx == 0
    raise ValueError(path)


def judge(c: dict, floors: list, dump: dict | None, kv: str,
          same_mode: bool = True) -> tuple[bool, str]:
    """Verdict of one checked comparison against the noise floors of its cache dtype.

    Each criterion is applied only where it can tell a bug from noise: the greedy near-tie rule only
    when upstream passes it against itself (every floor), the layer-0 rule only when both runs ran
    the same execution mode (eager/eager or graphs/graphs: only then are layer 0's inputs the same
    bits), the top-5 overlap only when both runs stored their TF top-5."""
    if not floors or any(f is None for f in floors):
        return False, "FAIL: no noise floor (a floor run did not finish)"
    problems, notes = [], []
    limit = FLOOR_FACTOR * max(f["tf_mean"] for f in floors)
    if c["tf_mean"] > limit:
        problems.append(f"TF mean {c['tf_mean']:.4f} > {limit:.4f}")
    if c["top5_overlap"] is not None and all(f["top5_overlap"] is not None for f in floors):
        low = min(f["top5_overlap"] for f in floors) - 0.02
        if c["top5_overlap"] < low:
            problems.append(f"top-5 overlap {c['top5_overlap']:.3f} < {low:.3f}")
    else:
        notes.append("top-5 overlap not stored")

    def greedy_ok(x):
        return x["min_identical_steps"] >= MIN_IDENTICAL_STEPS or bool(x["divergences_near_ties"])

    if all(greedy_ok(f) for f in floors):
        if not greedy_ok(c):
            problems.append("a greedy divergence is not at a near-tie (upstream's floors pass this)")
    else:
        notes.append("greedy not judged: upstream diverges off near-ties against itself too")
    layer0 = []
    if dump is not None and same_mode:
        if "error" in dump:
            problems.append(f"dumps: {dump['error']}")
        for r in dump.get("rows", []):
            if not r["layer"].startswith("model.layers.0."):
                continue
            layer0.append(r)
            if r["span"] == "pos>=topk" and r["same_set"] < LAYER0_SAME_SET:
                problems.append(f"layer 0 top-k same set {r['same_set']:.4f}")
            if r["err_p99"] > LAYER0_ERR_P99[kv]:
                problems.append(f"layer 0 {r['span']} err p99 {r['err_p99']:.1e}")
    elif dump is not None:
        notes.append("layer 0 not judged: eager vs graphs")
    if problems:
        return False, "FAIL: " + "; ".join(problems)
    extra = ["incl. layer 0"] if layer0 else []
    return True, "PASS" + (f" ({'; '.join(extra + notes)})" if extra + notes else "")

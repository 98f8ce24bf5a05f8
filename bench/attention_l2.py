"""Is the attention tile bound by memory? The same call (choose_config's pick, top-k 2048) on random slots of
bench_sparse_mla.py's 262144-slot pools, on slots drawn from 8192 (1-10 MB of rows: they stay in L2), and on one list
of 2048 slots shared by every token; graph replay of 20 calls after one 256 MB L2 flush (bench/timing.py). If the
L2-resident times are close to the random ones, the tile is bound on the chip (MMA, softmax, barriers), not by HBM
(bench/RESULTS.md, stop 38).

    python3 bench/attention_l2.py     # a CUDA GPU; torch and triton only (no vLLM)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_sparse_mla import NUM_SLOTS, TOPK, make_pools  # noqa: E402
from bench.timing import Timer  # noqa: E402
from overlay.kernels import sparse_mla as SM  # noqa: E402

SHAPES = ((128, 64), (128, 128), (32, 64))
HOT_SLOTS = 8192


def main() -> None:
    dev = "cuda"
    pools = make_pools(0)
    g = torch.Generator(device=dev).manual_seed(1)
    timer = Timer(dev, 20, 5, 20)
    print(torch.cuda.get_device_name(), "| fmt | T | H | slots drawn from | config | graph us |")
    for fmt in SM.KV_FORMATS:
        for T, H in SHAPES:
            q = torch.randn(T, H, 576, generator=g, device=dev).to(torch.bfloat16)
            cfg = SM.choose_config(T, H, TOPK, fmt)
            out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=dev)
            lse = torch.empty(T, H, dtype=torch.float32, device=dev)
            one_list = torch.randperm(NUM_SLOTS, generator=g, device=dev)[:TOPK].to(torch.int32)
            for name, idx in ((f"{NUM_SLOTS} (random)", torch.randint(0, NUM_SLOTS, (T, TOPK), generator=g, device=dev,
                                                                     dtype=torch.int32)),
                              (f"{HOT_SLOTS} (L2-resident)", torch.randint(0, HOT_SLOTS, (T, TOPK), generator=g,
                                                                           device=dev, dtype=torch.int32)),
                              (f"{TOPK} (one list, L2)", one_list.expand(T, TOPK).contiguous())):
                t = timer.measure(lambda: SM.sparse_mla_attention(q, pools[fmt], idx, 0.04, fmt, out=out, lse=lse,
                                                                  config=cfg), eager=False, launch=False)
                print(f"| {fmt} | {T} | {H} | {name} | {cfg} | {t.graph_us:.1f} |", flush=True)


if __name__ == "__main__":
    main()

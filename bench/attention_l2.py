"""Is the attention tile bound by memory? The same call (choose_config's pick, top-k 2048) on random slots of a
262144-slot pool, on slots drawn from 8192 (1-10 MB of rows: they stay in L2), and on one list of 2048 slots shared by every
token; graph replay of 20 calls after one 256 MB L2 flush (bench/timing.py). If the L2-resident times are close to
the random ones, the tile is bound on the chip (MMA, softmax, barriers), not by HBM (bench/RESULTS.md, stop 38).

    python3 bench/attention_l2.py     # a CUDA GPU; torch and triton only (no vLLM)
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from bench.timing import Timer
from overlay.kernels import sparse_mla as SM
from tools.fp8_ds_mla_codec import quantize_fp8_ds_mla
dev = "cuda"
N, BS = 262144, 64
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(N, 576, generator=g, device=dev)
pools = {"bf16": x.to(torch.bfloat16).view(N // BS, BS, 576)}
pools["fp8_ds_mla"] = torch.cat([quantize_fp8_ds_mla(x[i:i + 32768])[0] for i in range(0, N, 32768)]).view(N // BS, BS, 656)
del x
timer = Timer(dev, 20, 5, 20)
print(torch.cuda.get_device_name(), "| fmt | T | H | slots drawn from | config | graph us |")
for fmt in ("bf16", "fp8_ds_mla"):
    for T, H in ((128, 64), (128, 128), (32, 64)):
        q = torch.randn(T, H, 576, generator=g, device=dev).to(torch.bfloat16)
        cfg = SM.choose_config(T, H, 2048, fmt)
        for name, hi in (("262144 (random)", N), ("8192 (L2-resident)", 8192), ("2048 (one list, L2)", None)):
            if hi is None:
                idx = torch.randperm(N, generator=g, device=dev)[:2048].to(torch.int32).expand(T, 2048).contiguous()
            else:
                idx = torch.randint(0, hi, (T, 2048), generator=g, device=dev, dtype=torch.int32)
            out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=dev)
            lse = torch.empty(T, H, dtype=torch.float32, device=dev)
            fn = lambda: SM.sparse_mla_attention(q, pools[fmt], idx, 0.04, fmt, out=out, lse=lse, config=cfg)
            t = timer.measure(fn, eager=False, launch=False)
            print(f"| {fmt} | {T} | {H} | {name} | {cfg} | {t.graph_us:.1f} |", flush=True)

"""fp8_ds_mla encoder written from the documented layout (never from the kernel module), for the kernel
tests, the backend integration test and bench/bench_sparse_mla.py alike (bench never imports tests/).

Self-contained (torch only): tests/backend/test_dsa_integration.py loads this file by path inside a vLLM
venv's interpreter."""

from __future__ import annotations

import torch


def quantize_fp8_ds_mla(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, 576] -> (uint8 [N, 656] in the fp8_ds_mla layout, float64 [N, 576] exact dequantised values),
    on x's device.

    Bytes 0..511: 512 float8_e4m3fn, tile i = values 128i..128i+127 divided by scale_i = amax_i / 448;
    bytes 512..527: the 4 scales as float32; bytes 528..655: the 64 rope values as bfloat16."""
    n = x.shape[0]
    nope = x[:, :512].float().view(n, 4, 128)
    amax = nope.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    f8 = (nope / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    rope = x[:, 512:].to(torch.bfloat16).contiguous()
    packed = torch.empty(n, 656, dtype=torch.uint8, device=x.device)
    packed[:, :512] = f8.view(n, 512).view(torch.uint8)
    packed[:, 512:528] = scale.contiguous().view(torch.uint8).view(n, 16)
    packed[:, 528:] = rope.view(torch.uint8).view(n, 128)
    exact = torch.cat([(f8.double() * scale.double()[..., None]).view(n, 512), rope.double()], dim=1)
    return packed, exact

# SPDX-License-Identifier: Apache-2.0
"""e4m3 bytes to float16 on GPUs without an e4m3 conversion (sm_80/86), shared by the attention and indexer kernels.

Both kernels decode the same way: the float16 whose sign, exponent and mantissa bits are the code's, moved to their
float16 places, i.e. the code's value times 2^-8 (the exponent bias 7 -> 15; exact, subnormals included), and take the
2^8 back in a scale. 0x7f / 0xff (NaN) decode as +-480 (scaled): vLLM's writers saturate, so they never store them.

Self-contained: triton only.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["e4m3_as_f16_bits"]


@triton.jit
def e4m3_as_f16_bits(raw, OPAQUE: tl.constexpr = False):
    """e4m3 bytes -> float16 values 2^-8 times theirs (sign to bit 15, the other 7 bits to bits 7-13: exact,
    subnormals included), 4 bytes per PTX block: each prmt spreads two bytes into 16-bit lanes with the byte's sign
    replicated above it (0xSSbb), the shift by 7 puts the byte's low 7 bits and one sign copy in place, the mask drops
    the rest. What the Triton expression of the same bits costs per pair of values in unpack/repack PRMTs, this does in
    three instructions. Compiled kernels only (the interpreter cannot run PTX).

    OPAQUE: declared impure, so Triton's kWidth rule (computeOrigBitWidth in AccelerateMatmul: the narrowest load
    behind either MMA operand, through pure elementwise ops) does not see the 8-bit load behind the result. Where one
    operand of a dot is decoded this way outside the loop (the indexer's hoisted query) and the other is loop-carried,
    both are then laid out as 16-bit operands instead of as 8-bit ones (kWidth 4: byte-wise shared loads and register
    moves around every MMA)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, b; prmt.b32 a, $2, 0, 0x9180; prmt.b32 b, $2, 0, 0xB3A2; shl.b32 a, a, 7; "
        "shl.b32 b, b, 7; and.b32 $0, a, 0xBF80BF80; and.b32 $1, b, 0xBF80BF80; }",
        "=r,=r,r", [raw], dtype=tl.float16, is_pure=not OPAQUE, pack=4)


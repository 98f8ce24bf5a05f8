"""Worker of tests/kernels/test_sparse_mla_sm90.py: cross-compile the sm_90 Gluon sparse-MLA kernel
(overlay/kernels/sparse_mla_sm90.py) for every Gluon tile the launch tables and the benchmark's focus list hold,
for its cache format, split and unsplit, and print one JSON line per build (shared memory, registers, spills, traps, wgmma count).

No pytest here: it runs under the Triton of another venv too (3.5.1's, and the newest vLLM venv's, whose
venv has no pytest). ``python tests/kernels/_gluon_xcompile_worker.py``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from _xcompile import SHARED_LIMIT, cross_compile, signature  # noqa: E402  (puts a torch stand-in in place if needed)
from _sparse_mla_args import DIVISIBLE, FLOATS, fwd_pointer_types  # noqa: E402

import triton  # noqa: E402

from overlay.kernels import sparse_mla as M  # noqa: E402
from overlay.kernels import sparse_mla_sm90 as G  # noqa: E402

def gluon_tiles() -> list[tuple]:
    """(format, tile) of every Gluon tile the sm_90 tables can pick and the benchmark's focus list times."""
    tiles = [(f, t) for f in M.KV_FORMATS for t in M.candidate_tiles((9, 0), f) + M.FOCUS_TILES.get(f, [])]
    return sorted({(f, t) for f, t in tiles if M.SparseMLAConfig.from_tile(t).gluon})


def main() -> None:
    print(json.dumps(dict(triton=triton.__version__, ws=G.WS, ws_fp8=G.WS_FP8)), flush=True)
    for fmt, tile in gluon_tiles():
        c = M.SparseMLAConfig.from_tile(tile)
        if c.ws and not M.ws_builds(fmt):  # the launcher refuses it with this Triton (sparse_mla_sm90.WS, WS_FP8)
            continue
        fn = G._sparse_mla_fwd_sm90_ws_kernel if c.ws else G._sparse_mla_fwd_sm90_kernel
        assert type(fn).__name__ == "GluonJITFunction", type(fn)
        fp8 = fmt == "fp8_ds_mla"
        for split in (False, True):  # (the ws tile's stores are predicated: the launcher passes SPLIT=False)
            sig = signature(fn, fwd_pointer_types(fmt, split), FLOATS)
            consts = dict(IS_FP8=fp8, FP8_NATIVE=True, SPLIT=split and not c.ws, DOT_F32=False, BLOCK_H=c.block_h, SKIP_TAIL=True,
                          BLOCK_N=c.block_n, DV_SPLIT=c.dv_split, FP8_POST=False, PAGED=False,
                          NUM_BUF=c.num_stages, P_SWIZZLE=min(128, 2 * c.block_n))
            r = cross_compile(fn, sig, consts, 90, num_warps=c.num_warps, num_stages=1, divisible_by_16=DIVISIBLE)
            print(json.dumps(dict(triton=triton.__version__, fmt=fmt, tile=str(c), split=split, shared=r.shared,
                                  limit=SHARED_LIMIT[90], regs=r.registers, spill_stores=r.spill_stores,
                                  spill_loads=r.spill_loads, traps=r.traps,
                                  wgmma=r.wgmma)), flush=True)


if __name__ == "__main__":
    main()

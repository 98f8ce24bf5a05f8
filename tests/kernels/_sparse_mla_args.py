"""Cross-compile arguments of the sparse-MLA forward kernels, shared by the Triton tile's worker
(tests/kernels/test_sparse_mla_xcompile.py) and the Gluon tile's (tests/kernels/_gluon_xcompile_worker.py): both
kernels take the same argument list. No pytest here: the Gluon worker also runs in venvs without it."""

from __future__ import annotations

# Arguments a real launch specialises as 16-divisible for the shapes the product sees (aligned
# allocations; 576-/656-wide rows; block sizes and top-k multiples of 16).
DIVISIBLE = ("q_ptr", "qr_ptr", "kv_ptr", "idx_ptr", "out_ptr", "lse_ptr", "po_ptr", "plse_ptr", "block_size",
             "split_len", "stride_qt", "stride_qh", "stride_kvb", "stride_kvt", "stride_it", "stride_ot",
             "stride_oh")
FLOATS = ("sm_scale_log2",)


def fwd_pointer_types(fmt: str, split: bool) -> dict:
    """Triton type of every pointer argument of a forward kernel for a cache format, with or without splits."""
    return {"q_ptr": "*bf16", "qr_ptr": "*bf16", "kv_ptr": "*u8" if fmt == "fp8_ds_mla" else "*bf16",
            "idx_ptr": "*i32", "req_ptr": "*i32", "bt_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
            "po_ptr": "*fp32" if split else "*bf16", "plse_ptr": "*fp32" if split else "*bf16"}

"""Re-export: the fp8_ds_mla encoder lives in tools/fp8_ds_mla_codec.py (shared with bench/)."""

from tools.fp8_ds_mla_codec import quantize_fp8_ds_mla  # noqa: F401

"""H200 benchmarks and proofs (run as scripts: `python bench/<name>.py`; see bench/README.md).

Import rule: bench/ never imports tests/ (tests/bench/test_imports.py checks it); helpers that both need
live in tools/ (e.g. tools/fp8_ds_mla_codec.py) or in the runtime tree (overlay/kernels)."""

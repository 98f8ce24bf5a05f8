"""Modules dropped into vLLM as the package `vllm._dsa_overlay`. They must import without vLLM
(only the thin hooks in `patches/<version>/*.diff` import them from inside vLLM)."""

"""Version-agnostic Triton kernels (torch + triton only). Each module is self-contained: `apply`
drops the same file into vLLM as `vllm/_dsa_overlay/kernels/<name>.py`."""

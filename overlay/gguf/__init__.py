"""GLM-5 (``glm_moe_dsa``) from llama.cpp ``glm-dsa`` GGUF files, for vLLM, split at its seams:

- ``reader``: the GGUF header reader (metadata and tensor infos, never tensor data), split sets.
- ``tensors``: the glm-dsa tensor table (GGUF name, HF name, shape), read by the loader and check-gguf.
- ``config``: the HF ``GlmMoeDsaConfig`` from metadata alone.
- ``weights``: the weight plan (GGUF tensor -> vLLM load, dense policy per release) and stream.
- ``tokenizer``: tokenizer.json rebuilt from the metadata.

vLLM's diffs call the hooks through ``gguf_glm_dsa``; every module imports without vLLM (torch, numpy,
gguf, transformers and tokenizers are imported where tensors, configs or tokenizers are made), so
check-gguf reads headers with nothing but the standard library.
"""

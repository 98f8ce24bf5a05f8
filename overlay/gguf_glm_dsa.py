"""The hooks vLLM's patched files call for glm-dsa GGUF files (``patches/<version>/*.diff`` import this
module as ``vllm._dsa_overlay.gguf_glm_dsa``); the code lives in the ``gguf`` subpackage."""
from .gguf.config import config_for_gguf, register_config
from .gguf.tokenizer import tokenizer_for_gguf
from .gguf.weights import weights_map

__all__ = ["config_for_gguf", "register_config", "tokenizer_for_gguf", "weights_map"]

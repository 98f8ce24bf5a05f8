"""The hooks vLLM's patched files call for glm-dsa GGUF files (``patches/<version>/*.diff`` import this
module as ``vllm._dsa_overlay.gguf_glm_dsa``); the code lives in the ``gguf`` subpackage. vLLM 0.16-0.23:
the in-tree loader, config and tokenizer hooks; vLLM >= 0.24: ``register_plugin`` (vllm-gguf-plugin)."""
from .gguf.config import config_for_gguf, register_config
from .gguf.plugin import register as register_plugin
from .gguf.tokenizer import tokenizer_for_gguf
from .gguf.weights import weights_map

__all__ = ["config_for_gguf", "register_config", "register_plugin", "tokenizer_for_gguf", "weights_map"]

"""glm-dsa GGUF files on vLLM >= 0.24, whose tree has no GGUF loader: vllm-gguf-plugin loads GGUF there.

The plugin's loader asks ``vllm_gguf_plugin.weights_adapter.get_weights_adapter(hf_config)`` for the
first class in ``_ADAPTER_REGISTRY`` whose ``matches(config)`` is true; its own fallback cannot map
``glm_moe_dsa``. ``register`` (called by the hook in ``vllm/plugins/__init__.py`` right after vLLM ran the
general plugins) puts ``GlmDsaGGUFAdapter`` first in that list, and wraps ``EngineArgs.create_model_config``
so that a glm-dsa file gets its config and tokenizer from its own metadata (the plugin's config parser
reads config.json from the file's folder or --hf-config-path, and the tokenizer from the model folder).

The adapter is the same code as the in-tree hooks of vLLM 0.16-0.23: ``weights.GlmDsaNameMap`` (name map,
kv_b rebuild, dense loads, shard order), ``config.config_dir`` and ``tokenizer.tokenizer_dir``.
``pad_quantized_rows`` runs after the plugin's loader made the model (``_wrap_load_model``): see there.
Nothing here imports vLLM or the plugin at module level.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from .config import config_dir
from .reader import GGUFError
from .tensors import ARCH, MODEL_TYPE, is_glm_dsa
from .tokenizer import tokenizer_dir
from .weights import GlmDsaNameMap

PLUGIN_NAME = "gguf"    # vllm-gguf-plugin's entry point in vllm.general_plugins


@dataclass
class LoadSpec:
    """What the plugin's loader reads from ``adapter.load_spec`` (its ``GGUFLoadSpec`` fields)."""
    weights_source: list[str]
    unquantized_modules: list[str]
    gguf_to_hf_name_map: dict[str, str] | None = None
    weight_type_map: dict[str, str] = field(default_factory=dict)


class GlmDsaGGUFAdapter:
    """vllm-gguf-plugin weights adapter for llama.cpp ``glm-dsa`` files (GLM-5, ``glm_moe_dsa``).

    The plugin's loader calls ``prepare_loading(path, model_config)`` (sets ``load_spec``; vLLM builds the
    modules it lists unquantized) and then feeds ``prepare_weights(model_config)`` to
    ``model.load_weights``: the stream of ``GlmDsaNameMap.dsa_weights`` (every ``qweight_type`` first)."""

    load_spec: LoadSpec | None = None

    def __init__(self, config: Any) -> None:
        self.config = config
        self.name_map: GlmDsaNameMap | None = None

    @classmethod
    def matches(cls, config: Any) -> bool:
        return getattr(config, "model_type", None) == MODEL_TYPE

    def prepare_loading(self, model_path: str, model_config: Any) -> LoadSpec:
        path = os.fspath(model_path)
        if not is_glm_dsa(path):
            raise GGUFError(f"{path}: the model config is {MODEL_TYPE}, but this file's architecture is not "
                            f"{ARCH!r}; pass a llama.cpp glm-dsa GGUF (python apply.py check-gguf {path})")
        self.name_map = m = GlmDsaNameMap(path)
        if "lm_head.weight" in m.dsa_extra_tensor_names():
            model_config.hf_config.update({"tie_word_embeddings": True})
        self.load_spec = LoadSpec(weights_source=list(m.files), unquantized_modules=m.dsa_unquantized_modules(),
                                  gguf_to_hf_name_map=dict(m), weight_type_map=m.dsa_weight_type_map())
        return self.load_spec

    def prepare_weights(self, model_config: Any) -> Iterator[tuple[str, Any]]:
        if self.name_map is None:
            raise RuntimeError("GlmDsaGGUFAdapter.prepare_weights before prepare_loading")
        yield from self.name_map.dsa_weights()


def model_sources(model: Any, tokenizer: Any, hf_config_path: Any) -> dict[str, str]:
    """For a local glm-dsa GGUF ``model``: the ``EngineArgs`` fields to fill so vLLM reads its config and
    tokenizer from the file: ``hf_config_path`` (a folder with config.json from the metadata) when the
    user gave none and no config.json sits beside the file, ``tokenizer`` (rebuilt from the metadata)
    when the user gave none. Empty for anything else."""
    if not isinstance(model, (str, os.PathLike)) or not os.fspath(model).endswith(".gguf"):
        return {}
    path = os.fspath(model)
    if not is_glm_dsa(path):
        return {}
    out = {}
    if hf_config_path is None and not os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(path)),
                                                                   "config.json")):
        out["hf_config_path"] = config_dir(path)
    if tokenizer is None or (isinstance(tokenizer, str) and os.path.abspath(tokenizer) == os.path.abspath(path)):
        out["tokenizer"] = tokenizer_dir(path)
    return out


def _wrap_method(cls: Any, name: str, flag: str, make: Any) -> None:
    """Replace ``cls.<name>`` by ``make(original)`` once (``flag`` marks the class as done); the original stays
    reachable as the wrapper's ``__wrapped__``."""
    if getattr(cls, flag, False):
        return
    original = getattr(cls, name)
    wrapper = make(original)
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    setattr(cls, name, wrapper)
    setattr(cls, flag, True)


def _wrap_create_model_config(engine_args_cls: Any) -> None:
    def make(original):
        def create_model_config(self, *args, **kwargs):
            for key, value in model_sources(self.model, self.tokenizer, self.hf_config_path).items():
                setattr(self, key, value)
            return original(self, *args, **kwargs)
        return create_model_config

    _wrap_method(engine_args_cls, "create_model_config", "_dsa_overlay_glm_dsa_gguf", make)


# vllm-gguf-plugin's quantized GEMM kernels (llama.cpp b2899's mmq / mmvq) read a weight row in steps of several
# blocks, past the row's end when its length is not a multiple of that step; llama.cpp pads every quantized
# tensor's allocation by MATRIX_ROW_PADDING = 512 elements of zeros for this. The plugin does not, so the last
# row reads whatever follows the tensor in GPU memory: when those bytes decode to a NaN or inf block scale, that
# output column is NaN for every token (found on the H200 with vLLM 0.26.0 and plugin 0.0.3: a Q8_0 q_b_proj
# of 32-wide rows, NaN in column 1535 with 256-token steps, finite with 512: the allocator's neighbours differ).
ROW_PADDING = 512   # elements, llama.cpp's MATRIX_ROW_PADDING
_QWEIGHTS = ("qweight", "w13_qweight", "w2_qweight")   # linear and fused-MoE parameters, with a `<name>_type`


def _quant_size(weight_type) -> tuple[int, int] | None:
    """(elements, bytes) of one block of GGML type `weight_type`, or None (not a quantized type / unknown)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(weight_type))]
    except (ValueError, KeyError, TypeError):
        return None
    return (block, size) if block > 1 else None


def pad_quantized_rows(model: Any) -> list[str]:
    """Give every quantized GGUF weight whose rows are not a multiple of ROW_PADDING elements ROW_PADDING
    elements' worth of zero bytes past its end, as llama.cpp allocates them (the parameter keeps its shape,
    strides and attributes; its data moves to a buffer one row-padding longer). A merged weight whose shards
    have their own types is padded for the one with most bytes per element. Returns the padded parameters' names."""
    import torch

    padded = []
    for mod_name, mod in model.named_modules():
        for name in _QWEIGHTS:
            weight, wtype = getattr(mod, name, None), getattr(mod, name + "_type", None)
            if not isinstance(weight, torch.Tensor) or wtype is None or weight.dtype != torch.uint8 \
                    or weight.dim() < 2 or not weight.is_contiguous():
                continue
            types = set(getattr(wtype, "shard_weight_type", {}).values()) or {getattr(wtype, "weight_type", None)}
            sizes = [q for q in map(_quant_size, types) if q is not None]
            if not sizes or len(sizes) != len(types):
                continue  # unquantized (F32 / F16 / BF16) or a type this cannot size
            block, size = max(sizes, key=lambda q: q[1] / q[0])
            if (weight.shape[-1] // size * block) % ROW_PADDING == 0:
                continue  # whole row-paddings: no read past the end
            extra = -(-ROW_PADDING // block) * size
            buf = torch.zeros(weight.numel() + extra, dtype=weight.dtype, device=weight.device)
            buf[:weight.numel()].copy_(weight.reshape(-1))
            weight.data = buf[:weight.numel()].view(weight.shape)
            padded.append(f"{mod_name}.{name}" if mod_name else name)
    return padded


def _wrap_load_model(loader_cls: Any) -> None:
    """The plugin loader's ``load_model(vllm_config, model_config, prefix)`` pads a glm-dsa model's quantized
    weights (pad_quantized_rows) once it is made; other models are left as the plugin makes them."""
    def make(original):
        def load_model(self, *args, **kwargs):
            model = original(self, *args, **kwargs)
            model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
            if getattr(getattr(model_config, "hf_config", None), "model_type", None) == MODEL_TYPE:
                pad_quantized_rows(model)
            return model
        return load_model

    _wrap_method(loader_cls, "load_model", "_dsa_overlay_row_padding", make)


def register(plugins: dict) -> bool:
    """The hook after vLLM ran its general plugins: when vllm-gguf-plugin was among them, put the glm-dsa
    adapter first in its registry, let glm-dsa files bring their own config and tokenizer, and pad the
    quantized weights of every model its loader makes (pad_quantized_rows). True when
    registered; False without the plugin (GGUF then needs it: ``pip install vllm-gguf-plugin``)."""
    if PLUGIN_NAME not in plugins:
        return False
    try:
        from vllm_gguf_plugin import weights_adapter
    except ImportError:
        return False
    if GlmDsaGGUFAdapter not in weights_adapter._ADAPTER_REGISTRY:
        weights_adapter._ADAPTER_REGISTRY.insert(0, GlmDsaGGUFAdapter)
    from vllm.engine.arg_utils import EngineArgs
    _wrap_create_model_config(EngineArgs)
    try:
        from vllm_gguf_plugin.loader import GGUFModelLoader
    except ImportError:  # a plugin release without that loader: its kernels' padding stays as it is
        pass
    else:
        _wrap_load_model(GGUFModelLoader)
    return True

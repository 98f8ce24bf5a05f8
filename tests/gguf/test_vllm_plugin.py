"""glm-dsa GGUF through vllm-gguf-plugin 0.0.3 inside a real vLLM 0.26.0 venv (CPU, stub libcuda): the
overlay's hook in vllm/plugins/__init__.py registers the adapter after vLLM ran the plugin, EngineArgs
builds the model config and tokenizer from the file, and the plugin's own GGUFModelLoader streams the
adapter's weights, checked tensor by tensor against gguf-py's reading of the file.

The plugin and gguf are installed with `pip install --no-deps --target` (wheels from `.whl/` in the
checkout when there, else the index) into the temporary copy, never into the venv. Until the 0.26.0 set
lists plugins.diff, the engine applies a local set made of that one hook and the overlay drop-in (the
rest of the 0.26.0 set is not needed for GGUF loading on CPU); afterwards the shipped set is used.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_installer import engine, fsops
from tests import vllm_envs

from .test_gguf_plugin_adapter import _reader_tensors

VERSION = "0.26.0"


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): fsops.file_sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A hard-linked copy of the real 0.26.0 venv's vllm with the plugin beside it, overlay applied."""
    python, venv_site = vllm_envs.require(VERSION)
    dest = tmp_path_factory.mktemp("site026")
    dist = next(venv_site.glob(f"vllm-{VERSION}.dist-info"))
    subprocess.run(["cp", "-al", str(venv_site / "vllm"), str(dist), str(dest)], check=True)
    vllm_envs.install_plugin(dest)
    before = _tree(dest / "vllm_gguf_plugin")
    with vllm_envs.hook_patch_set(VERSION, dest):
        engine.apply(dest)
    env = vllm_envs.subprocess_env(dest, venv_site)
    env["DSA_OVERLAY_CACHE"] = str(dest / "cache")
    return python, dest, env, before


def test_rollback_leaves_vllm_and_the_plugin_byte_identical(site, tmp_path):
    python, dest, env, plugin_before = site
    assert _tree(dest / "vllm_gguf_plugin") == plugin_before, "apply wrote into the plugin"
    copy = tmp_path / "rt"
    subprocess.run(["cp", "-a", str(dest), str(copy)], check=True)
    # the copy is applied; rollback must give the pristine venv bytes and the plugin as pip wrote it
    with vllm_envs.hook_patch_set(VERSION, copy):
        engine.rollback(copy)
    _, venv_site = vllm_envs.require(VERSION)
    assert fsops.file_sha256(copy / "vllm/plugins/__init__.py") == fsops.file_sha256(
        venv_site / "vllm/plugins/__init__.py")
    assert not (copy / "vllm/_dsa_overlay").exists() and not (copy / "vllm/.dsa_overlay").exists()
    assert _tree(copy / "vllm_gguf_plugin") == plugin_before


_PROBE = r"""
import json, os, sys, types
import torch
import vllm
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__
path, hf, save = sys.argv[2], sys.argv[3], sys.argv[4]
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_gguf_plugin import weights_adapter as wa
out = {"registry": [c.__module__ + "." + c.__name__ for c in wa._ADAPTER_REGISTRY]}
from vllm.engine.arg_utils import EngineArgs
ea = EngineArgs(model=path)
mc = ea.create_model_config()
c = mc.hf_config
out["engine_args"] = {"quantization": ea.quantization, "load_format": ea.load_format, "model": ea.model,
                      "model_weights": ea.model_weights, "tokenizer": mc.tokenizer}
out["config"] = {k: getattr(c, k, None) for k in (
    "model_type", "architectures", "num_hidden_layers", "kv_lora_rank", "index_topk", "topk_method",
    "num_nextn_predict_layers", "qk_nope_head_dim", "indexer_rope_interleave", "tie_word_embeddings")}
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
loader = get_model_loader(LoadConfig(load_format="gguf"))
out["loader"] = type(loader).__module__ + "." + type(loader).__name__
out["row_padding"] = getattr(type(loader), "_dsa_overlay_row_padding", False)
adapter = loader._prepare_adapter(mc)
out["adapter"] = type(adapter).__name__
out["unquantized"] = sorted(adapter.load_spec.unquantized_modules)
torch.set_default_dtype(torch.bfloat16)
stream = list(adapter.prepare_weights(mc))
out["names"] = [n for n, _ in stream]
torch.save(dict(stream), save)
from vllm.tokenizers import get_tokenizer
text = "[gMASK]<sop>sparse attention index 12345 selects tokens"
out["tok"] = [get_tokenizer(mc.tokenizer).encode(text), get_tokenizer(hf).encode(text)]
print("JSON" + json.dumps(out))
"""


def _probe(site, *args, extra_env=None):
    python, dest, env, _ = site
    proc = subprocess.run([str(python), "-c", _PROBE, str(dest), *map(str, args)], capture_output=True,
                          text=True, env={**env, **(extra_env or {})}, timeout=900)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("JSON")), None)
    assert line, proc.stderr[-5000:]
    return json.loads(line[4:])


@pytest.mark.parametrize("tag", ["BF16", "Q8_0", "Q4_K_M"])
def test_plugin_loader_streams_the_adapters_weights(site, tiny, tmp_path, tag):
    path = tiny.gguf(tag)
    save = tmp_path / "stream.pt"
    out = _probe(site, path, tiny.hf, save)
    assert out["registry"][0] == "vllm._dsa_overlay.gguf.plugin.GlmDsaGGUFAdapter", out["registry"]
    assert out["loader"] == "vllm_gguf_plugin.loader.GGUFModelLoader" and out["adapter"] == "GlmDsaGGUFAdapter"
    assert out["row_padding"] is True   # its load_model pads the quantized weights (pad_quantized_rows)
    ea = out["engine_args"]
    assert (ea["quantization"], ea["load_format"], ea["model_weights"]) == ("gguf", "gguf", path)
    assert "gguf-configs" in ea["model"] and "gguf-tokenizers" in ea["tokenizer"], ea
    c = out["config"]
    assert c["model_type"] == "glm_moe_dsa" and c["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert (c["num_hidden_layers"], c["kv_lora_rank"], c["index_topk"]) == (2, 64, 8)
    assert c["topk_method"] == "noaux_tc" and c["num_nextn_predict_layers"] == 1
    assert c["indexer_rope_interleave"] is True and c["tie_word_embeddings"] is False
    assert out["tok"][0] == out["tok"][1] and len(out["tok"][0]) > 5
    for must in ("model.layers.1.self_attn.kv_b_proj", "model.layers.1.mlp.gate",
                 "model.layers.1.self_attn.indexer.wk", "model.layers.1.self_attn.indexer.wq_b",
                 "model.layers.2.eh_proj"):
        assert must in out["unquantized"], must
    # every streamed tensor against gguf-py's reading of the file
    stream = torch.load(save)
    ref = _reader_tensors([path])
    kvb = stream["model.layers.1.self_attn.kv_b_proj.weight"].float()
    kt, vt = ref["blk.1.attn_k_b.weight"][1], ref["blk.1.attn_v_b.weight"][1]
    assert torch.equal(kvb, torch.cat([kt.transpose(1, 2), vt], dim=1).reshape(-1, kt.shape[1]))
    q = stream.get("model.layers.1.self_attn.q_b_proj.qweight")
    ftype, vals, raw = ref["blk.1.attn_q_b.weight"]
    if q is not None:
        assert tag != "BF16" and np.array_equal(q.numpy().reshape(raw.shape), raw)
        assert int(stream["model.layers.1.self_attn.q_b_proj.qweight_type"]) == int(
            __import__("gguf").GGMLQuantizationType[ftype])
    else:
        assert torch.equal(stream["model.layers.1.self_attn.q_b_proj.weight"].float(), vals)
    exp = stream["model.layers.1.mlp.experts.0.down_proj.qweight"]
    ftype, vals, raw = ref["blk.1.ffn_down_exps.weight"]
    if exp.dtype == torch.uint8:
        assert np.array_equal(exp.numpy().reshape(raw.shape), raw)
    else:
        assert torch.equal(exp.float(), vals.to(exp.dtype).float())
    assert torch.equal(stream["model.layers.1.mlp.gate.e_score_correction_bias"].float(),
                       ref["blk.1.exp_probs_b.bias"][1])
    assert len(out["names"]) == len(stream)


def test_without_the_plugin_entry_point_nothing_registers(site, tiny):
    """VLLM_PLUGINS without `gguf`: the plugin does not run, so neither does the adapter registration."""
    python, dest, env, _ = site
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins();"
            "from vllm_gguf_plugin import weights_adapter as wa; from vllm.engine.arg_utils import EngineArgs;"
            "print([c.__name__ for c in wa._ADAPTER_REGISTRY], hasattr(EngineArgs, '_dsa_overlay_glm_dsa_gguf'))")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          env={**env, "VLLM_PLUGINS": "none"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "['Gemma3GGUFAdapter'] False"

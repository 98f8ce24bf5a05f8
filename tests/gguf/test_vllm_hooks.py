"""vLLM 0.23.0's own GGUF code running through the overlay's hooks (thin-hook and compile checks of
every patch set: tests/engine/test_patch_sets.py).

It needs the vLLM 0.23.0 venv that .ci/run creates (tests/vllm_envs.py); the engine applies
the overlay to a temporary hard-linked copy of its package, never in place, and a generated stub libcuda
stands in for the driver on a CPU machine.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests import vllm_envs


_PROBE = r"""
import json, sys, types
import torch
import vllm
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__
from vllm.transformers_utils.config import get_config
from vllm.model_executor.model_loader.gguf_loader import GGUFModelLoader
from vllm.model_executor.model_loader import weight_utils
from vllm.config.load import LoadConfig
import transformers
path, split, hf = sys.argv[2], sys.argv[3], sys.argv[4]
out = {"transformers": transformers.__version__}
cfg = get_config(path, trust_remote_code=False)
out["gguf_config"] = {k: getattr(cfg, k, None) for k in (
    "model_type", "architectures", "num_hidden_layers", "kv_lora_rank", "index_topk", "topk_method",
    "num_nextn_predict_layers", "qk_nope_head_dim", "indexer_rope_interleave", "tie_word_embeddings")}
out["gguf_config_class"] = type(cfg).__module__ + "." + type(cfg).__name__
out["rope"] = getattr(cfg, "rope_parameters", None)
st = get_config(hf, trust_remote_code=False)      # safetensors checkpoint: needs the registration
out["hf_config"] = {k: getattr(st, k, None) for k in ("model_type", "kv_lora_rank", "index_n_heads")}
loader = GGUFModelLoader(LoadConfig(load_format="gguf"))
res = {}
for name, p in (("single", path), ("split", split)):
    mc = types.SimpleNamespace(model=p, hf_config=cfg, revision=None, trust_remote_code=False)
    m = loader._get_gguf_weights_map(mc)
    tmap = loader._get_gguf_weight_type(mc, p, m)
    extra = []
    for f in loader._get_all_gguf_files(p):
        extra += weight_utils.get_gguf_extra_tensor_names(f, m)
    torch.set_default_dtype(torch.bfloat16)
    stream = list(loader._get_weights_iterator(mc, p, m))
    torch.set_default_dtype(torch.float32)
    res[name] = {
        "map_type": type(m).__name__, "n_files": len(loader._get_all_gguf_files(p)),
        "unquant": sorted(n[:-7] for n, t in tmap.items() if t in ("F32", "F16", "BF16") and n.endswith(".weight")),
        "extra": extra,
        "names": [n for n, _ in stream],
        "sums": {n: float(t.double().sum()) if t.dtype != torch.uint8 else int(t.long().sum()) for n, t in stream},
    }
out["res"] = res
from vllm.tokenizers.registry import get_tokenizer
tk = get_tokenizer(path)                            # no --tokenizer: rebuilt from the GGUF
ref = get_tokenizer(hf)
text = "[gMASK]<sop>sparse attention index 12345 selects tokens"
out["tok"] = [tk.encode(text), ref.encode(text)]
print("JSON" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory):
    return vllm_envs.patched_site("0.23.0", tmp_path_factory.mktemp("site"))


def test_vllm_023_gguf_iteration_through_the_hooks(patched_site, tiny):
    py, site, env = patched_site
    env = dict(env)
    env["DSA_OVERLAY_CACHE"] = str(site / "cache")
    proc = subprocess.run([str(py), "-c", _PROBE, str(site), tiny.gguf("Q4_K_M"), tiny.split_first,
                           str(tiny.hf)], capture_output=True, text=True, env=env, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("JSON")), None)
    assert line, proc.stderr[-5000:]
    out = json.loads(line[4:])
    c = out["gguf_config"]
    assert c["model_type"] == "glm_moe_dsa" and c["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert (c["num_hidden_layers"], c["kv_lora_rank"], c["index_topk"]) == (2, 64, 8)
    assert c["topk_method"] == "noaux_tc" and c["num_nextn_predict_layers"] == 1
    assert c["indexer_rope_interleave"] is True and c["tie_word_embeddings"] is False
    if out["transformers"].startswith("4."):
        # FACTS: transformers 4.57.6 lacks glm_moe_dsa; the overlay's registration provides it
        assert out["gguf_config_class"] == "vllm._dsa_overlay.gguf.config.GlmMoeDsaConfig"
    assert out["hf_config"] == {"model_type": "glm_moe_dsa", "kv_lora_rank": 64, "index_n_heads": 4}
    single, split = out["res"]["single"], out["res"]["split"]
    assert single["map_type"] == split["map_type"] == "GlmDsaNameMap"
    assert split["n_files"] == 6 and single["n_files"] == 1
    assert single["extra"] == [] and split["extra"] == [], "output.weight present: embeddings untied"
    # same loads from one file and from six shards
    assert sorted(single["names"]) == sorted(split["names"])
    assert single["sums"] == split["sums"]
    assert single["unquant"] == split["unquant"]
    for must in ("model.layers.1.self_attn.kv_b_proj", "model.layers.1.mlp.gate",
                 "model.layers.1.self_attn.indexer.wk", "model.layers.1.self_attn.indexer.weights_proj",
                 "model.layers.2.eh_proj"):
        assert must in single["unquant"], must
    # qweight types strictly before data, experts merged under experts.0
    names = single["names"]
    first_data = next(i for i, n in enumerate(names) if not n.endswith("qweight_type"))
    assert all(not n.endswith("qweight_type") for n in names[first_data:])
    assert "model.layers.1.mlp.experts.0.gate_proj.qweight" in names
    assert "model.layers.1.self_attn.kv_b_proj.weight" in names
    assert out["tok"][0] == out["tok"][1] and len(out["tok"][0]) > 5

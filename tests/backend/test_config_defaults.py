"""GLM-5 checkpoints saved by transformers 5.x lack `indexer_rope_interleave`: the overlay sets it to True
(overlay/config_defaults.py), unit-tested here and proven through the real `get_config` of the patched
vLLM 0.16.0 and 0.23.0 (tests/vllm_envs.py; skipped, with the reason, where those venvs are missing)."""

import json
import logging
import subprocess
import textwrap
import types

import pytest

from overlay import config_defaults
from tests import vllm_envs

# config.json as transformers 5.17 writes it for GlmMoeDsaConfig(num_hidden_layers=2, hidden_size=256,
# num_attention_heads=16, index_topk=256).save_pretrained(...): no indexer_rope_interleave key
SAVED_BY_TRANSFORMERS_5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 256, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 256,
    "indexer_types": ["full", "full"], "initializer_range": 0.02, "intermediate_size": 12288,
    "kv_lora_rank": 512, "layer_types": ["deepseek_sparse_attention", "deepseek_sparse_attention"],
    "max_position_embeddings": 202752, "mlp_bias": False, "mlp_layer_types": ["dense", "dense"],
    "model_type": "glm_moe_dsa", "moe_intermediate_size": 2048, "n_group": 1, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 8,
    "num_hidden_layers": 2, "num_key_value_heads": 64, "pad_token_id": None, "q_lora_rank": 2048,
    "qk_head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False, "topk_group": 1, "transformers_version": "5.17.0", "use_cache": True,
    "v_head_dim": 256, "vocab_size": 154880,
}
LOG_LINE = "dsa-overlay: glm_moe_dsa config has no indexer_rope_interleave; set to True"


def test_fills_only_a_missing_glm5_key_with_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger=config_defaults.logger.name)
    missing = types.SimpleNamespace(model_type="glm_moe_dsa", index_topk=2048)
    assert config_defaults.fill_defaults(missing) is missing
    assert missing.indexer_rope_interleave is True
    assert [r.getMessage() for r in caplog.records] == [
        LOG_LINE + " (what the model's reference implementation does)"]
    caplog.clear()
    for value in (False, True):  # set by the checkpoint or by hf_overrides: kept, nothing logged
        given = types.SimpleNamespace(model_type="glm_moe_dsa", indexer_rope_interleave=value)
        assert config_defaults.fill_defaults(given).indexer_rope_interleave is value
    for other in ("deepseek_v32", "deepseek_v3", None):  # DeepSeek-V3.2 checkpoints carry their own key
        cfg = types.SimpleNamespace(model_type=other)
        config_defaults.fill_defaults(cfg)
        assert not hasattr(cfg, "indexer_rope_interleave")
    assert caplog.records == []


_PROBE = """
import json, sys
import vllm
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__
from vllm.transformers_utils.config import get_config
out = {}
for name, path, overrides in (("missing", sys.argv[2], None), ("false_in_file", sys.argv[3], None),
                              ("overridden", sys.argv[2], {"indexer_rope_interleave": False})):
    cfg = get_config(path, trust_remote_code=False, hf_overrides_kw=overrides)
    out[name] = [cfg.model_type, getattr(cfg, "indexer_rope_interleave", "absent")]
print("JSON" + json.dumps(out))
"""


@pytest.mark.parametrize("version", ["0.23.0", "0.16.0"])
def test_get_config_of_the_patched_vllm_sets_it(version, tmp_path):
    python, site, env = vllm_envs.patched_site(version, tmp_path / "site")
    missing, false_in_file = tmp_path / "saved", tmp_path / "explicit"
    for d, extra in ((missing, {}), (false_in_file, {"indexer_rope_interleave": False})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**SAVED_BY_TRANSFORMERS_5, **extra}))
    proc = subprocess.run([str(python), "-c", textwrap.dedent(_PROBE), str(site), str(missing), str(false_in_file)],
                          env=dict(env, VLLM_LOGGING_LEVEL="INFO"), capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("JSON")), None)
    assert line, (proc.stdout + proc.stderr)[-4000:]
    assert json.loads(line[4:]) == {"missing": ["glm_moe_dsa", True], "false_in_file": ["glm_moe_dsa", False],
                                    "overridden": ["glm_moe_dsa", False]}
    logged = [x for x in (proc.stdout + proc.stderr).splitlines() if LOG_LINE in x]
    assert len(logged) == 1, logged  # only the config that lacked the key

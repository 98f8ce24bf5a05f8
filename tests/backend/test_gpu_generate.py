"""GPU: a tiny random GLM-5 generates end to end through TRITON_MLA_SPARSE in a patched vLLM.

The model is GLM-5-shaped (2 layers, 16 heads, kv_lora_rank 512, qk_nope 192, v_head 256, 32 index heads,
index_topk 256, noaux_tc routing) with dummy weights and no tokenizer; the prompts are 300+ token ids, so
the indexer's top-k really drops keys. Two runs, each an engine in its own subprocess (one at a time on
the GPU): the backend asked for explicitly, and picked by the overlay under DSA_OVERLAY_PORTABLE=1. A third
run: GLM-5.2-shaped (3 layers, index_topk_freq 2: vLLM 0.24+ builds layer 2 without an indexer) with prompts no
longer than top-k (vLLM 0.26+ prefills them through dense MHA, decodes through TRITON_MLA_SPARSE).

The vLLM: DSA_OVERLAY_GPU_SITE=/path/site-packages (the H200's staged /root/site; used as it is when it
carries the overlay, else the overlay is applied to a hard-linked copy, the site itself is never written),
otherwise the patched vLLM 0.23.0 venv of tests/vllm_envs.py. Skipped without a CUDA device (conftest)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

GLM5_TINY = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 8192,
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "q_lora_rank": 512,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
    "index_head_dim": 128, "index_n_heads": 32, "index_topk": 256, "indexer_rope_interleave": True,
    "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "torch_dtype": "bfloat16",
}
PROMPT_LENS = (300, 347)
# GLM-5.2's IndexCache: index_topk_freq 2 leaves layer 2 of 3 without an indexer (it reuses layer 1's top-k,
# vLLM 0.24+); prompts no longer than index_topk, which vLLM 0.26+ prefills through dense MHA
GLM52_TINY = {**GLM5_TINY, "num_hidden_layers": 3, "index_topk_freq": 2}
SHORT_PROMPT_LENS = (120, 200)
NEW_TOKENS = 8
TIMEOUT_S = 540

# Runs in the vLLM's interpreter: argv = result.json, model dir, "explicit" | "portable". Writes the result,
# then ends with os._exit: a vLLM process may not exit by itself after generate.
_CHILD = r"""
import json, os, random, sys
out_path, model_dir, mode = sys.argv[1:4]
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the counters below see it
os.environ["DSA_OVERLAY_PORTABLE"] = "1" if mode == "portable" else "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm._dsa_overlay.triton_mla_sparse import TritonMLASparseImpl

calls = {"TRITON_MLA_SPARSE": 0, "FLASHMLA_SPARSE": 0, "FLASH_ATTN_MLA_SPARSE": 0,
         "TRITON_MLA_SPARSE.forward_mha": 0, "indexerless_layers": 0}
def count(cls, name, method="forward_mqa"):
    orig = getattr(cls, method)
    def counted(*args, **kwargs):
        calls[name] += 1
        return orig(*args, **kwargs)
    setattr(cls, method, counted)
count(TritonMLASparseImpl, "TRITON_MLA_SPARSE")
if hasattr(TritonMLASparseImpl, "forward_mha"):  # vLLM 0.26+: prefills no longer than top-k go dense MHA
    count(TritonMLASparseImpl, "TRITON_MLA_SPARSE.forward_mha", "forward_mha")
_init = TritonMLASparseImpl.__init__
def _init_counted(self, *args, **kwargs):
    calls["indexerless_layers"] += kwargs.get("indexer") is None
    _init(self, *args, **kwargs)
TritonMLASparseImpl.__init__ = _init_counted
for mod, cls, name in (("flashmla_sparse", "FlashMLASparseImpl", "FLASHMLA_SPARSE"),
                       ("flashattn_mla_sparse", "FlashAttnMLASparseImpl", "FLASH_ATTN_MLA_SPARSE")):
    try:
        count(getattr(__import__(f"vllm.v1.attention.backends.mla.{mod}", fromlist=[cls]), cls), name)
    except ImportError:
        pass
kwargs = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=1024, max_num_seqs=4, enforce_eager=True, gpu_memory_utilization=0.3,
              enable_prefix_caching=False)
if mode == "explicit":
    kwargs["attention_backend"] = "TRITON_MLA_SPARSE"
llm = LLM(**kwargs)
rng = random.Random(0)
prompts = [[rng.randrange(2, 8192) for _ in range(n)] for n in json.loads(sys.argv[4])]
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[5]), ignore_eos=True, logprobs=1,
                        prompt_logprobs=1, detokenize=False)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
import inspect
import vllm.model_executor.models.deepseek_v2 as dsv2
from vllm._dsa_overlay import triton_mla_sparse as tms
result = {"calls": calls, "outputs": [], "shared_bases": tms.SHARED_SPARSE_BASES,
          "index_cache": "index_topk_freq" in inspect.getsource(dsv2)}
for o, p in zip(outs, prompts):
    c = o.outputs[0]
    result["outputs"].append({
        "tokens": list(c.token_ids),
        "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
        "prompt_logprobs": [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])],
    })
with open(out_path, "w") as f:
    json.dump(result, f)
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def patched_vllm(tmp_path_factory) -> tuple[str, dict]:
    """(python, environment) of a vLLM carrying the overlay."""
    given = os.environ.get("DSA_OVERLAY_GPU_SITE")
    if not given:
        from tests import vllm_envs

        python, _, env = vllm_envs.patched_site("0.23.0", tmp_path_factory.mktemp("site"))
        return str(python), env
    site = Path(given)
    path = [str(site)]
    if not (site / "vllm" / "_dsa_overlay").is_dir():  # apply to a hard-linked copy placed before the site
        from dsa_installer import engine  # imported here: a patched site needs neither it nor unidiff

        copy = tmp_path_factory.mktemp("patched")
        subprocess.run(["cp", "-al", str(site / "vllm"), *map(str, site.glob("vllm-*.dist-info")), str(copy)],
                       check=True)
        engine.apply(copy)
        path.insert(0, str(copy))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return sys.executable, env


def generate(patched_vllm, tmp_path, mode, config, prompt_lens) -> dict:
    """Run the child engine on a tiny model with `config`; its result: forward call counts and outputs."""
    python, env = patched_vllm
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    result = tmp_path / "result.json"
    # compiled kernels in the engine: drop the interpreter switch this pytest process sets (tests/conftest.py)
    env = {k: v for k, v in dict(env, VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1").items()
           if k != "TRITON_INTERPRET"}
    try:
        proc = subprocess.run([python, "-c", _CHILD, str(result), str(model), mode, json.dumps(prompt_lens),
                               str(NEW_TOKENS)], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:  # its output may come as bytes even with text=True
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        log = f"timed out after {TIMEOUT_S} s\n{text(exc.stdout)}{text(exc.stderr)}"
    assert result.is_file(), log[-5000:]
    r = json.loads(result.read_text())
    vendor = {k: v for k, v in r["calls"].items() if k in ("FLASHMLA_SPARSE", "FLASH_ATTN_MLA_SPARSE")}
    assert r["calls"]["TRITON_MLA_SPARSE"] > 0 and set(vendor.values()) <= {0}, r["calls"]
    assert len(r["outputs"]) == len(prompt_lens)
    for out, n in zip(r["outputs"], prompt_lens):
        assert len(out["tokens"]) == NEW_TOKENS and all(0 <= t < config["vocab_size"] for t in out["tokens"])
        assert len(out["prompt_logprobs"]) == n - 1
        for lp in out["logprobs"] + out["prompt_logprobs"]:
            assert math.isfinite(lp) and lp <= 0, out
    return r


@pytest.mark.parametrize("mode", ["explicit", "portable"])
def test_tiny_glm5_generates_through_triton_mla_sparse(patched_vllm, mode, tmp_path):
    r = generate(patched_vllm, tmp_path, mode, GLM5_TINY, PROMPT_LENS)
    assert r["calls"]["indexerless_layers"] == 0, r["calls"]


def test_tiny_glm52_indexerless_layer_and_short_prefill(patched_vllm, tmp_path):
    """GLM-5.2 (index_topk_freq 2): the layer without an indexer attends through the shared top-k buffer;
    prompts no longer than top-k go through vLLM 0.26's dense-MHA prefill where the backend has it."""
    r = generate(patched_vllm, tmp_path, "portable", GLM52_TINY, SHORT_PROMPT_LENS)
    assert (r["calls"]["indexerless_layers"] >= 1) is r["index_cache"], r  # vLLM 0.24+ builds such layers
    if r["shared_bases"]:  # 0.26+
        assert r["calls"]["TRITON_MLA_SPARSE.forward_mha"] > 0, r["calls"]

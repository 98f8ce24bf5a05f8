"""The overlay's glm-dsa GGUF mapping on files made by llama.cpp's own converter and quantizer."""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from overlay import gguf_glm_dsa as hooks
from overlay.gguf import config, reader, tensors, weights

# relative RMS error allowed per ggml type (vs the BF16 reference); a wrong mapping gives ~1.4
REL_RMS = {"Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.05, "Q5_0": 0.05, "Q5_1": 0.05, "Q4_K": 0.1,
           "Q4_0": 0.1, "Q4_1": 0.1, "Q3_K": 0.2, "Q2_K": 0.35}


def _types_of(path):
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_bf16_reproduces_every_hf_tensor_exactly(tiny, tiny_ref):
    got = dict(weights.hf_tensors(tiny.gguf("BF16")))
    assert set(got) == set(tiny_ref)
    assert any(".mlp.experts.7.down_proj" in k for k in got) and any("kv_b_proj" in k for k in got)
    assert any(k.startswith("model.layers.2.") for k in got), "MTP block (layer 2) not mapped"
    for name, ref in tiny_ref.items():
        assert got[name].shape == ref.shape, name
        # the file stores bf16 (or f32 for norms/biases/router): equal to the reference as stored
        assert torch.equal(got[name], ref.float()), name


@pytest.mark.parametrize("tag", ["Q8_0", "Q4_K_M"])
def test_quantized_within_dequantization_tolerance(tiny, tiny_ref, tag):
    types = _types_of(tiny.gguf(tag))
    seen = set()
    got = dict(weights.hf_tensors(tiny.gguf(tag)))
    assert set(got) == set(tiny_ref)
    plan = weights.plan(reader.merged_tensors(reader.read_model(tiny.gguf(tag))))
    src_type = {}
    for e in plan.entries:
        worst = max((s.type_name for s in e.sources), key=lambda t: REL_RMS.get(t, 0))
        if e.kind == "experts":
            for i in range(tiny.config["n_routed_experts"]):
                src_type[e.hf_name.replace(".experts.0.", f".experts.{i}.")] = worst
        else:
            src_type[e.hf_name] = worst
    for name, ref in tiny_ref.items():
        ref = ref.float()
        t = src_type[name]
        seen.add(t)
        if t in ("F32", "BF16", "F16"):
            assert torch.equal(got[name], ref), name
            continue
        rel = ((got[name] - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
        assert rel < REL_RMS[t], f"{name} ({t}): relative RMS error {rel:.4f}"
    if tag == "Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= seen, f"expected a K-quant mix, got {sorted(seen)}"
    assert set(types.values()) >= {"F32"}


def test_split_equals_single_file(tiny):
    single = dict(weights.hf_tensors(tiny.gguf("Q4_K_M")))
    split = dict(weights.hf_tensors(tiny.split_first))
    assert set(single) == set(split)
    for k in single:
        assert torch.equal(single[k], split[k]), k
    shards = reader.read_model(tiny.split_first)
    assert len(shards) >= 2 and "general.architecture" not in shards[1].metadata


def test_kv_b_rebuild_is_the_inverse_of_llama_cpp_split():
    # llama.cpp (convert_hf_to_gguf, DeepseekV2Model.modify_tensors): view per head, split
    # [nope, v], transpose k_b -> attn_k_b [H, kv_lora, nope], attn_v_b [H, v, kv_lora]
    H, nope, v, kv_lora = 3, 5, 7, 11
    kv_b = torch.randn(H * (nope + v), kv_lora)
    per_head = kv_b.view(H, nope + v, kv_lora)
    k_b, v_b = torch.split(per_head, [nope, v], dim=1)
    k_b = k_b.transpose(1, 2)
    assert torch.equal(weights.kv_b_from_parts(k_b.contiguous(), v_b.contiguous()), kv_b)


CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "num_nextn_predict_layers", "num_attention_heads",
                 "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor",
                 "norm_topk_prob", "n_group", "topk_group", "first_k_dense_replace", "q_lora_rank",
                 "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
                 "index_head_dim", "index_topk", "max_position_embeddings", "rms_norm_eps",
                 "tie_word_embeddings", "topk_method", "scoring_func", "indexer_types",
                 "indexer_rope_interleave", "bos_token_id", "hidden_act")


def test_config_from_metadata_matches_hf_config(tiny):
    headers = reader.read_model(tiny.gguf("Q4_K_M"))
    cfg = config.config_dict(headers[0].metadata, reader.merged_tensors(headers))
    for key in CONFIG_FIELDS:
        want = tiny.config[key]
        if isinstance(want, float):
            assert cfg[key] == pytest.approx(want, rel=1e-6), key
        else:
            assert cfg[key] == want, key
    assert cfg["rope_parameters"]["rope_theta"] == tiny.config["rope_parameters"]["rope_theta"]
    assert tiny.config["eos_token_id"][0] == cfg["eos_token_id"]


def test_config_without_routing_bias_is_not_noaux_tc(tiny):
    headers = reader.read_model(tiny.gguf("BF16"))
    names = [n for n in reader.merged_tensors(headers) if not n.endswith("exp_probs_b.bias")]
    assert "topk_method" not in config.config_dict(headers[0].metadata, names)


def _dequant_stream(stream):
    """Rebuild float tensors from vLLM's GGUF weight stream the way vLLM's kernels read it."""
    types, out, order = {}, {}, []
    for name, t in stream:
        order.append(name)
        if name.endswith("qweight_type"):
            assert not out, "a qweight_type came after data"
            types[name[: -len("qweight_type")]] = int(t)
            continue
        if name.endswith("qweight"):
            base = name[: -len("qweight")]
            q = gguf.GGMLQuantizationType(types[base])
            if q.name in ("F32", "F16", "BF16"):
                w = t.float()
            else:
                w = torch.from_numpy(gguf.quants.dequantize(t.numpy(), q).copy())
            out[base + "weight"] = w
        else:
            out[name] = t.float()
    return out, types


@pytest.mark.parametrize("release", ["0.16.0", "0.19.1", "0.20.0", "0.23.0", "0.26.0"])
def test_vllm_stream_quantized_and_dense_loads(tiny, release):
    path = tiny.gguf("Q4_K_M")
    m = weights.GlmDsaNameMap(path, release)
    assert m["output.weight"] == "lm_head.weight"
    assert m["blk.1.attn_k_b.weight"] == m["blk.1.attn_v_b.weight"] == "model.layers.1.self_attn.kv_b_proj.weight"
    assert m["blk.1.ffn_down_exps.weight"] == "model.layers.1.mlp.experts.0.down_proj.weight"
    assert m["blk.1.exp_probs_b.bias"] == "model.layers.1.mlp.gate.e_score_correction_bias"
    with torch.device("cpu"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            out, types = _dequant_stream(m.dsa_weights([path]))
        finally:
            torch.set_default_dtype(prev)
    ref = dict(weights.hf_tensors(path, release))
    tmap = m.dsa_weight_type_map(path)
    file_types = _types_of(path)    # gguf-py's own reading of the file
    experts_seen = 0
    for name, w in out.items():
        if ".experts.0." in name:
            n_exp = w.shape[0]
            for i in range(n_exp):
                assert torch.equal(w[i], ref[name.replace(".experts.0.", f".experts.{i}.")].to(w.dtype)), name
        else:
            assert torch.equal(w, ref[name]), name
        base = name[: -len("weight")]
        if base in types:   # qweight + qweight_type: the type map names the streamed type
            assert tmap[name] == gguf.GGMLQuantizationType(types[base]).name, name
        else:
            assert tmap[name] in ("BF16", "F32", "F16"), name
        if (e := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.0\.(gate|up|down)_proj\.weight$", name)):
            # quantized experts stream the file's own type (vLLM's GGUF MoE kernel dequantizes it)
            assert tmap[name] == file_types[f"blk.{e.group(1)}.ffn_{e.group(2)}_exps.weight"], name
            assert tmap[name] not in ("BF16", "F32", "F16"), name
            experts_seen += 1
    assert experts_seen == sum(n.endswith("_exps.weight") for n in file_types) > 0
    # the layers vLLM builds without a quant method arrive dense, whatever the file holds
    for i in range(3):
        assert tmap[f"model.layers.{i}.self_attn.kv_b_proj.weight"] == "BF16"
        assert tmap[f"model.layers.{i}.self_attn.indexer.weights_proj.weight"] in ("BF16", "F32")
    # indexer.wk: fused into wk_weights_proj (quant_config=None) from 0.20.0; indexer.wq_b: a ReplicatedLinear,
    # whose weight_loader lost its GGUF branch in 0.24.0 (a quantized wq_b failed to load on the H200, 0.26.0)
    wk, wq_b = (tmap[f"model.layers.1.self_attn.indexer.{n}.weight"] for n in ("wk", "wq_b"))
    new = tuple(int(x) for x in release.split("."))
    assert (wk == "BF16") == (new >= (0, 20, 0)), (release, wk)
    assert (wq_b == "BF16") == (new >= (0, 24, 0)), (release, wq_b)
    assert tmap["model.layers.1.mlp.gate.weight"] in ("BF16", "F32")
    # the MTP block's modules as DeepSeekMTP names them
    assert "model.layers.2.mtp_block.self_attn.kv_b_proj.weight" in tmap
    # fused shards agree (vLLM refuses a half-quantized fused layer)
    for a, b in (("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), ("mlp.gate_proj", "mlp.up_proj")):
        for i in range(3):
            ta, tb = tmap.get(f"model.layers.{i}.{a}.weight"), tmap.get(f"model.layers.{i}.{b}.weight")
            if ta and tb:
                assert (ta in ("BF16", "F32")) == (tb in ("BF16", "F32")), (i, a, ta, tb)
    # experts are always qweight + qweight_type (vLLM's GGUF MoE has no dense path)
    assert "model.layers.1.mlp.experts.0.gate_proj." in types


@pytest.mark.parametrize("tag", ["Q8_0", "Q4_K_M"])
def test_fused_shards_stream_in_shard_index_order(tiny, tag):
    """vLLM's GGUFLinearMethod.apply concatenates a fused layer's shard outputs in the order the
    shards were loaded; q_a_proj must precede kv_a_proj_with_mqa (fused_qkv_a_proj) and gate_proj
    up_proj, or the quantized model's q/kv latents are swapped (H200 run of 2026-11-29: Q8_0 top-1
    agreement 0.002 before this order was fixed)."""
    path = tiny.gguf(tag)
    m = weights.GlmDsaNameMap(path, "0.23.0")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        names = [n for n, _ in m.dsa_weights()]
    finally:
        torch.set_default_dtype(prev)
    data = [n for n in names if not n.endswith("qweight_type")]
    pos = {n.rsplit(".", 1)[0]: i for i, n in enumerate(data)}
    checked = 0
    for first, second in (("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
                          ("mlp.gate_proj", "mlp.up_proj"),
                          ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")):
        for i in range(3):
            a, b = f"model.layers.{i}.{first}", f"model.layers.{i}.{second}"
            if a in pos or b in pos:
                assert a in pos and b in pos, (a, b)
                assert pos[a] < pos[b], f"{b} streams before {a}"
                checked += 1
    assert checked >= 5
    # the quantized shards really take the GGUF path (the order matters only there)
    assert "model.layers.0.self_attn.q_a_proj.qweight" in names


def test_bf16_stream_experts_carry_a_dense_qweight_type(tiny):
    path = tiny.gguf("BF16")
    m = weights.GlmDsaNameMap(path, "0.23.0")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        stream = list(m.dsa_weights())
    finally:
        torch.set_default_dtype(prev)
    d = dict(stream)
    assert int(d["model.layers.1.mlp.experts.0.up_proj.qweight_type"]) == 30   # BF16
    w = d["model.layers.1.mlp.experts.0.up_proj.qweight"]
    assert w.dtype == torch.bfloat16 and w.shape == (8, 256, 256)
    assert d["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16


def test_non_glm_file_is_left_to_vllm(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert hooks.weights_map(tmp_path / "llama.gguf") is None
    assert hooks.config_for_gguf(str(tmp_path / "llama.gguf")) is None
    assert not tensors.is_glm_dsa(tmp_path / "nonexistent.gguf")


@pytest.mark.parametrize("version, rules", [("0.16.0", "0.16.0"), ("0.19.1", "0.16.0"), ("0.20.0", "0.20.0"),
                                            ("0.23.0", "0.20.0"), ("0.24.0", "0.24.0"), ("0.26.0", "0.24.0"),
                                            ("0.33.0", "0.24.0"), ("0.26.1+cu130", "0.24.0"), ("0.15.1", "0.16.0")])
def test_dense_rules_follow_the_release(version, rules):
    """The dense-load rules of the newest release not after the running one (older than every key: the oldest)."""
    assert weights.release_rules(version) == rules

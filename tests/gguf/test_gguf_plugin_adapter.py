"""The glm-dsa adapter for vllm-gguf-plugin (vLLM >= 0.24) on llama.cpp-made files, without vLLM: what
the plugin's loader takes from it (``load_spec``, the weight stream) checked against gguf-py's own reading
of the file. The same adapter inside the plugin's loader in a real vLLM 0.26.0 venv:
tests/gguf/test_vllm_plugin.py."""
from __future__ import annotations

import types

import gguf
import numpy as np
import pytest
import torch

from overlay.gguf import plugin, reader, weights

from . import ggufbytes as gb
from .test_gguf_glm_dsa import _dequant_stream


class _Cfg(types.SimpleNamespace):
    def update(self, d):
        self.__dict__.update(d)


def _model_config():
    return types.SimpleNamespace(hf_config=_Cfg(model_type="glm_moe_dsa", tie_word_embeddings=False))


def _load(path):
    """What the plugin's GGUFModelLoader does with an adapter: matches, prepare_loading, prepare_weights."""
    mc = _model_config()
    assert plugin.GlmDsaGGUFAdapter.matches(mc.hf_config)
    adapter = plugin.GlmDsaGGUFAdapter(mc.hf_config)
    spec = adapter.prepare_loading(path, mc)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)     # the plugin loads under set_default_torch_dtype(model dtype)
    try:
        stream = list(adapter.prepare_weights(mc))
    finally:
        torch.set_default_dtype(prev)
    return mc, spec, stream


def _reader_tensors(paths):
    """gguf-py's view of every tensor: name -> (ggml type name, float32 HF-order values, raw data)."""
    out = {}
    for p in paths:
        for t in gguf.GGUFReader(p).tensors:
            shape = tuple(int(x) for x in reversed(t.shape))
            if t.tensor_type.name == "BF16":
                vals = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif t.tensor_type.name in ("F32", "F16"):
                vals = np.asarray(t.data, dtype=np.float32)
            else:
                vals = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            out[t.name] = (t.tensor_type.name, torch.from_numpy(np.array(vals, np.float32).reshape(shape)),
                           np.asarray(t.data))
    return out


def test_matches_only_glm_moe_dsa():
    assert plugin.GlmDsaGGUFAdapter.matches(types.SimpleNamespace(model_type="glm_moe_dsa"))
    for other in ("deepseek_v3", "deepseek_v32", "gemma3", None):
        assert not plugin.GlmDsaGGUFAdapter.matches(types.SimpleNamespace(model_type=other))


def test_bf16_stream_is_the_hf_checkpoint(tiny, tiny_ref):
    """BF16: every tensor of the original safetensors checkpoint, exactly, under its HF name."""
    _, spec, stream = _load(tiny.gguf("BF16"))
    got, _ = _dequant_stream(stream)
    assert spec.weights_source == [tiny.gguf("BF16")]
    n_exp = tiny.config["n_routed_experts"]
    flat = {}
    for name, w in got.items():
        if ".experts.0." in name:
            for i in range(n_exp):
                flat[name.replace(".experts.0.", f".experts.{i}.")] = w[i]
        else:
            flat[name] = w
    hf = {n: t for n, t in tiny_ref.items()}
    assert set(flat) == set(hf)
    for name, ref in hf.items():
        assert flat[name].shape == ref.shape and torch.equal(flat[name].float(), ref.float()), name


@pytest.mark.parametrize("tag", ["BF16", "Q8_0", "Q4_K_M"])
def test_stream_against_gguf_py(tiny, tag):
    """Names, shapes and values of every load against gguf-py's reading of the same file; quantized
    loads carry the file's bytes and ggml type; kv_b is rebuilt from attn_k_b/attn_v_b."""
    path = tiny.gguf(tag)
    mc, spec, stream = _load(path)
    ref = _reader_tensors([path])
    names = [n for n, _ in stream]
    first_data = next(i for i, n in enumerate(names) if not n.endswith("qweight_type"))
    assert all(not n.endswith("qweight_type") for n in names[first_data:]), "a qweight_type after data"
    assert len(set(names)) == len(names)
    qtypes = {n[: -len("qweight_type")]: int(t) for n, t in stream if n.endswith("qweight_type")}
    inv = {}
    for g, h in spec.gguf_to_hf_name_map.items():
        inv.setdefault(h, []).append(g)
    checked = set()
    for name, t in stream:
        if name.endswith("qweight_type"):
            continue
        base = name[: -len("qweight")] if name.endswith("qweight") else name[: -len("weight")]
        hf = base + "weight" if name.endswith("qweight") else name
        srcs = sorted(inv[hf])
        if hf.endswith("kv_b_proj.weight"):
            (kb, kt), (vb, vt) = [ref[s][:2] for s in srcs]    # attn_k_b, attn_v_b
            h, kv_lora, nope = kt.shape
            want = torch.cat([kt.transpose(1, 2), vt], dim=1).reshape(-1, kv_lora)
            assert t.dtype in (torch.bfloat16, torch.float32) and torch.equal(t.float(), want), hf
            assert base not in qtypes
        else:
            (src,) = srcs
            ftype, vals, raw = ref[src]
            if base in qtypes and ftype not in ("F32", "F16", "BF16") and qtypes[base] == gguf.GGMLQuantizationType[ftype]:
                assert t.dtype == torch.uint8 and np.array_equal(t.numpy().reshape(raw.shape), raw), hf
            elif ftype in ("F32", "F16", "BF16") or ".experts." not in hf:
                assert torch.equal(t.float(), vals), hf    # dense: gguf-py's values exactly
            else:
                assert torch.equal(t.float(), vals.to(t.dtype).float()), hf
            assert tuple(t.shape[: len(vals.shape)]) == tuple(vals.shape) or t.dtype == torch.uint8, hf
        checked.add(hf)
    assert {h for h in inv if h != "lm_head.weight" or "output.weight" in ref} <= checked | {"lm_head.weight"}
    assert "model.layers.1.self_attn.kv_b_proj.weight" in checked
    # what vLLM builds unquantized: the layers it makes without a quant method, plus dense loads
    for must in ("model.layers.1.self_attn.kv_b_proj", "model.layers.1.mlp.gate",
                 "model.layers.1.self_attn.indexer.wk", "model.layers.1.self_attn.indexer.weights_proj",
                 "model.layers.2.eh_proj"):
        assert must in spec.unquantized_modules, must
    if tag == "BF16":
        assert not any(t.dtype == torch.uint8 for _, t in stream), "a BF16 file streams no quantized bytes"
    else:
        assert "model.layers.1.self_attn.q_b_proj" not in spec.unquantized_modules
    assert mc.hf_config.tie_word_embeddings is False    # output.weight is in the file


def test_split_loads_like_the_single_file(tiny):
    _, spec1, one = _load(tiny.gguf("Q4_K_M"))
    _, spec6, six = _load(tiny.split_first)
    assert len(spec6.weights_source) == 6 and spec6.weights_source[0] == tiny.split_first
    assert sorted(spec1.unquantized_modules) == sorted(spec6.unquantized_modules)
    a, b = dict(one), dict(six)
    assert sorted(a) == sorted(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n


def _adapter_error(path) -> str:
    with pytest.raises(reader.GGUFError) as exc:
        plugin.GlmDsaGGUFAdapter(_model_config().hf_config).prepare_loading(str(path), _model_config())
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_missing_tensor_is_one_line(tmp_path):
    p = tmp_path / "m.gguf"
    gb.glm_dsa_file(p, drop=("blk.2.attn_q_b.weight",))
    c = gb.SMALL
    h = c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    assert _adapter_error(p) == (f"{p}: tensor blk.2.attn_q_b.weight missing (expected shape "
                                 f"[{h}, {c['q_lora_rank']}])")


def test_wrong_shape_is_one_line(tmp_path):
    p = tmp_path / "s.gguf"
    ts = [(n, (shape[0] + 1, *shape[1:]) if n == "blk.1.attn_output.weight" else shape, t)
          for n, shape, t in gb.glm_dsa_tensors(gb.SMALL)]
    gb.write(p, gb.glm_dsa_meta(gb.SMALL), ts)
    c = gb.SMALL
    want = [c["hidden_size"], c["num_attention_heads"] * c["v_head_dim"]]
    assert _adapter_error(p) == (f"{p}: tensor blk.1.attn_output.weight has shape [{want[0] + 1}, {want[1]}], "
                                 f"expected {want}")


def test_missing_kv_b_half_and_several_problems(tmp_path):
    p = tmp_path / "k.gguf"
    gb.glm_dsa_file(p, drop=("blk.0.attn_v_b.weight",))
    assert _adapter_error(p) == f"{p}: blk.0.attn_k_b.weight: its partner blk.0.attn_v_b.weight is missing"
    p2 = tmp_path / "two.gguf"
    gb.glm_dsa_file(p2, drop=("blk.1.ffn_norm.weight", "blk.2.ffn_norm.weight"))
    assert _adapter_error(p2).endswith(" (and 1 more; run check-gguf)")


def test_not_a_glm_dsa_file_is_one_line(tmp_path):
    p = tmp_path / "d.gguf"
    gb.glm_dsa_file(p, arch="deepseek2")
    assert _adapter_error(p) == (f"{p}: the model config is glm_moe_dsa, but this file's architecture is not "
                                 f"'glm-dsa'; pass a llama.cpp glm-dsa GGUF (python apply.py check-gguf {p})")


def test_register_without_the_plugin_or_its_entry_point():
    """No `gguf` general plugin loaded (absent, or left out by VLLM_PLUGINS): nothing to register."""
    assert plugin.register({}) is False
    assert plugin.register({"other": print}) is False


def test_model_sources_leave_other_models_alone(tmp_path):
    for model in ("org/model", str(tmp_path), str(tmp_path / "missing.gguf"), None, 3):
        assert plugin.model_sources(model, None, None) == {}
    p = tmp_path / "d.gguf"
    gb.glm_dsa_file(p, arch="deepseek2")
    assert plugin.model_sources(str(p), None, None) == {}


# ------------------------------------------------------------------------------------------ row padding
def _storage_tail(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t`'s storage past its own last element."""
    whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    end = (t.storage_offset() + t.numel()) * t.element_size()
    return whole[end:]


def _quantized(rows, cols, qtype, seed=0):
    """Real llama.cpp blocks (gguf-py's quantizer): [rows, bytes per row] uint8 and the dequantized values."""
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal((rows, cols)).astype(np.float32)
    q = gguf.quants.quantize(vals, qtype)
    return torch.from_numpy(np.ascontiguousarray(q)), gguf.quants.dequantize(q, qtype)


class _WType(torch.nn.Parameter):
    """Like the plugin's materialized GGUFUninitializedWeightTypeParameter: an int `weight_type` and the
    per-shard types of a merged weight."""


def _wtype(t, shards=None):
    p = _WType(torch.tensor([int(t)], dtype=torch.uint8), requires_grad=False)
    p.weight_type = int(t)
    p.shard_weight_type = shards or {}
    return p


def _layer(**params):
    m = torch.nn.Module()
    for k, v in params.items():
        m.register_parameter(k, v if isinstance(v, torch.nn.Parameter) else torch.nn.Parameter(v, requires_grad=False))
    return m


def test_quantized_weights_with_short_rows_get_llama_cpp_row_padding():
    """A row not a multiple of 512 elements (llama.cpp's MATRIX_ROW_PADDING) gets 512 elements' worth of zero
    bytes after the tensor, as llama.cpp allocates it; values, shape and Parameter identity stay."""
    Q8, Q4K, BF16 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.BF16
    q_b, q_b_vals = _quantized(48, 32, Q8)            # the H200 fixture's q_b_proj rows: one Q8_0 block
    wide, _ = _quantized(8, 1024, Q8)                 # two whole row paddings: nothing to do
    k4 = torch.randint(0, 256, (6, 144), dtype=torch.uint8)   # one Q4_K super-block per row (gguf-py cannot
                                                              # make Q4_K; padding does not read the values)
    experts, _ = _quantized(4 * 5, 96, Q8)
    model = torch.nn.Module()
    model.q_b_proj = _layer(qweight=q_b.clone(), qweight_type=_wtype(Q8))
    model.wide = _layer(qweight=wide.clone(), qweight_type=_wtype(Q8))
    model.k4 = _layer(qweight=k4.clone(), qweight_type=_wtype(Q4K))
    model.dense = _layer(qweight=torch.zeros(4, 64, dtype=torch.uint8), qweight_type=_wtype(BF16))
    model.experts = _layer(w13_qweight=experts.clone().view(4, 5, -1), w13_qweight_type=_wtype(Q8),
                           w2_qweight=experts.clone().view(4, 5, -1)[:, :3].contiguous(),
                           w2_qweight_type=_wtype(Q8))
    model.merged = _layer(qweight=torch.cat([q_b[:4], torch.zeros(4, 34, dtype=torch.uint8)]),
                          qweight_type=_wtype(Q8, {"q": int(Q8), "k": int(Q4K)}))
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():   # poison what follows each tensor, as the allocator may
        if n.endswith("qweight"):
            p.data = torch.cat([p.detach().reshape(-1), torch.full((4096,), 0xFF, dtype=torch.uint8)])[
                :p.numel()].view(p.shape)
    assert (_storage_tail(model.q_b_proj.qweight) == 0xFF).all()

    padded = plugin.pad_quantized_rows(model)

    assert sorted(padded) == ["experts.w13_qweight", "experts.w2_qweight", "k4.qweight", "merged.qweight",
                              "q_b_proj.qweight"]
    assert (_storage_tail(model.wide.qweight) == 0xFF).all()          # left alone
    assert (_storage_tail(model.dense.qweight) == 0xFF).all()
    for name, size in (("q_b_proj.qweight", 16 * 34), ("k4.qweight", 2 * 144), ("experts.w13_qweight", 16 * 34),
                       ("merged.qweight", 16 * 34)):    # merged: its shard type with most bytes per 512 elements
        p = model.get_parameter(name)
        tail = _storage_tail(p)
        assert tail.numel() == size and (tail == 0).all(), name
    for n, (param, value) in before.items():
        assert model.get_parameter(n) is param and torch.equal(param, value), n
    assert np.array_equal(gguf.quants.dequantize(model.q_b_proj.qweight.numpy(), Q8), q_b_vals)


def test_the_plugin_loaders_load_model_pads_glm_dsa_models_only_and_is_wrapped_once():
    Q8 = gguf.GGMLQuantizationType.Q8_0
    q, _ = _quantized(4, 32, Q8)
    models = {}
    for kind in ("glm_moe_dsa", "llama"):
        models[kind] = torch.nn.Module()
        models[kind].a = _layer(qweight=q.clone(), qweight_type=_wtype(Q8))
    storage = {k: m.a.qweight.untyped_storage().data_ptr() for k, m in models.items()}

    class Loader:
        calls = 0

        def load_model(self, vllm_config, model_config, prefix=""):
            Loader.calls += 1
            return models[model_config.hf_config.model_type]

    plugin._wrap_load_model(Loader)
    plugin._wrap_load_model(Loader)
    glm = types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="glm_moe_dsa"))
    llama = types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="llama"))
    assert Loader().load_model(None, glm) is models["glm_moe_dsa"] and Loader.calls == 1
    assert Loader().load_model(None, model_config=llama) is models["llama"] and Loader.calls == 2
    assert Loader.load_model.__wrapped__.__name__ == "load_model"
    padded, other = models["glm_moe_dsa"].a.qweight, models["llama"].a.qweight
    assert padded.untyped_storage().data_ptr() != storage["glm_moe_dsa"]
    tail = _storage_tail(padded)
    assert tail.numel() == 16 * 34 and (tail == 0).all() and torch.equal(padded, q)
    assert other.untyped_storage().data_ptr() == storage["llama"] and _storage_tail(other).numel() == 0

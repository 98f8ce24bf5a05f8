"""check-gguf: passes on real llama.cpp files, names the problem on broken ones, reads headers only."""
from __future__ import annotations

import os
import shutil
import struct
import time

import pytest
from click.testing import CliRunner

from dsa_installer.gguf_check import check_gguf
from overlay.gguf import reader, tensors


def run(*args):
    res = CliRunner().invoke(check_gguf, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output


@pytest.mark.parametrize("tag", ["BF16", "Q8_0", "Q4_K_M"])
def test_passes_on_fixtures(tiny, tag):
    code, out = run(tiny.gguf(tag), "--hf-config-path", tiny.hf)
    assert code == 0, out
    assert "check-gguf: OK" in out and "PROBLEM" not in out
    assert "layers: 2 (1 dense, 1 MoE)" in out
    assert "indexer (DSA): 4 heads x 32, top-k 8" in out
    assert "MTP: 1 NextN layer(s)" in out
    assert "bytes per ggml type:" in out and (tag in out or tag == "Q4_K_M")


def test_passes_on_split(tiny):
    code, out = run(tiny.split_first)
    assert code == 0, out
    assert "shards)" in out


def _problems(out):
    return [l for l in out.splitlines() if l.startswith("PROBLEM ")]


def test_truncated_file(tiny, tmp_path):
    p = tmp_path / "trunc.gguf"
    shutil.copy(tiny.gguf("Q4_K_M"), p)
    size = p.stat().st_size
    os.truncate(p, size - 1000)
    code, out = run(p)
    assert code == 1
    probs = _problems(out)
    assert len(probs) == 1 and "truncated" in probs[0] and str(p) in probs[0] and "1000 missing" in probs[0]
    # the tensor that ends last is named
    last = max(reader.read_header(tiny.gguf("Q4_K_M")).tensors.values(), key=lambda t: t.offset + t.nbytes)
    assert f"tensor {last.name} ends" in probs[0]


def test_missing_shard(tiny, tmp_path):
    for s in tiny.info["split"]:
        shutil.copy(tiny.root / s, tmp_path)
    names = sorted(os.listdir(tmp_path))
    os.remove(tmp_path / names[1])
    code, out = run(tmp_path / names[0])
    assert code == 1
    probs = _problems(out)
    assert any(names[1] in p and "shard missing" in p for p in probs), out


def _rename_tensor(src, dst, old: str, new: str):
    raw = bytearray(open(src, "rb").read())
    i = raw.index(old.encode() + b"")
    assert len(old) == len(new)
    raw[i:i + len(old)] = new.encode()
    open(dst, "wb").write(raw)


def test_missing_tensor(tiny, tmp_path):
    p = tmp_path / "missing.gguf"
    _rename_tensor(tiny.gguf("Q8_0"), p, "blk.1.attn_v_b.weight", "blk.1.attn_v_X.weight")
    code, out = run(p)
    assert code == 1
    probs = _problems(out)
    assert any("tensor blk.1.attn_v_b.weight missing" in l for l in probs), out
    assert any("attn_k_b" in l and "partner" in l for l in probs), out


def test_wrong_shape(tiny, tmp_path):
    # an embedding the size of another model: swap the n_embd of token_embd in the tensor info
    hf = dict(tiny.config)
    d = tmp_path / "cfg"
    d.mkdir()
    hf["kv_lora_rank"] = 512
    import json
    (d / "config.json").write_text(json.dumps(hf))
    code, out = run(tiny.gguf("BF16"), "--hf-config-path", d)
    assert code == 1
    assert any("kv_lora_rank = 512 but the GGUF says 64" in l for l in _problems(out)), out


# --- a synthetic GLM-5-sized header (real dimensions), written sparse: proves no data is read ---

def _gguf_header(path, arch, meta: dict, infos: list[tuple[str, tuple, int]], extra_bytes=0):
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    def kv(k, v) -> bytes:
        if isinstance(v, bool):
            return s(k) + struct.pack("<IB", 7, v)
        if isinstance(v, int):
            return s(k) + struct.pack("<II", 4, v)
        if isinstance(v, float):
            return s(k) + struct.pack("<If", 6, v)
        if isinstance(v, str):
            return s(k) + struct.pack("<I", 8) + s(v)
        if isinstance(v, list):
            return s(k) + struct.pack("<IIQ", 9, 7, len(v)) + bytes(int(b) for b in v)
        raise TypeError(v)

    meta = {"general.architecture": arch, **meta}
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(meta)))
    for k, v in meta.items():
        out += kv(k, v)
    off = 0
    for name, shape, t in infos:
        _, block, size = reader.GGML_TYPES[t]
        n = 1
        for d in shape:
            n *= d
        nbytes = n // block * size
        out += s(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *reversed(shape))
        out += struct.pack("<IQ", t, off)
        off += (nbytes + 31) // 32 * 32
    data_start = (len(out) + 31) // 32 * 32
    with open(path, "wb") as f:
        f.write(out)
    os.truncate(path, data_start + off + extra_bytes)    # sparse: no data blocks on disk


GLM5 = dict(hidden_size=6144, vocab_size=154880, num_hidden_layers=78, num_nextn_predict_layers=1,
            num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64,
            qk_nope_head_dim=192, v_head_dim=256, n_routed_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=2048, intermediate_size=12288, n_shared_experts=1,
            first_k_dense_replace=3, index_n_heads=32, index_head_dim=128, index_topk=2048)


def _glm5_like(path, arch="glm-dsa", drop=(), expert_type=12):
    c = GLM5
    a = arch
    meta = {f"{a}.block_count": c["num_hidden_layers"] + 1, f"{a}.nextn_predict_layers": 1,
            f"{a}.context_length": 202752, f"{a}.embedding_length": c["hidden_size"],
            f"{a}.feed_forward_length": c["intermediate_size"], f"{a}.attention.head_count": 64,
            f"{a}.attention.head_count_kv": 1, f"{a}.expert_count": 256, f"{a}.expert_used_count": 8,
            f"{a}.expert_shared_count": 1, f"{a}.expert_feed_forward_length": 2048,
            f"{a}.leading_dense_block_count": 3, f"{a}.attention.q_lora_rank": 2048,
            f"{a}.attention.kv_lora_rank": 512, f"{a}.rope.dimension_count": 64,
            f"{a}.attention.key_length_mla": 256, f"{a}.attention.value_length_mla": 256,
            f"{a}.attention.indexer.head_count": 32, f"{a}.attention.indexer.key_length": 128,
            f"{a}.attention.indexer.top_k": 2048, f"{a}.vocab_size": 154880,
            f"{a}.expert_gating_func": 2, f"{a}.expert_weights_scale": 2.5, f"{a}.expert_weights_norm": True,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.rope.freq_base": 1000000.0}
    # the tensor set from the runtime table (the llama.cpp fixtures prove the table; this file proves speed)
    infos = []
    for name, want in tensors.expected_tensors(c, ()).items():
        if name in drop or (want.optional and name != "output.weight"):
            continue
        shape = want.shape
        t = 0 if len(shape) == 1 else (expert_type if "_exps" in name else 12 if shape[-1] % 256 == 0 else 8)
        infos.append((name, shape, t))
    _gguf_header(path, arch, meta, infos)


def test_glm5_sized_sparse_file_checks_in_seconds(tmp_path):
    p = tmp_path / "GLM-5-UD-Q4_K_XL.gguf"
    _glm5_like(p)
    size = p.stat().st_size
    assert size > 300 * 2**30, "the synthetic GLM-5 should be the real size"
    t0 = time.perf_counter()
    code, out = run(p)
    elapsed = time.perf_counter() - t0
    assert code == 0, out
    assert "layers: 78 (3 dense, 75 MoE)" in out and "MTP: 1 NextN" in out
    assert "indexer (DSA): 32 heads x 128, top-k 2048" in out
    assert elapsed < 20, f"check-gguf took {elapsed:.1f}s on a {size / 2**30:.0f} GiB file"


def test_wrong_architecture(tmp_path):
    p = tmp_path / "deepseek.gguf"
    _glm5_like(p, arch="deepseek2")
    code, out = run(p)
    assert code == 1
    probs = _problems(out)
    assert len(probs) == 1 and "architecture 'deepseek2', expected 'glm-dsa'" in probs[0]


def test_unsupported_expert_type_and_missing_indexer(tmp_path):
    p = tmp_path / "odd.gguf"
    _glm5_like(p, drop=("blk.40.indexer.proj.weight",), expert_type=99 if False else 34)   # TQ1_0
    code, out = run(p, "-v")
    probs = _problems(out)
    assert code == 1
    assert any("tensor blk.40.indexer.proj.weight missing (expected shape [32, 6144])" in l for l in probs)
    # TQ1_0 experts: no vLLM kernel; gguf-py can dequantize them -> a note, not a problem
    assert any("ffn_up_exps.weight: ggml type TQ1_0 is dequantized at load" in l for l in out.splitlines())

"""check-gguf: passes on real llama.cpp files, names the problem on broken ones, reads headers only."""
from __future__ import annotations

import os
import shutil
import struct
import time

import pytest
from click.testing import CliRunner

from dsa_installer.gguf_check import check_gguf
from overlay.gguf import reader

from . import ggufbytes


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


def _split_copy(tiny, tmp_path) -> list:
    for sh in tiny.info["split"]:
        shutil.copy(tiny.root / sh, tmp_path)
    return sorted(tmp_path.iterdir())


def test_missing_shard(tiny, tmp_path):
    parts = _split_copy(tiny, tmp_path)
    os.remove(parts[1])
    code, out = run(parts[0])
    assert code == 1
    assert _problems(out) == [f"PROBLEM {parts[1]}: shard missing ({len(parts)} expected); download every -of- "
                              f"part into {tmp_path}"]


def _patch(src, dst, find: bytes, at: int, new: bytes):
    """Copy src to dst with ``new`` written ``at`` bytes after the first occurrence of ``find``."""
    raw = bytearray(open(src, "rb").read())
    i = raw.index(find) + at
    raw[i:i + len(new)] = new
    open(dst, "wb").write(raw)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_wrong_split_count(tiny, tmp_path):
    parts = _split_copy(tiny, tmp_path)
    # llama-gguf-split writes split.count as a u16 (type id 2) in every part
    count_at = open(parts[0], "rb").read().index(_key("split.count"))
    vtype, count = struct.unpack_from("<IH", open(parts[0], "rb").read(), count_at + len(_key("split.count")))
    assert (vtype, count) == (2, len(parts))
    _patch(parts[0], parts[0], _key("split.count"), len(_key("split.count")) + 4, struct.pack("<H", count + 1))
    code, out = run(parts[0])
    assert code == 1
    assert _problems(out) == [f"PROBLEM {parts[0]}: split.count is {count + 1} but the file name says "
                              f"{len(parts)} shards"]


def _tensor_info_at(path, name: str) -> int:
    """Byte offset of the tensor info that follows the tensor name ``name`` (n_dims, ne[], type, offset)."""
    raw = open(path, "rb").read()
    return raw.index(_key(name)) + len(_key(name))


def test_wrong_shape(tiny, tmp_path):
    # one dimension of a real tensor info made smaller (the data stays inside the file)
    src, p = tiny.gguf("BF16"), tmp_path / "shape.gguf"
    name = "blk.0.attn_kv_a_mqa.weight"
    at = _tensor_info_at(src, name)
    n_dims, ne0, ne1 = struct.unpack_from("<IQQ", open(src, "rb").read(), at)
    c = tiny.config
    assert (n_dims, ne0, ne1) == (2, c["hidden_size"], c["kv_lora_rank"] + c["qk_rope_head_dim"])
    _patch(src, p, _key(name), len(_key(name)) + 4 + 8, struct.pack("<Q", ne1 - 1))
    code, out = run(p)
    assert code == 1
    assert _problems(out) == [f"PROBLEM {p}: tensor {name} has shape [{ne1 - 1}, {ne0}], expected [{ne1}, {ne0}]"]


def test_unusable_type(tiny, tmp_path):
    # BF16 -> I16 (ggml type 25): the same bytes per element, a type neither vLLM nor gguf-py decodes
    src, p = tiny.gguf("BF16"), tmp_path / "type.gguf"
    name = "blk.0.attn_output.weight"
    at = _tensor_info_at(src, name)
    n_dims, = struct.unpack_from("<I", open(src, "rb").read(), at)
    type_at = 4 + 8 * n_dims
    assert struct.unpack_from("<I", open(src, "rb").read(), at + type_at) == (30,)   # BF16
    _patch(src, p, _key(name), len(_key(name)) + type_at, struct.pack("<I", 25))
    code, out = run(p)
    assert code == 1
    assert _problems(out) == [f"PROBLEM {p}: tensor {name} has ggml type I16, which neither vLLM's GGUF "
                              "kernels nor gguf-py's dequantizer support; re-quantize it"]


def test_missing_tensor(tiny, tmp_path):
    p = tmp_path / "missing.gguf"
    _patch(tiny.gguf("Q8_0"), p, b"blk.1.attn_v_b.weight", 0, b"blk.1.attn_v_X.weight")
    code, out = run(p)
    assert code == 1
    probs = _problems(out)
    assert any("tensor blk.1.attn_v_b.weight missing" in l for l in probs), out
    assert any("attn_k_b" in l and "partner" in l for l in probs), out


def test_hf_config_mismatch(tiny, tmp_path):
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

def test_glm5_sized_sparse_file_checks_in_seconds(tmp_path):
    p = tmp_path / "GLM-5-UD-Q4_K_XL.gguf"
    ggufbytes.glm_dsa_file(p, ggufbytes.GLM5)
    size = p.stat().st_size
    assert size > 300 * 2**30, "the synthetic GLM-5 should be the real size"
    t0 = time.perf_counter()
    code, out = run(p)
    elapsed = time.perf_counter() - t0
    assert code == 0, out
    assert "layers: 78 (3 dense, 75 MoE)" in out and "MTP: 1 NextN" in out
    assert "indexer (DSA): 32 heads x 128, top-k 2048" in out
    assert elapsed < 2, f"check-gguf took {elapsed:.1f}s on a {size / 2**30:.0f} GiB file"


def test_wrong_architecture(tmp_path):
    p = tmp_path / "deepseek.gguf"
    ggufbytes.glm_dsa_file(p, ggufbytes.GLM5, arch="deepseek2")
    code, out = run(p)
    assert code == 1
    probs = _problems(out)
    assert len(probs) == 1 and "architecture 'deepseek2', expected 'glm-dsa'" in probs[0]


def test_unsupported_expert_type_and_missing_indexer(tmp_path):
    p = tmp_path / "odd.gguf"
    ggufbytes.glm_dsa_file(p, ggufbytes.GLM5, drop=("blk.40.indexer.proj.weight",), expert_type="TQ1_0")
    code, out = run(p, "-v")
    probs = _problems(out)
    assert code == 1
    assert any("tensor blk.40.indexer.proj.weight missing (expected shape [32, 6144])" in l for l in probs)
    # TQ1_0 experts: no vLLM kernel; gguf-py can dequantize them -> a note, not a problem
    assert any("ffn_up_exps.weight: ggml type TQ1_0 is dequantized at load" in l for l in out.splitlines())

"""The patched vLLM on CPU: this branch's diffs + overlay staged over a real vLLM install
(the engine applies it to a hard-linked copy, see tests/vllm_envs.py), run in that install's interpreter with the stub libcuda.

One real venv per release of manifest.VENV_RELEASES (one per family). Skipped, with the reason shown, when
the vLLM venv or the stub is not on this machine (a failure under CI=true)."""

import json
import subprocess
import textwrap

import pytest

from dsa_installer import engine, manifest
from tests import vllm_envs


@pytest.fixture(scope="module", params=manifest.VENV_RELEASES)
def staged(request, tmp_path_factory):
    """(python, patched site, env): the overlay applied by the engine to a hard-linked copy of a real vLLM."""
    return vllm_envs.patched_site(request.param, tmp_path_factory.mktemp(f"vllm{request.param}"))


def run_python(staged, code, env_extra=None, timeout=300):
    python, root, env = staged
    return subprocess.run([str(python), "-c", code], env=dict(env, **(env_extra or {})), capture_output=True,
                          text=True, timeout=timeout, cwd=str(root))


def run_json(staged, code, env=None):
    proc = run_python(staged, textwrap.dedent(code), env_extra=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_patched_modules_import_and_enum(staged):
    out = run_json(staged, """
        import json, vllm
        import vllm.platforms.cuda
        import vllm.model_executor.layers.sparse_attn_indexer as sai
        import vllm.v1.attention.backends.mla.indexer
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        B = E["TRITON_MLA_SPARSE"].get_class()
        # the overlay's classes and the vLLM classes each one derives from (the release's real bases)
        bases = {c.__name__: sorted({k.__module__ for k in c.__mro__[1:] if k.__module__.startswith("vllm.")})
                 for c in (B, B.get_impl_cls(), B.get_builder_cls())}
        print(json.dumps({"file": vllm.__file__, "name": B.get_name(), "path": B.__module__,
                          "sparse": B.is_sparse(), "ix": sai._dsa_ix.__name__, "bases": bases,
                          "mods": sorted({c.__module__ for c in (B, B.get_impl_cls(), B.get_builder_cls())})}))
    """)
    assert out["file"].startswith(str(staged[1]))  # the staged copy, not the venv's
    assert out == {**out, "name": "TRITON_MLA_SPARSE", "sparse": True,
                   "path": "vllm._dsa_overlay.triton_mla_sparse",
                   "ix": "vllm._dsa_overlay.indexer_ops"}
    assert out["mods"] == ["vllm._dsa_overlay.triton_mla_sparse"], out
    for name, mods in out["bases"].items():  # each derives from vLLM's own classes, not only the overlay's
        assert [m for m in mods if not m.startswith("vllm._dsa_overlay")], (name, mods)


def test_selection_table(staged):
    out = run_json(staged, """
        import json
        from vllm._dsa_overlay import verify_hooks
        rep = verify_hooks.selection_report()
        assert verify_hooks.report() == str(rep)
        print(json.dumps({"rows": rep.rows, "problems": rep.problems, "table": str(rep)}))
    """, env={"DSA_OVERLAY_PORTABLE": "0"})
    rows = {(r["cc"], r["kv_cache_dtype"], r["index_topk"]): r for r in out["rows"]}
    for cc in ("8.0", "8.6", "8.9"):
        for kv in ("auto", "bfloat16", "fp8_ds_mla"):
            assert rows[cc, kv, 2048]["default"] == "TRITON_MLA_SPARSE", out["table"]
    for cc in ("12.0", "12.1"):  # the fp8 caches at top-k 2048 per release: test_selection.test_sm12x_rows_in_real_vllm
        assert rows[cc, "bfloat16", 2048]["default"] == "TRITON_MLA_SPARSE", out["table"]
        assert rows[cc, "fp8_ds_mla", 256]["default"] == "TRITON_MLA_SPARSE", out["table"]
    for kv in ("auto", "bfloat16", "fp8_ds_mla"):
        assert rows["9.0", kv, 2048]["explicit"] == "TRITON_MLA_SPARSE"
        assert rows["9.0", kv, 2048]["portable"] == "TRITON_MLA_SPARSE"
        assert rows["9.0", kv, 2048]["default"].startswith("FLASHMLA_SPARSE")
        assert rows["9.0", kv, 200]["default"] == "TRITON_MLA_SPARSE"  # FlashMLA needs index_topk % 128 == 0
    assert out["problems"] == [], out["table"]


def test_selection_logs_one_line_why(staged):
    code = textwrap.dedent("""
        import torch
        from vllm._dsa_overlay import verify_hooks as v
        v._platform_at((8, 6)).get_attn_backend_cls(None, v._glm5_config("auto"),
                                                     **({"num_heads": 64} if "num_heads" in
                                                        __import__("inspect").signature(
                                                        v._platform_at((8, 6)).get_attn_backend_cls
                                                        ).parameters else {}))
    """)
    proc = run_python(staged, code, env_extra={"VLLM_LOGGING_LEVEL": "INFO"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in (proc.stdout + proc.stderr).splitlines() if "dsa-overlay" in l]
    assert len(lines) == 1, lines
    assert "TRITON_MLA_SPARSE" in lines[0] and "cc 8.6" in lines[0]
    assert "FLASHMLA_SPARSE: compute capability not supported" in lines[0]


BUILDER_IMPL = """
import json, math, types
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm._dsa_overlay import triton_mla_sparse as tms, triton_mla_sparse_ops as ops

def fp32_sparse_mla_standin(q, kv, indices, softmax_scale, kv_format="bf16"):
    # test-only float32 stand-in with the kernel's contract (bf16 cache)
    kv = kv.reshape(-1, kv.shape[-1])
    out = torch.zeros(q.shape[0], q.shape[1], 512)
    for t in range(q.shape[0]):
        idx = indices[t].long()
        idx = idx[(idx >= 0) & (idx < kv.shape[0])]
        if idx.numel():
            k = kv[idx].float()
            out[t] = torch.softmax(q[t].float() @ k.T * softmax_scale, -1) @ k[:, :512]
    return out.to(torch.bfloat16), None

ops._kernel = lambda: fp32_sparse_mla_standin
g = torch.Generator().manual_seed(3)
bs, H, topk = 64, 5, 9
cfg = types.SimpleNamespace(
    model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(index_topk=topk)),
    scheduler_config=types.SimpleNamespace(max_num_batched_tokens=32),
    speculative_config=None,
    parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
builder = tms.TritonMLASparseMetadataBuilder(types.SimpleNamespace(block_size=bs), ["l0"], cfg,
                                             torch.device("cpu"))
seq_lens = [70, 3]          # req 0: one decode token; req 1: a 3-token prefill
qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
block_table = torch.tensor([[4, 1], [2, 0]], dtype=torch.int32)
cm = CommonAttentionMetadata(
    query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens),
    num_reqs=2, num_actual_tokens=4, max_query_len=3, max_seq_len=70,
    block_table_tensor=block_table, slot_mapping=torch.zeros(4, dtype=torch.int64))
md = builder.build(0, cm)
indexer = types.SimpleNamespace(topk_indices_buffer=torch.full((32, topk), -1, dtype=torch.int32))
impl = tms.TritonMLASparseImpl(H, 576, 0.1, 1, None, None, "auto", None, "decoder", None,
                               indexer=indexer, kv_lora_rank=512, topk_indices_buffer=None)
cache = torch.randn(6, bs, 576, generator=g).to(torch.bfloat16)
local = indexer.topk_indices_buffer
local[0, :5] = torch.tensor([0, 63, 64, 69, 10])     # crosses into the request's 2nd block
local[1, :1] = torch.tensor([0]); local[2, :2] = torch.tensor([0, 1])
local[3, :3] = torch.tensor([2, 0, 1])
q = torch.randn(4, H, 576, generator=g).to(torch.bfloat16)
out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, md, None)
errs = []
for t, r in enumerate([0, 1, 1, 1]):
    pos = local[t][local[t] >= 0].long()
    rows = torch.stack([cache[block_table[r, p // bs], p % bs] for p in pos]).float()
    ref = torch.softmax(q[t].float() @ rows.T * 0.1, -1) @ rows[:, :512]
    # the stand-in's only error is the final bf16 rounding: relative to each element, at most 2^-9
    errs.append(((out[t].float() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item())
print(json.dumps({"req_ids": md.req_id_per_token[:4].tolist(), "tail": int(md.req_id_per_token[4:].abs().sum()),
                  "shape": list(out.shape), "lse": lse, "max_err": max(errs),
                  "cg": str(tms.TritonMLASparseMetadataBuilder.get_cudagraph_support(cfg, None))}))
"""


def test_builder_and_impl_with_standin_kernel(staged):
    out = run_json(staged, BUILDER_IMPL)
    assert out["req_ids"] == [0, 1, 1, 1] and out["tail"] == 0
    assert out["shape"] == [4, 5, 512] and out["lse"] is None
    assert out["max_err"] <= 2 ** -8  # bf16 rounding (<= 2^-9 relative) with margin; a wrong block is O(1)
    assert out["cg"].endswith("UNIFORM_BATCH")


@pytest.mark.parametrize("version", manifest.VENV_RELEASES)
def test_rollback_leaves_the_venv_bytes(version, tmp_path):
    """apply + rollback on a fresh hard-linked copy of the real install: every file is the venv's again
    (same bytes, nothing extra); only compiled caches of patched targets may be gone."""
    _, dest, _ = vllm_envs.patched_site(version, tmp_path / "site")
    _, site = vllm_envs.require(version)
    patched = {p.target: (dest / p.target).read_bytes() for p in manifest.load(version).patches}
    assert all(patched[t] != (site / t).read_bytes() for t in patched)  # applied: every target changed
    engine.rollback(dest)
    dist = f"vllm-{version}.dist-info"

    def files(root):
        return {p.relative_to(root).as_posix(): p for top in ("vllm", dist) for p in (root / top).rglob("*")
                if p.is_file() or p.is_symlink()}

    mine, theirs = files(dest), files(site)
    assert sorted(set(mine) - set(theirs)) == []
    caches = {t.rsplit("/", 1)[0] + "/__pycache__/" + t.rsplit("/", 1)[1].removesuffix(".py") for t in patched}
    gone = sorted(set(theirs) - set(mine))
    assert [g for g in gone if g.rsplit("/", 1)[0] + "/" + g.rsplit("/", 1)[1].split(".")[0] not in caches] == []
    assert [r for r in mine if not mine[r].samefile(theirs[r])  # untouched files are still the venv's inodes
            and mine[r].read_bytes() != theirs[r].read_bytes()] == []

"""The patched vLLM on CPU: this branch's diffs + overlay staged over a real vLLM install
(the engine applies it to a hard-linked copy, see tests/vllm_envs.py), run in that install's interpreter with the stub libcuda.

One real venv per release of manifest.VENV_RELEASES (one per family). Each release's interpreter runs once for
this module (PROBE: the patched modules and the backend's classes, the selection hook's log line, index_topk
outside a model config, and on releases before 0.26 the builder and impl with a stand-in kernel; every part
reports its own result or traceback), and verify.py once per session (tests/vllm_envs.py verify_json), whose
selection table the table tests read. Skipped, with the reason shown, when the vLLM venv or the stub is not on
this machine (a failure under CI=true)."""

import json
import subprocess

import pytest

from dsa_installer import engine, manifest
from tests import vllm_envs


pytestmark = pytest.mark.xdist_group("vllm-venvs")  # one worker: the probe and verify runs are shared per release


PROBE = r"""
import json, sys, traceback
out = {}

def part(name):
    def run(fn):
        try:
            out[name] = fn()
        except BaseException:
            out[name] = {"traceback": traceback.format_exc()[-4000:]}
    return run

@part("imports")
def _():
    import vllm
    import vllm.platforms.cuda
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    import vllm.v1.attention.backends.mla.indexer
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    B = E["TRITON_MLA_SPARSE"].get_class()
    # the overlay's classes and the vLLM classes each one derives from (the release's real bases)
    bases = {c.__name__: sorted({k.__module__ for k in c.__mro__[1:] if k.__module__.startswith("vllm.")})
             for c in (B, B.get_impl_cls(), B.get_builder_cls())}
    return {"file": vllm.__file__, "name": B.get_name(), "path": B.__module__, "sparse": B.is_sparse(),
            "ix": sai._dsa_ix.__name__, "bases": bases,
            "mods": sorted({c.__module__ for c in (B, B.get_impl_cls(), B.get_builder_cls())})}

@part("index_topk_absent")
def _():
    # no config in context (as in verify_hooks' table), then a config without a model
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm._dsa_overlay import selection
    outside = selection._current_index_topk()
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return [outside, selection._current_index_topk()]

@part("log_line")
def _():
    # the hook's one INFO line (vLLM's own logging, VLLM_LOGGING_LEVEL=INFO) between two markers on stdout
    import inspect
    from vllm._dsa_overlay import verify_hooks as v
    import vllm.logger
    if hasattr(vllm.logger, "configure_logging_if_needed"):  # 0.33+: the engine configures logging, not the import
        from vllm.config.logging import LoggingConfig
        vllm.logger.configure_logging_if_needed(LoggingConfig())
    platform = v._platform_at((8, 6))
    kwargs = {"num_heads": 64} if "num_heads" in inspect.signature(platform.get_attn_backend_cls).parameters else {}
    for f in (sys.stdout, sys.stderr):
        print("@@LOG-START@@", file=f, flush=True)
    picked = platform.get_attn_backend_cls(None, v._glm5_config("auto"), **kwargs)
    for f in (sys.stdout, sys.stderr):
        print("@@LOG-END@@", file=f, flush=True)
    return picked

if sys.argv[1] == "old-bases":
    @part("builder_impl")
    def _():
        scope = {"RESULT": {}}
        exec(compile(sys.argv[2], "BUILDER_IMPL", "exec"), scope)
        return scope["RESULT"]["builder_impl"]

print("@@JSON@@" + json.dumps(out))
"""


_PROBES: dict = {}


def run_probe(version, tmp_path_factory):
    """(version, {part: result or {"traceback": ...}}, the log lines between the markers, the patched site):
    PROBE in the release's interpreter, once per release."""
    if version not in _PROBES:
        python, root, env = vllm_envs.shared_site(version, tmp_path_factory)
        mode = "old-bases" if vllm_envs.release(version) < (0, 26, 0) else "shared-bases"
        proc = subprocess.run([str(python), "-c", PROBE, mode, BUILDER_IMPL],
                              env=dict(env, VLLM_LOGGING_LEVEL="INFO", DSA_OVERLAY_PORTABLE="0"),
                              capture_output=True, text=True, timeout=600, cwd=str(root))
        line = next((l for l in proc.stdout.splitlines() if l.startswith("@@JSON@@")), None)
        assert line is not None, (proc.stdout + proc.stderr)[-5000:]
        log = [l for text in (proc.stdout, proc.stderr)   # vLLM's handler writes to one of the two
               for l in text[text.find("@@LOG-START@@"):text.find("@@LOG-END@@")].splitlines()[1:]]
        _PROBES[version] = (version, json.loads(line[len("@@JSON@@"):]), log, root)
    return _PROBES[version]


@pytest.fixture(params=manifest.VENV_RELEASES)
def probe(request, tmp_path_factory):
    return run_probe(request.param, tmp_path_factory)


def part(probe, name):
    result = probe[1][name]
    assert not (isinstance(result, dict) and "traceback" in result), result.get("traceback")
    return result


def test_patched_modules_import_and_enum(probe):
    out = part(probe, "imports")
    assert out["file"].startswith(str(probe[3]))  # the staged copy, not the venv's
    assert out == {**out, "name": "TRITON_MLA_SPARSE", "sparse": True,
                   "path": "vllm._dsa_overlay.triton_mla_sparse",
                   "ix": "vllm._dsa_overlay.indexer_ops"}
    assert out["mods"] == ["vllm._dsa_overlay.triton_mla_sparse"], out
    for name, mods in out["bases"].items():  # each derives from vLLM's own classes, not only the overlay's
        assert [m for m in mods if not m.startswith("vllm._dsa_overlay")], (name, mods)


def test_index_topk_absent_in_real_vllm(probe):
    """The real vLLM: no config in context (as in verify_hooks' table), then a config without a model."""
    assert part(probe, "index_topk_absent") == [None, None]


def test_selection_logs_one_line_why(probe):
    assert part(probe, "log_line").endswith("TritonMLASparseBackend")
    lines = [l for l in probe[2] if "dsa-overlay" in l]
    assert len(lines) == 1, probe[2]
    assert "TRITON_MLA_SPARSE" in lines[0] and "cc 8.6" in lines[0]
    assert "FLASHMLA_SPARSE: compute capability not supported" in lines[0]


@pytest.fixture(params=manifest.VENV_RELEASES)
def table(request, tmp_path_factory):
    """The selection table verify.py printed in the release's own interpreter (rows keyed by cc, kv, top-k)."""
    proc, r = vllm_envs.verify_json(request.param, tmp_path_factory)
    assert r.get("hooks"), (proc.stdout + proc.stderr)[-3000:]
    assert r["hooks"]["ok"], r["hooks"]["report"]   # verify_hooks raises on a row the policy disagrees with
    rows = vllm_envs.selection_rows(r["hooks"]["report"])
    return request.param, {(x["cc"], x["kv_cache_dtype"], x["index_topk"]): x for x in rows}


def test_selection_table(table):
    version, rows = table
    for cc in ("8.0", "8.6", "8.9"):
        for kv in ("auto", "bfloat16", "fp8_ds_mla"):
            assert rows[cc, kv, 2048]["default"] == "TRITON_MLA_SPARSE", rows
    for cc in ("12.0", "12.1"):  # the fp8 caches at top-k 2048 per release: test_sm12x_rows_in_real_vllm
        assert rows[cc, "bfloat16", 2048]["default"] == "TRITON_MLA_SPARSE", rows
        assert rows[cc, "fp8_ds_mla", 256]["default"] == "TRITON_MLA_SPARSE", rows
    for kv in ("auto", "bfloat16", "fp8_ds_mla"):
        assert rows["9.0", kv, 2048]["explicit"] == "TRITON_MLA_SPARSE"
        assert rows["9.0", kv, 2048]["portable"] == "TRITON_MLA_SPARSE"
        assert rows["9.0", kv, 2048]["default"].startswith("FLASHMLA_SPARSE")
        # FlashMLA needs index_topk % 128 == 0; from 0.30.0 upstream's FlashInfer SM90 sparse backend takes the
        # bf16 caches at any top-k (the policy keeps upstream's where one validates)
        sm90_flashinfer = vllm_envs.release(version) >= (0, 30, 0) and kv != "fp8_ds_mla"
        assert rows["9.0", kv, 200]["default"] == ("FLASHINFER_MLA_SPARSE_SM90" if sm90_flashinfer
                                                   else "TRITON_MLA_SPARSE")


def _sm12x_expected(version, kv, topk):
    """Hand-written: from 0.24.0 the wheel's SM12x list has FLASHINFER_MLA_SPARSE_SM120, which takes the caches it
    stores as fp8_ds_mla (auto, fp8_ds_mla here) at index_topk 2048; before 0.24.0 SM12x has no upstream sparse
    backend. Everything else on SM12x is TRITON_MLA_SPARSE."""
    new = vllm_envs.release(version) >= (0, 24, 0)
    return "FLASHINFER_MLA_SPARSE_SM120" if new and kv in ("auto", "fp8_ds_mla") and topk == 2048 \
        else "TRITON_MLA_SPARSE"


def test_sm12x_rows_in_real_vllm(table):
    """The patched real vLLM's selection on SM12x (stub libcuda on CPU): upstream's SM120 sparse backend where
    it accepts the config (0.24.0 on), TRITON_MLA_SPARSE for a bfloat16 cache and any other index_topk; the
    switch and the explicit choice force Triton."""
    version, rows = table
    sm12x = [r for (cc, _, _), r in rows.items() if cc in ("12.0", "12.1")]
    assert len(sm12x) == 2 * 3 * 3
    for r in sm12x:
        want = _sm12x_expected(version, r["kv_cache_dtype"], r["index_topk"])
        assert (r["default"], r["portable"], r["explicit"]) == (want, "TRITON_MLA_SPARSE", "TRITON_MLA_SPARSE"), r


BUILDER_IMPL = """
import json, math, types
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm._dsa_overlay import triton_mla_sparse as tms, triton_mla_sparse_ops as ops

def fp32_sparse_mla_standin(q, kv, indices, softmax_scale, kv_format="bf16", block_table=None, req_id=None,
                            with_lse=True):
    # test-only float32 stand-in with the kernel's contract (bf16 cache); with block_table and req_id the
    # indices are request-local positions: slot = block_table[req_id[t], p // block_size] * block_size + p % bs;
    # q is one [T, H, 576] tensor or vLLM's (q_nope, q_pe) pair, as the kernel takes it; the backend wants no lse
    assert with_lse is False
    if isinstance(q, tuple):
        q = torch.cat([x.float() for x in q], -1)
    bs = kv.shape[1]
    kv = kv.reshape(-1, kv.shape[-1])
    out = torch.zeros(q.shape[0], q.shape[1], 512)
    for t in range(q.shape[0]):
        idx = indices[t].long()
        if block_table is not None:
            valid = idx >= 0
            idx = torch.where(valid, block_table[int(req_id[t])].long()[(idx.clamp_min(0) // bs)] * bs
                              + idx.clamp_min(0) % bs, torch.full_like(idx, -1))
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
RESULT["builder_impl"] = {"req_ids": md.req_id_per_token[:4].tolist(), "tail": int(md.req_id_per_token[4:].abs().sum()),
                          "shape": list(out.shape), "lse": lse, "max_err": max(errs),
                          "cg": str(tms.TritonMLASparseMetadataBuilder.get_cudagraph_support(cfg, None))}
"""


OLD_BASES = [v for v in manifest.VENV_RELEASES if vllm_envs.release(v) < (0, 26, 0)]


@pytest.mark.parametrize("version", OLD_BASES)
def test_builder_and_impl_with_standin_kernel(version, tmp_path_factory):
    """0.16-0.25 (SparseMLAAttentionImpl bases; the builder does the whole step itself). 0.26's shared
    builder and impl: tests/backend/test_vllm_sparse_bases.py."""
    r = part(run_probe(version, tmp_path_factory), "builder_impl")
    assert r["req_ids"] == [0, 1, 1, 1] and r["tail"] == 0
    assert r["shape"] == [4, 5, 512] and r["lse"] is None
    assert r["max_err"] <= 2 ** -8  # bf16 rounding (<= 2^-9 relative) with margin; a wrong block is O(1)
    assert r["cg"].endswith("UNIFORM_BATCH")


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

"""Direct launch (overlay/kernels/launch.py) against Triton's JIT entry on a CPU, with tools/fake_triton_driver.py's
stand-in driver: Triton's real binder, specialiser and kernel cache run, nothing is compiled or launched.

Not collected by the suite (no test_ prefix): Triton fixes interpreted or compiled mode when triton.language
is first imported, and the kernel tests interpret; tests/kernels/test_launch.py runs this file in a fresh
pytest process without TRITON_INTERPRET.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # pragma: no cover - a misuse, said plainly
    raise RuntimeError("tests/kernels/launch_checks.py needs compiled-mode Triton: run it without TRITON_INTERPRET")

from tools.fake_triton_driver import fake_triton  # noqa: E402
from overlay.kernels import fp8_workspace as W  # noqa: E402
from overlay.kernels import indexer as IX  # noqa: E402
from overlay.kernels import sparse_mla as SM  # noqa: E402
from overlay.kernels.launch import DirectLauncher, reset_plans  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_jit_caches():
    """Every test starts with empty Triton kernel caches (the stand-in kernels of one test never reach another)."""
    kernels = [SM._sparse_mla_fwd_kernel, SM._sparse_mla_combine_kernel, SM._request_slots_kernel,
               IX._mqa_logits_kernel, IX._paged_mqa_logits_kernel]
    for k in kernels:
        k.device_caches.clear()
    yield
    for k in kernels:
        k.device_caches.clear()


def _calls(fake, n):
    """The last n recorded launcher calls as comparable tuples (kernel, grid, stream, function, args)."""
    return [(k, grid, stream, fn, packed, args) for k, grid, stream, fn, packed, args in fake.launches[-n:]]


def _same(a, b):
    """Same kernel object, grid, stream, function handle, packed metadata and arguments (the hooks may differ:
    with none registered the direct path passes None, which the CUDA launcher skips like an empty chain)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:5] == y[:5]
        assert len(x[5]) == len(y[5])
        for u, v in zip(x[5], y[5]):
            assert (u is v) or (type(u) is type(v) and u == v), (u, v)


def _tensor(n, dtype=torch.float32, offset=0):
    base = torch.zeros(n + 64, dtype=dtype)
    return base[offset:offset + n]


# Arguments that move Triton's specialisation one way or another: alignment, ==1, %16, int width, dtype.
VARIANTS = [
    dict(x=_tensor(64), y=_tensor(64), n=64, m=7),
    dict(x=_tensor(64), y=_tensor(64), n=64, m=7),                    # same key: direct
    dict(x=_tensor(64, offset=1), y=_tensor(64), n=64, m=7),          # misaligned pointer
    dict(x=_tensor(64), y=_tensor(64), n=1, m=7),                     # == 1
    dict(x=_tensor(64), y=_tensor(64), n=48, m=16),                   # %16 on m
    dict(x=_tensor(64), y=_tensor(64), n=48, m=2 ** 31),              # i64
    dict(x=_tensor(64), y=_tensor(64), n=48, m=2 ** 63),              # u64
    dict(x=_tensor(64, torch.bfloat16), y=_tensor(64), n=64, m=7),    # dtype
    dict(x=_tensor(64), y=_tensor(64), n=64, m=-5),
    dict(x=_tensor(64, offset=1), y=_tensor(64), n=64, m=7),          # again: direct
]


def test_direct_launch_runs_the_jit_choice_with_the_jit_arguments():
    """For every variant, the direct launcher passes the launcher exactly what Triton's JIT entry passes
    (same CompiledKernel object, grid, stream, function, metadata, arguments), and launches directly once it
    has seen the key."""
    with fake_triton() as fake:
        launcher = DirectLauncher(SM._sparse_mla_combine_kernel, enabled=True)
        assert launcher.enabled, launcher.reason
        seen = set()
        for v in VARIANTS:
            args = (v["x"], v["y"], v["x"], v["y"], v["n"], v["m"], 3, 512, v["m"], 1)
            kw = dict(CHUNK_S=16, BLOCK_D=512, num_warps=4, num_stages=1)
            key = launcher.key(0, args, kw)
            before = launcher.direct_calls
            k_direct = launcher((5, 2), *args, **kw)
            got = _calls(fake, 1)
            k_jit = SM._sparse_mla_combine_kernel[(5, 2)](*args, **kw)
            want = _calls(fake, 1)
            assert k_direct is k_jit
            _same(got, want)
            launcher((5, 2), *args, **kw)
            assert launcher.direct_calls == before + (2 if key in seen else 1)
            seen.add(key)
        # one binary per distinct key: the key is exactly as fine as Triton's own cache (7 kinds here; m=-5
        # specialises like m=7)
        assert len(seen) == len(fake.compiled) == 7


def test_constexpr_and_option_changes_are_new_keys():
    with fake_triton() as fake:
        launcher = DirectLauncher(SM._sparse_mla_combine_kernel, enabled=True)
        x = _tensor(64)
        args = (x, x, x, x, 64, 7, 3, 512, 7, 1)
        k1 = launcher((1,), *args, CHUNK_S=16, BLOCK_D=512, num_warps=4, num_stages=1)
        k2 = launcher((1,), *args, CHUNK_S=32, BLOCK_D=512, num_warps=4, num_stages=1)
        k3 = launcher((1,), *args, CHUNK_S=16, BLOCK_D=512, num_warps=8, num_stages=1)
        k4 = launcher((1,), *args, CHUNK_S=16, BLOCK_D=512, num_warps=4, num_stages=1, maxnreg=128)
        assert len({id(k1), id(k2), id(k3), id(k4)}) == 4 and launcher.direct_calls == 0
        assert launcher((1,), *args, CHUNK_S=32, BLOCK_D=512, num_warps=4, num_stages=1) is k2
        # the register cap is a compile option like num_warps: kept, and launched directly on a repeat
        assert launcher((1,), *args, CHUNK_S=16, BLOCK_D=512, num_warps=4, num_stages=1, maxnreg=128) is k4
        assert launcher.direct_calls == 2 and len(fake.compiled) == 4


def test_kill_switch_and_hooks_keep_the_jit_path(monkeypatch):
    with fake_triton():
        monkeypatch.setenv("DSA_OVERLAY_DIRECT_LAUNCH", "0")
        off = DirectLauncher(SM._sparse_mla_combine_kernel)
        assert not off.enabled and "DSA_OVERLAY_DIRECT_LAUNCH=0" in off.reason
        x = _tensor(64)
        args = (x, x, x, x, 64, 7, 3, 512, 7, 1)
        for _ in range(3):
            off((1,), *args, CHUNK_S=16, BLOCK_D=512, num_warps=4, num_stages=1)
        assert off.direct_calls == 0 and off.jit_calls == 3
        on = DirectLauncher(SM._sparse_mla_combine_kernel, enabled=True)
        SM._sparse_mla_combine_kernel.add_pre_run_hook(lambda *a, **k: None)
        try:
            for _ in range(3):
                on((1,), *args, CHUNK_S=16, BLOCK_D=512, num_warps=4, num_stages=1)
            assert on.direct_calls == 0
        finally:
            SM._sparse_mla_combine_kernel.pre_run_hooks.clear()


def test_launch_hooks_see_direct_launches():
    from triton import knobs

    with fake_triton():
        launcher = DirectLauncher(SM._sparse_mla_combine_kernel, enabled=True)
        x = _tensor(64)
        args = (x, x, x, x, 64, 7, 3, 512, 7, 1)
        launcher((1,), *args, CHUNK_S=16, BLOCK_D=512, num_warps=4, num_stages=1)
        seen = []
        knobs.runtime.launch_enter_hook.add(seen.append)
        try:
            launcher((1,), *args, CHUNK_S=16, BLOCK_D=512, num_warps=4, num_stages=1)
        finally:
            knobs.runtime.launch_enter_hook.remove(seen.append)
        assert launcher.direct_calls == 1 and len(seen) == 1


@pytest.mark.parametrize("module,kernels", [(SM, 3 + SM._GLUON + SM._WS), (IX, 3 if IX._GLUON else 2), (W, 1)],
                         ids=["sparse_mla", "indexer", "fp8_workspace"])
def test_the_kernel_modules_launch_directly(module, kernels):
    """Imported as a package (as vLLM imports them), the kernel modules route every launch through a
    DirectLauncher that can launch directly (no annotated or interleaved parameters)."""
    assert len(module.LAUNCHERS) == kernels
    for launcher in module.LAUNCHERS:
        assert launcher.reason is None, launcher.reason


def _same_launches(a, b):
    """Launch records of two calls of one function: the same binary, grid, stream and metadata, the same
    input tensors, fresh output tensors of the same shape, strides and dtype, and equal scalars."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[0] is y[0] and x[1:5] == y[1:5]
        assert len(x[5]) == len(y[5])
        for u, v in zip(x[5], y[5]):
            if isinstance(u, torch.Tensor):
                assert isinstance(v, torch.Tensor) and (u is v or (u.shape, u.stride(), u.dtype) == (
                    v.shape, v.stride(), v.dtype)), (u.shape, v.shape)
            else:
                assert type(u) is type(v) and u == v, (u, v)


def _fresh_module_launchers():
    """The kernel modules' launchers and plans forget what earlier tests kept (entries of another stand-in
    driver's kernels, and that driver's bound device/stream getters)."""
    reset_plans()
    for x in SM.LAUNCHERS + IX.LAUNCHERS:
        x._cache.clear()
        x._driver = None


def _unplanned(call):
    """`call` with planning and direct launch off: what Triton's JIT entry launches for it."""
    launchers = SM.LAUNCHERS + IX.LAUNCHERS
    saved = [x.enabled for x in launchers]
    for x in launchers:
        x.enabled = False
    reset_plans()  # no launcher launches directly: planning off
    try:
        assert not SM._PLANS.on and not IX._PAGED_PLANS.on and not IX._PREFILL_PLANS.on
        return call()
    finally:
        for x, e in zip(launchers, saved):
            x.enabled = e
        reset_plans()


def _planned_repeat(fake, table, call):
    """Fresh launchers and plans, then `call` twice: the first plans (its launches go through the launchers), the
    second runs the plan. -> (the second call's launch records, its result); every one of them was direct."""
    _fresh_module_launchers()
    assert table.on
    call()
    n = len(fake.launches)
    direct = sum(x.direct_calls for x in IX.LAUNCHERS)
    result = call()
    planned = fake.launches[n:]
    assert planned and sum(x.direct_calls for x in IX.LAUNCHERS) - direct == len(planned)
    assert len(table) == 1
    return planned, result


@pytest.mark.parametrize("paged", [False, True], ids=["slot-ids", "request-local-q-pair"])
@pytest.mark.parametrize("kv_format,T", [("bf16", 1), ("bf16", 40), ("fp8_ds_mla", 3)])
def test_a_planned_repeat_call_launches_what_the_jit_entry_launches(monkeypatch, kv_format, T, paged):
    """sparse_mla_attention plans a call once per (shapes, strides, dtypes, devices): a repeat call launches
    the binaries the first call's launches were specialised to, with the arguments Triton's JIT entry
    passes for that call (1-3 launches: slot conversion outside the latency regime, attention, split merge), past
    the per-argument key. The request-local case passes q as vLLM's (q_nope, q_pe) pair of strided views, as the
    backend does."""
    monkeypatch.setattr(SM, "_device_info", lambda device: ((9, 0), 132))
    g = torch.Generator().manual_seed(T)
    H, topk = 16, 256
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    kv = (torch.randn(8, 64, 576, generator=g).to(torch.bfloat16) if kv_format == "bf16"
          else torch.randint(0, 255, (8, 64, 656), generator=g, dtype=torch.uint8))
    extra = {}
    if paged:
        idx = torch.randint(-1, 300, (T + 5, topk), generator=g, dtype=torch.int32)  # a larger buffer
        wide = torch.randn(T, H, 704, generator=g).to(torch.bfloat16)
        q = (wide[..., :512], wide[..., 640:])  # strided views of one tensor
        extra = dict(block_table=torch.randint(0, 8, (3, 6), generator=g, dtype=torch.int32),
                     req_id=torch.randint(0, 3, (T + 7,), generator=g, dtype=torch.int32))
    else:
        idx = torch.randint(-1, 512, (T, topk), generator=g, dtype=torch.int32)
        if kv_format == "fp8_ds_mla":   # strided ids: the call copies them, the plan takes the copy's row stride
            idx = torch.randint(-1, 512, (T, 2 * topk), generator=g, dtype=torch.int32)[:, ::2]

    def call():
        return SM.sparse_mla_attention(q, kv, idx, 0.07, kv_format, **extra)

    with fake_triton() as fake:
        _fresh_module_launchers()
        assert SM._PLANS.on
        call()                                   # plans; its launches go through the launchers
        assert len(SM._PLANS) == 1
        n = len(fake.launches)
        direct = [x.direct_calls for x in SM.LAUNCHERS]
        call()                                   # the plan, launching the kept binaries
        planned = fake.launches[n:]
        plan = next(iter(SM._PLANS.plans.values()))
        assert plan.inline == (paged and T < 40) and plan.convert == (paged and T == 40)  # the latency regime only
        assert len(planned) == 1 + plan.split + plan.convert
        if not paged:   # the attention launch's ids (4th tensor of 10) and their row stride (16th integer)
            a = planned[0][5]
            assert torch.equal(a[3], idx) and a[3].stride() == (topk, 1) and a[25] == topk
        assert sum(x.direct_calls for x in SM.LAUNCHERS) - sum(direct) == len(planned)
        assert len(SM._PLANS) == 1
        n = len(fake.launches)
        _unplanned(call)
        _same_launches(planned, fake.launches[n:])


def test_a_plan_checks_pointer_alignment_and_new_shapes_are_new_plans(monkeypatch):
    """The one property of an argument a plan key cannot hold is its pointer's 16-byte alignment, which Triton
    specialises on: an out= view misaligned where the kept binary assumed alignment is launched with the binary
    specialised for it, never the kept one."""
    monkeypatch.setattr(SM, "_device_info", lambda device: ((9, 0), 132))
    q = torch.randn(2, 16, 576).to(torch.bfloat16)
    kv = torch.randn(4, 64, 576).to(torch.bfloat16)
    idx = torch.randint(0, 256, (2, 64), dtype=torch.int32)
    aligned = torch.empty(2 * 16 * 512 + 8, dtype=torch.bfloat16)
    with fake_triton() as fake:
        _fresh_module_launchers()
        out_a = aligned[:2 * 16 * 512].view(2, 16, 512)
        out_m = aligned[1:1 + 2 * 16 * 512].view(2, 16, 512)   # 2 bytes off: not 16-byte aligned
        assert out_a.data_ptr() % 16 == 0 and out_m.data_ptr() % 16 != 0
        SM.sparse_mla_attention(q, kv, idx, 0.1, out=out_a)
        SM.sparse_mla_attention(q, kv, idx, 0.1, out=out_a)
        kept = fake.launches[-1][0]
        SM.sparse_mla_attention(q, kv, idx, 0.1, out=out_m)      # same plan key, other alignment
        assert len(SM._PLANS) == 1
        other = fake.launches[-1][0]
        assert other is not kept and len(fake.compiled) == 2
        n = len(fake.launches)
        _unplanned(lambda: SM.sparse_mla_attention(q, kv, idx, 0.1, out=out_m))
        assert fake.launches[-1][0] is other and len(fake.launches) == n + 1
        assert len(SM._PLANS) == 0                                # switching launchers dropped the plans
        SM.sparse_mla_attention(q, kv, idx, 0.1, out=out_a)
        SM.sparse_mla_attention(q[:1], kv, idx[:1], 0.1)          # other shapes: another plan
        assert len(SM._PLANS) == 2


@pytest.mark.parametrize("next_n,lens_2d", [(1, False), (2, True), (4, True)])
def test_a_planned_repeat_paged_logits_call_launches_what_the_jit_entry_launches(monkeypatch, next_n, lens_2d):
    """fp8_paged_mqa_logits plans like sparse_mla_attention: a repeat call launches the kept binaries (one launch
    per group of draft tokens) with the arguments Triton's JIT entry passes for it; a cache that does not start
    16-byte aligned is still refused on a planned call."""
    monkeypatch.setattr(IX, "_device_info", lambda device: ((9, 0), 132))
    # the Triton kernel's plans (this stand-in driver records Triton launches; the sm_90 Gluon kernel's direct and
    # JIT launches are compared bit for bit on the GPU: gpu_checks.py)
    monkeypatch.setattr(IX, "GLUON_DEFAULT", False)
    monkeypatch.setattr(IX, "decode_config", functools.cache(IX.decode_config.__wrapped__))   # a cache of its own
    g = torch.Generator().manual_seed(next_n)
    B, H, D, bs = 3, 32, 128, 64
    q = torch.randn(B, next_n, H, D, generator=g).to(torch.float8_e4m3fn)
    if next_n == 4:   # a q whose last dim is strided: the call copies it, the plan takes the copy's strides
        q = torch.randn(B, next_n, H, 2 * D, generator=g).to(torch.float8_e4m3fn)[..., ::2]
    cache = torch.randint(0, 255, (6 * bs * (D + 4) + 16,), generator=g, dtype=torch.uint8)
    kv = cache[:6 * bs * (D + 4)].view(6, bs, 1, D + 4)
    w = torch.randn(B * next_n, H, generator=g)
    lens = torch.randint(1, 5 * bs, (B, next_n) if lens_2d else (B,), generator=g, dtype=torch.int32)
    bt = torch.randint(0, 6, (B, 5), generator=g, dtype=torch.int32)

    def call(kv=kv):
        return IX.fp8_paged_mqa_logits(q, kv, w, lens, bt, None, 4 * bs * 2, False)

    with fake_triton() as fake:
        planned, _ = _planned_repeat(fake, IX._PAGED_PLANS, call)
        for launch in planned:   # q as the kernel reads it: its strides among the integers (after 9 others)
            a = launch[5]
            assert a[0].stride() == (next_n * H * D, H * D, D, 1) and a[15:18] == a[0].stride()[:3]
            assert torch.equal(a[0].view(torch.uint8), q.contiguous().view(torch.uint8))
        n = len(fake.launches)
        _unplanned(call)
        _same_launches(planned, fake.launches[n:])
        off = cache[1:1 + 6 * bs * (D + 4)].view(6, bs, 1, D + 4)   # same shape and strides, 1 byte off
        with pytest.raises(ValueError, match="16-byte aligned"):
            call(off)


@pytest.mark.parametrize("case", ["contiguous", "strided-k-int64-ranges", "compressed-out"])
def test_a_planned_repeat_prefill_logits_call_launches_what_the_jit_entry_launches(monkeypatch, case):
    """fp8_mqa_logits plans too (in vLLM every layer of a prefill chunk repeats the first layer's shapes): a repeat
    call launches the kept binary with the arguments Triton's JIT entry passes for it, the copies and int32
    conversions the key's strides and dtypes call for included; other shapes are another plan."""
    monkeypatch.setattr(IX, "_device_info", lambda device: ((9, 0), 132))
    g = torch.Generator().manual_seed(len(case))
    M, N, H, D = 37, 300, 32, 128
    q = torch.randn(M, H, D, generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(N, D, generator=g).to(torch.float8_e4m3fn)
    scales = torch.rand(N, 1, generator=g) + 0.5
    w = torch.randn(M, H, generator=g)
    ks = torch.randint(0, N // 2, (M,), generator=g, dtype=torch.int32)
    ke = ks + torch.randint(1, N // 2, (M,), generator=g, dtype=torch.int32)
    kw = {}
    if case == "strided-k-int64-ranges":
        k = torch.randn(N, 2 * D, generator=g).to(torch.float8_e4m3fn)[:, ::2]   # last dim not contiguous
        q = torch.randn(M, H, 2 * D, generator=g).to(torch.float8_e4m3fn)[:, :, ::2]
        ks, ke = ks.long(), ke.long()
    if case == "compressed-out":
        kw = dict(max_seqlen_k=N // 2, _out=torch.empty(M, N // 2 + 3)[:, :N // 2])

    def call(m=M, wm=M):
        return IX.fp8_mqa_logits(q[:m], (k, scales), w[:wm], ks[:m], ke[:m], False, **kw)

    with fake_triton() as fake:
        planned, logits = _planned_repeat(fake, IX._PREFILL_PLANS, call)
        assert len(planned) == 1
        a = planned[0][5]   # what the kernel gets: q, k, scales, weights, ks, ke, logits, then the integers
        width = kw.get("max_seqlen_k", N)
        if q.stride(2) == 1:
            assert a[0].data_ptr() == q.data_ptr()
        else:   # the call's copy; the plan took its strides without making one
            assert a[0].stride() == (H * D, D, 1)
            assert torch.equal(a[0].view(torch.uint8), q.contiguous().view(torch.uint8))
        assert a[1].stride() == (D, 1) and torch.equal(a[1].view(torch.uint8), k.contiguous().view(torch.uint8))
        assert a[2].shape == (N,) and a[2].data_ptr() == scales.data_ptr()
        assert a[4].dtype == a[5].dtype == torch.int32 and torch.equal(a[4], ks.int()) and torch.equal(a[5], ke.int())
        assert a[6] is logits and logits.shape == (M, width)
        assert a[7:16] == (M, N, H, H * D, D, D, H, 1, logits.stride(0)) and a[17:19] == (0, width)
        n = len(fake.launches)
        _unplanned(call)
        _same_launches(planned, fake.launches[n:])
        assert len(IX._PREFILL_PLANS) == 0   # switching launchers dropped the plans
        call()
        if "_out" not in kw:
            call(M - 5, M - 5)   # another chunk size: another plan (its checks run again)
            assert len(IX._PREFILL_PLANS) == 2
        with pytest.raises(ValueError, match=r"weights must be \[M=32"):
            call(32, M)  # a bad call is refused, planned or not


def _pdl_of(kernel) -> tuple[bool, bool]:
    """(Triton's launch_pdl option, the kernel's PDL constexpr) of a stand-in compiled kernel."""
    pdl_index = kernel.src.fn.arg_names.index("PDL")
    return bool(kernel.options.get("launch_pdl")), bool(kernel.src.constants.get((pdl_index,), False))


@pytest.mark.parametrize("capability,env,on", [((9, 0), "1", True), ((12, 0), "on", True), ((8, 9), "1", False),
                                               ((9, 0), None, False), ((9, 0), "0", False)],
                         ids=["sm90-on", "sm120-on", "sm89-no-pdl", "sm90-unset", "sm90-off"])
def test_pdl_launches_only_where_asked_and_possible_and_stay_direct(monkeypatch, capability, env, on):
    """DSA_OVERLAY_PDL=1 on sm_90 and later: every launch of an attention call (slot conversion, attention, split
    merge) and of both indexer calls is built with Triton's launch_pdl option and the kernel's PDL wait; never on
    sm_89 and older, never unset or 0. The repeat call still launches the kept binaries directly."""
    if env is None:
        monkeypatch.delenv("DSA_OVERLAY_PDL", raising=False)
    else:
        monkeypatch.setenv("DSA_OVERLAY_PDL", env)
    for mod in (SM, IX):
        monkeypatch.setattr(mod, "_device_info", lambda device: (capability, 132))
    monkeypatch.setattr(IX, "GLUON_DEFAULT", False)
    monkeypatch.setattr(IX, "decode_config", functools.cache(IX.decode_config.__wrapped__))
    g = torch.Generator().manual_seed(7)
    T, H, topk = 40, 16, 256   # request-local indices, a split: three launches
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(8, 64, 576, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, 300, (T, topk), generator=g, dtype=torch.int32)
    bt = torch.randint(0, 8, (3, 6), generator=g, dtype=torch.int32)
    req = torch.randint(0, 3, (T,), generator=g, dtype=torch.int32)
    B, IH, D, bs = 3, 32, 128, 64
    iq = torch.randn(B, 1, IH, D, generator=g).to(torch.float8_e4m3fn)
    ikv = torch.randint(0, 255, (6 * bs * (D + 4),), generator=g, dtype=torch.uint8).view(6, bs, 1, D + 4)
    w = torch.randn(B, IH, generator=g)
    lens = torch.randint(1, 5 * bs, (B,), generator=g, dtype=torch.int32)
    M, N = 33, 300
    pq = torch.randn(M, IH, D, generator=g).to(torch.float8_e4m3fn)
    pk = (torch.randn(N, D, generator=g).to(torch.float8_e4m3fn), torch.rand(N, generator=g))
    ks = torch.zeros(M, dtype=torch.int32)
    ke = torch.randint(1, N, (M,), generator=g, dtype=torch.int32)

    calls = [lambda: SM.sparse_mla_attention(q, kv, idx, 0.07, "bf16", block_table=bt, req_id=req),
             lambda: IX.fp8_paged_mqa_logits(iq, ikv, w, lens, bt[:, :5], None, 4 * bs * 2, False),
             lambda: IX.fp8_mqa_logits(pq, pk, torch.randn(M, IH, generator=g), ks, ke, False)]
    with fake_triton(capability[0] * 10 + capability[1]) as fake:
        _fresh_module_launchers()
        for call in calls:
            call()
        built = list(fake.compiled)
        assert len(built) == 5
        assert {k.src.fn.__name__ for k in built} == {"_request_slots_kernel", "_sparse_mla_fwd_kernel",
                                                      "_sparse_mla_combine_kernel", "_paged_mqa_logits_kernel",
                                                      "_mqa_logits_kernel"}
        assert [_pdl_of(k) for k in built] == [(on, on)] * 5
        n, direct = len(fake.launches), sum(x.direct_calls for x in SM.LAUNCHERS + IX.LAUNCHERS)
        for call in calls:
            call()
        assert len(fake.compiled) == 5 and len(fake.launches) - n == 5
        assert sum(x.direct_calls for x in SM.LAUNCHERS + IX.LAUNCHERS) - direct == 5

# SPDX-License-Identifier: Apache-2.0
"""Direct launch of cached Triton kernels: the host-side shortcut past ``JITFunction.run``.

``kernel[grid](*args, **kwargs)`` runs Triton's whole JIT entry on every call: binding the arguments into a
dict, specialising each one, building and hashing a cache key with ``str(options)``, checking the kernel's
globals, reading the runtime knobs, and only then the C launcher. :class:`DirectLauncher` keeps that path
for the first call of every specialisation (and for anything unusual), remembers the ``CompiledKernel`` it
returned, and launches it directly on later calls whose key is the same.

The key holds everything Triton 3.6 specialises a kernel on, computed by Triton's own
``native_specialize_impl`` (the function its binder calls) for every runtime argument: tensor dtype and
16-byte alignment of the data pointer, int width (i32 / i64 / u64), an int's divisibility by 16 and its
``== 1`` specialisation, float / bool types; plus the current device and every keyword (constexprs,
``num_warps``, ``num_stages``). So a direct launch runs exactly the binary the JIT path would have picked
(tests/kernels/test_launch.py checks this against the JIT path on CPU with a stand-in driver, and
tests/kernels/gpu_checks.py bit for bit on CUDA).

Where it stands aside (the JIT path runs, unchanged): ``DSA_OVERLAY_DIRECT_LAUNCH=0`` (the kill switch, read
when a launcher is made); the interpreter (``TRITON_INTERPRET=1``); a Triton other than 3.6 (the version
whose ``run`` this mirrors); a kernel with pre-run hooks, annotated runtime parameters or a constexpr
parameter before a runtime one; ``TRITON_DEBUG`` / an instrumentation mode; and any call whose key has not
been seen. Launch hooks (profilers) are honoured as in ``JITFunction.run``; with none registered the
launcher gets None for them (it then skips them) instead of the empty hook chains and a metadata dict.

Self-contained: torch and triton only (dropped into vLLM beside the kernels that use it).
"""

from __future__ import annotations

import os
import weakref

import torch
import triton

__all__ = ["DirectLauncher", "KeptLaunch", "PlanTable", "reset_plans", "DIRECT_LAUNCH_ENV", "direct_launch_enabled",
           "env_switch", "build_failed", "build_failure_text", "GLUON_ENV", "gluon_wanted", "tensor_key",
           "off_device", "contiguous_strides", "PDL_ENV", "pdl_launch", "pdl_kwargs"]

DIRECT_LAUNCH_ENV = "DSA_OVERLAY_DIRECT_LAUNCH"
_SUPPORTED_TRITON = ("3.6",)

try:  # Triton 3.6: the C specialiser its binder calls
    from triton._C.libtriton import native_specialize_impl as _specialize
except ImportError:  # pragma: no cover - older Triton: no direct launch
    _specialize = None


def env_switch(name: str, off_means: str, environ=None, default: bool = True) -> bool:
    """An on/off environment switch: unset (or empty) -> `default` (on unless said), 1 (true/on/yes) -> True,
    0 (false/off/no) -> False; anything else is a one-line error naming the variable and what 0 does
    (``off_means``)."""
    env = os.environ if environ is None else environ
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    how = f"0 ({off_means}) or 1 / unset it" if default else f"1, or 0 / unset it ({off_means})"
    raise ValueError(f"{name}={env.get(name)!r} is not understood; set it to {how}")


PDL_ENV = "DSA_OVERLAY_PDL"


def pdl_launch(capability, environ=None) -> bool:
    """Whether the kernels launch with programmatic dependent launch (PDL) on a GPU of `capability` ((major, minor),
    None for the interpreter): the launch may begin while the kernel before it on the stream drains, and the kernel
    waits (``griddepcontrol.wait``, its first instruction) until that one's memory is visible. sm_90 and later only
    (sm_80-89 have no PDL), never interpreted. Read when a launch plan is made. Opt-in (end to end it was within
    run-to-run noise of ordinary launches: bench/RESULTS.md, stop 44): ``DSA_OVERLAY_PDL=1`` (true/on/yes) turns it
    on; unset or 0 (false/off/no) leaves it off; anything else is an error naming the variable."""
    on = env_switch(PDL_ENV, "ordinary launches", environ, default=False)
    return on and capability is not None and tuple(capability) >= (9, 0) and not _interpreted()


def pdl_kwargs(capability, environ=None) -> dict:
    """The launch keywords of a kernel with a ``PDL`` constexpr (its pdl.py wait) on `capability`: ``PDL`` and
    Triton's ``launch_pdl`` option where :func:`pdl_launch` says so, else none (the kernels' defaults: off)."""
    return {"PDL": True, "launch_pdl": True} if pdl_launch(capability, environ) else {}


GLUON_ENV = "DSA_OVERLAY_GLUON"


def gluon_wanted(environ=None) -> bool:
    """DSA_OVERLAY_GLUON, read by every kernel module with an sm_90 Gluon kernel: unset / 1 (true/on/yes): the Gluon
    kernels where the tables have one; 0 (false/off/no): never. Anything else is an error naming the variable."""
    return env_switch(GLUON_ENV, "the Triton kernels everywhere", environ)


def build_failed(e: BaseException) -> bool:
    """Whether ``e`` is this Triton failing to build a kernel (a front-end error such as a Gluon API that moved, a
    resource limit, ptxas, an MLIR pass): what the sm_90 Gluon kernels' callers fall back from."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    return (isinstance(e, (CompilationError, OutOfResources, PTXASError))
            or (isinstance(e, RuntimeError) and "PassManager" in str(e)))


def build_failure_text(e: BaseException) -> str:
    """One line (at most 200 characters) saying why a build failed: a CompilationError's text starts with the
    source position, its message is what says why; otherwise the error's last line."""
    why = (getattr(e, "error_message", None) or (str(e).strip().splitlines() or [""])[-1]).strip()
    return " ".join(why.split())[:200]


def direct_launch_enabled(environ=None) -> bool:
    """The kill switch: ``DSA_OVERLAY_DIRECT_LAUNCH=0`` (or false/off/no) sends every launch through
    Triton's JIT entry. Unset or 1 (true/on/yes): direct launch where it can. Anything else is an error."""
    return env_switch(DIRECT_LAUNCH_ENV, "every launch through Triton's JIT entry", environ)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _unsupported_reason(fn) -> str | None:
    """Why `fn` cannot be launched directly, or None."""
    if _specialize is None or not triton.__version__.startswith(_SUPPORTED_TRITON):
        return f"Triton {triton.__version__} (direct launch mirrors {', '.join(_SUPPORTED_TRITON)})"
    if _interpreted() or not hasattr(fn, "device_caches") or not hasattr(fn, "params"):
        return "interpreter"
    seen_constexpr = False
    for p in fn.params:
        if p.is_constexpr:
            seen_constexpr = True
        elif seen_constexpr:
            return f"runtime parameter {p.name} after a constexpr"
        elif p.annotation_type:
            return f"annotated runtime parameter {p.name}"
    return None


class DirectLauncher:
    """``launcher(grid, *runtime_args, **constexprs_and_options)`` == ``fn[grid](*runtime_args, **...)``.

    Runtime arguments are passed positionally, in the kernel's order, and every constexpr and option by
    keyword, always the same keywords in the same order at one call site (a different order is only a
    cache miss). ``grid`` is a tuple of 1-3 ints.
    """

    def __init__(self, fn, *, enabled: bool | None = None):
        self.fn = fn
        self.reason = _unsupported_reason(fn)
        if enabled is None:
            enabled = direct_launch_enabled()
        if not enabled and self.reason is None:
            self.reason = f"{DIRECT_LAUNCH_ENV}=0"
        self.enabled = self.reason is None
        self._cache: dict = {}
        self._runtime = [p for p in getattr(fn, "params", []) if not p.is_constexpr]
        self._flags = [(p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                       for p in self._runtime]
        self._constexpr = [p for p in getattr(fn, "params", []) if p.is_constexpr]
        self._driver = None
        self.direct_calls = 0  # counters for the census and tests
        self.jit_calls = 0

    # ----------------------------------------------------------------------------------------- key
    def _bind_driver(self):
        from triton import knobs
        from triton.runtime.driver import driver

        active = driver.active
        self._driver = (active.get_current_device, active.get_current_stream, knobs.runtime)

    def key(self, device, args, kwargs):
        """The cache key of one call: device, Triton's specialisation of every runtime argument, and the
        keywords. Raises TypeError for an argument Triton cannot specialise (the JIT path then reports)."""
        backend = self.fn.device_caches[device][3]
        spec = tuple([_specialize(backend, a, c, s, al) for a, (c, s, al) in zip(args, self._flags)])
        return (device, spec, tuple(kwargs.items()))

    def _tail(self, kwargs):
        """Values of the constexpr parameters (after the runtime ones), as JITFunction.run passes them."""
        tail = []
        for p in self._constexpr:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return None
        return tuple(tail)

    # ---------------------------------------------------------------------------------------- call
    def __call__(self, grid, *args, **kwargs):
        if not self.enabled:
            self.jit_calls += 1
            return self.fn[grid](*args, **kwargs)
        if self._driver is None:
            self._bind_driver()
        get_device, runtime = self._driver[0], self._driver[2]
        device = get_device()
        try:
            key = self.key(device, args, kwargs)
            entry = self._cache.get(key)
        except (TypeError, KeyError, IndexError):  # unhashable keyword, unknown arg type: JIT decides
            key, entry = None, None
        if entry is None or runtime.debug or self.fn.pre_run_hooks or len(args) != len(self._runtime):
            self.jit_calls += 1
            kernel = self.fn[grid](*args, **kwargs)
            if key is not None and len(args) == len(self._runtime) and not self.fn.pre_run_hooks:
                self._remember(key, kernel, kwargs)
            return kernel
        self._run(entry, grid, args, device)
        return entry[0]

    # ----------------------------------------------------------------------------- kept entries
    def entry(self, args, kwargs):
        """What this launcher keeps for a call with these arguments on the current device, or None (not seen
        yet, direct launch off). A call site that fixes every argument's specialisation but the tensors'
        pointers (a plan keyed on shapes, strides and dtypes) keeps it and launches later calls with
        :meth:`launch_entry`, past the per-call key."""
        if not self.enabled:
            return None
        if self._driver is None:
            self._bind_driver()
        device = self._driver[0]()
        try:
            kept = self._cache.get(self.key(device, args, kwargs))
        except (TypeError, KeyError, IndexError):
            return None
        return None if kept is None else (device, kept)

    def launch_entry(self, entry, grid, args) -> bool:
        """Launch a kept entry with `args`, which must specialise as the call it was kept from did (the
        caller checks its tensors' 16-byte alignment: the one property a plan key cannot hold). False,
        nothing launched, where Triton's JIT entry must decide (a debug knob or a pre-run hook set since)."""
        if not self.enabled:
            return False
        device = self._driver[0]()
        if device != entry[0] or self._driver[2].debug or self.fn.pre_run_hooks:
            return False  # (another current device: its own binary)
        self._run(entry[1], grid, args, device)
        return True

    def _run(self, entry, grid, args, device):
        get_stream, runtime = self._driver[1], self._driver[2]
        kernel, tail = entry
        self.direct_calls += 1
        full = args + tail
        stream = get_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        if getattr(enter, "calls", True) or getattr(exit_, "calls", True):
            metadata = kernel.launch_metadata(grid, stream, *full)
        else:  # no hook to call: the launcher skips None (no metadata dict, no empty-chain calls)
            metadata = enter = exit_ = None
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, metadata, enter, exit_, *full)

    def _remember(self, key, kernel, kwargs):
        from triton import knobs

        if kernel is None or hasattr(kernel, "result") or knobs.runtime.debug \
                or knobs.compilation.instrumentation_mode:
            return  # async compile, warm-up hook or a debug build: keep the JIT path
        if getattr(kernel, "function", None) is None:
            return  # not loaded (the launch did not happen): keep the JIT path
        tail = self._tail(kwargs)
        if tail is None or any(k not in {p.name for p in self._constexpr} for k in kwargs
                               if k not in ("num_warps", "num_stages", "maxnreg", "launch_pdl")):
            return  # an option this mirror does not know (num_ctas, ...): keep the JIT path
        self._cache[key] = (kernel, tail)


class KeptLaunch:
    """One launch of a call-site plan (a call whose shapes, strides and dtypes fix every argument's
    specialisation but its pointers' alignment): the launcher's entry kept from the first launch, with the
    16-byte alignment of the launch's tensors. A later launch whose tensors align the same way runs that
    binary (:meth:`DirectLauncher.launch_entry`); any other goes through the launcher. With a launcher that
    keeps nothing (Triton's JIT entry) every launch goes through it."""

    __slots__ = ("launcher", "entry", "align")

    def __init__(self, launcher):
        self.launcher, self.entry, self.align = launcher, None, None

    def __call__(self, grid, tensors, args, kwargs):
        align = tuple([t.data_ptr() % 16 == 0 for t in tensors])
        if self.entry is not None and align == self.align and self.launcher.launch_entry(self.entry, grid, args):
            return
        self.launcher(grid, *args, **kwargs)
        if self.entry is None and hasattr(self.launcher, "entry"):
            self.entry, self.align = self.launcher.entry(args, kwargs), align


def tensor_key(t):
    """What a launch plan depends on of one tensor argument: shape, strides, dtype, device (None stays None)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def off_device(device, **tensors) -> str | None:
    """'name is on X, not D' for the first tensor given by name that is not on ``device`` (None skipped), else None.
    A kernel launched on one device with a pointer into another reads garbage or faults far from the call."""
    for name, t in tensors.items():
        if t is not None and t.device != device:
            return f"{name} is on {t.device}, not {device}"
    return None


def contiguous_strides(t) -> tuple[int, ...]:
    """The strides ``t.contiguous()`` has, without copying t (a plan reads them once; the call copies). A tensor
    torch counts as contiguous is returned as it is, odd strides of its size-1 dimensions included."""
    if t.is_contiguous():
        return t.stride()
    return torch.empty_like(t, device="meta", memory_format=torch.contiguous_format).stride()


class PlanTable:
    """A call site's launch plans: what a call derives from its arguments (checks, views, config, grid,
    strides, constexprs and one :class:`KeptLaunch` per launch), kept per key of the arguments' shapes, strides, dtypes
    and devices, so that a repeat call allocates its outputs and launches.

    ``on`` (the call site computes no key when it is off) is true where every launcher of the call site
    launches directly: not in the interpreter, not with ``DSA_OVERLAY_DIRECT_LAUNCH=0``. It is read when the
    table is made and by :meth:`reset` (after a launcher is switched on or off: :func:`reset_plans`).
    Past `limit` distinct keys (mostly token counts) the table is dropped and refilled."""

    __slots__ = ("launchers", "limit", "plans", "on", "__weakref__")

    def __init__(self, launchers, limit: int = 4096):
        self.launchers, self.limit, self.plans = list(launchers), limit, {}
        self.reset()
        _TABLES.add(self)

    def reset(self) -> None:
        """Forget every plan; planning on where every launcher launches directly."""
        self.plans.clear()
        self.on = bool(self.launchers) and all(getattr(x, "enabled", False) for x in self.launchers)

    def get(self, key):
        """The plan kept for `key`, or None (no key, an unhashable one, not planned yet)."""
        if key is None:
            return None
        try:
            return self.plans.get(key)
        except TypeError:  # an unhashable part (a config object): no plan
            return None

    def keep(self, key, plan):
        """Keep `plan` for `key` (unless there is no key or it is unhashable); returns `plan`."""
        if key is not None:
            if len(self.plans) >= self.limit:
                self.plans.clear()
            try:
                self.plans[key] = plan
            except TypeError:
                pass
        return plan

    def __len__(self) -> int:
        return len(self.plans)


_TABLES: "weakref.WeakSet[PlanTable]" = weakref.WeakSet()


def reset_plans() -> None:
    """Every plan table forgets its plans and re-reads whether its launchers all launch directly (call it after
    switching launchers on or off: the kill switch in a running process, the JIT-entry reference runs)."""
    for table in list(_TABLES):
        table.reset()

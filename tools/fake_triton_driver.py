"""A stand-in Triton driver for a machine without a GPU: Triton's real JIT entry (binder, specialiser, kernel
cache) runs, nothing is compiled or launched. Shared by bench/launch_census.py (--cpu) and
tests/kernels/launch_checks.py (bench never imports tests/)."""

from __future__ import annotations

import contextlib

import torch


class _FakeCompiled:
    """What JITFunction.run needs of a CompiledKernel: run, function, packed_metadata, launch_metadata."""

    def __init__(self, src, options, launches: list):
        self.src, self.options, self.function, self.packed_metadata = src, options, object(), ()
        self._launches = launches
        self.name = src.fn.__name__

    def launch_metadata(self, grid, stream, *args):
        from triton import knobs

        if not knobs.runtime.launch_enter_hook.calls:
            return None
        return {"name": self.name, "stream": stream}

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        if enter is not None and enter.calls:  # the CUDA launcher calls a hook that is not None
            enter(launch_metadata)
        self._launches.append((self, (gx, gy, gz), stream, function, packed, args))


class FakeDriver:
    """A stand-in for Triton's CUDA driver on a machine without one: current device 0, stream 0, target
    sm_90 (so the real CUDA backend parses options and specialises arguments), a `compile` that builds
    nothing, and a launcher that records its calls in `launches`."""

    def __init__(self, capability: int = 90):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)
        self.launches: list = []
        self.compiled: list = []

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def compile(self, src, target=None, options=None, **_):
        kernel = _FakeCompiled(src, options, self.launches)
        self.compiled.append(kernel)
        return kernel


@contextlib.contextmanager
def fake_triton(capability: int = 90):
    """Make Triton's JIT entry usable on a CPU machine (see FakeDriver). Yields the driver."""
    import triton.compiler
    from triton.runtime.driver import driver

    fake = FakeDriver(capability)
    saved, saved_active = triton.compiler.compile, driver._active
    driver.set_active(fake)
    triton.compiler.compile = fake.compile
    try:
        yield fake
    finally:
        triton.compiler.compile = saved
        driver._active = saved_active  # reset_active() would look for a real driver

"""Shared test configuration: `gpu` tests skip visibly without CUDA; measured timings are printed at the end."""

import pytest

TIMINGS: list[str] = []  # lines added by tests (e.g. apply/rollback wall time), shown in the summary


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    try:
        import torch

        reason = None if torch.cuda.is_available() else "no CUDA device (gpu test)"
    except ImportError:
        reason = "torch is not installed (gpu test)"
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("measured timings")
        for line in TIMINGS:
            terminalreporter.write_line(line)

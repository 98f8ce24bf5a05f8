"""Shared test configuration: `gpu` tests skip visibly without CUDA; under CI a skip is a failure unless
ALLOWED_SKIPS explains it; measured timings are printed at the end.

CI means the environment variable `CI` is set to anything but "", 0, false or no (CI runs `bash .ci/run`
with CI=true). There every test must run: a skipped test is reported as a failure (a skipped module as a
collection error) whose message gives the skip's reason, except the skips listed in ALLOWED_SKIPS. Locally
skips stay skips; `-rs` prints each reason either way."""

import os

import pytest

# Triton fixes interpreted vs compiled mode for this process when `triton.language` is first imported, and the
# kernel tests need interpreted kernels here (compiled ones are built in subprocesses started without the
# variable). Set it before any test module is collected: tests/bench imports bench modules that import triton.
import tools.triton_interp  # noqa: E402,F401  (sets TRITON_INTERPRET=1)

TIMINGS: list[str] = []  # lines added by tests (e.g. apply/rollback wall time), shown in the summary

# The skips CI accepts: (marker the test carries, start of the skip reason). The GPU tests skip on the
# CPU CI machine because it has no CUDA device; the lead runs them on an H200.
NO_CUDA = "no CUDA device"
ALLOWED_SKIPS = (("gpu", NO_CUDA),)


def ci_enforces_skips() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_allowed(item, reason: str) -> bool:
    return any(item.get_closest_marker(marker) is not None and reason.startswith(prefix)
               for marker, prefix in ALLOWED_SKIPS)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_message(reason: str) -> str:
    allowed = "; ".join(f"marker {m!r} with a reason starting {p!r}" for m, p in ALLOWED_SKIPS)
    return (f"skipped under CI: {reason}\nCI (the CI environment variable) runs every test; the only skips "
            f"it accepts are those in tests/conftest.py ALLOWED_SKIPS ({allowed}). Give CI what the test needs.")


def pytest_configure(config):
    if ci_enforces_skips():  # a skipped module is a collection error under CI: report it, run the rest
        config.option.continue_on_collection_errors = True


def pytest_report_header(config):
    if ci_enforces_skips():
        return "skip policy: CI is set, a skip fails unless tests/conftest.py ALLOWED_SKIPS lists it"
    return None


def gpu_skip_reason() -> str | None:
    """Why `gpu` tests cannot run here (None: a CUDA device is present)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (gpu test)"
    return None if torch.cuda.is_available() else f"{NO_CUDA} (gpu test)"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    reason = gpu_skip_reason() if gpu_items else None
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and ci_enforces_skips():
        reason = _skip_reason(report)
        if not skip_allowed(item, reason):
            report.outcome, report.longrepr = "failed", _fail_message(reason)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.skipped and ci_enforces_skips():  # a whole module skipped (importorskip, allow_module_level)
        report.outcome, report.longrepr = "failed", _fail_message(_skip_reason(report))
    return report


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("measured timings")
        for line in TIMINGS:
            terminalreporter.write_line(line)

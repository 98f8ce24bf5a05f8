"""Run by verify in the target's interpreter: `python -I _verify_child.py SITE OUT.json MODULE...`.

Imports each module with SITE first on sys.path and writes the outcome as JSON to OUT.json. Must not
import dsa_installer (the target interpreter need not have it). As it goes it prints one line per step
to stdout, `PROGRESS` followed by JSON, which verify.py shows while the rest (vLLM's logs) is kept for
the error tail."""

import contextlib
import importlib
import io
import json
import sys
import time
from pathlib import Path


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _call(fn):
    try:
        return True, fn()
    except BaseException as exc:  # noqa: BLE001 - everything is a verify failure, reported
        return False, _error(exc)


def run_selftest(main) -> dict:
    """Call a self-test's main() with its stdout captured: {"ok", "report"}, the report being the lines it
    printed (one per check), then why it failed. Passed: main() returned None, 0 or True (not 1 or False,
    which compare equal to True and 0)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ok, value = _call(main)
    passed = ok and (value is None or value is True or (type(value) is int and value == 0))
    why = [] if passed else [value if not ok else f"main() returned {value!r}"]
    return {"ok": passed, "report": "\n".join(buf.getvalue().splitlines() + why) or "passed"}


PROGRESS = "@dsa-verify-progress "  # the same marker in verify.py


def _progress(**event) -> None:
    print(PROGRESS + json.dumps(event), flush=True)


def main() -> None:
    site, out, modules = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    sys.path.insert(0, str(site))
    result = {"python": sys.version.split()[0], "modules": [], "hooks": None, "selftest": None}
    for name in modules:
        t0 = time.perf_counter()
        ok, value = _call(lambda: importlib.import_module(name))
        result["modules"].append({"module": name, "ok": ok, "error": None if ok else value,
                                  "seconds": round(time.perf_counter() - t0, 3)})
        _progress(step="module", **result["modules"][-1])
    if (site / "vllm" / "_dsa_overlay" / "verify_hooks.py").is_file():
        _progress(step="hooks")
        ok, value = _call(lambda: importlib.import_module("vllm._dsa_overlay.verify_hooks").report())
        result["hooks"] = {"ok": ok, "report": value if not ok or isinstance(value, str) else str(value)}
    if (site / "vllm" / "_dsa_overlay" / "kernels" / "selftest.py").is_file():
        ok, has_gpu = _call(lambda: importlib.import_module("torch").cuda.is_available())
        if not ok:
            result["selftest"] = {"ok": False, "report": f"torch does not import: {has_gpu}"}
        elif has_gpu:
            _progress(step="selftest")
            result["selftest"] = run_selftest(
                lambda: importlib.import_module("vllm._dsa_overlay.kernels.selftest").main())
        else:
            result["selftest"] = {"ok": True, "report": "skipped: no CUDA device"}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

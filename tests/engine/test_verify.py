"""verify.py and the libcuda stub, on real vLLM wheels (this interpreter has no vLLM dependencies, so the
patched vLLM module fails to import here for a real reason; the fresh-venv test sees it pass)."""

import ctypes
import json
import shutil
import subprocess
import sys
import venv

import pytest

from dsa_installer import _verify_child, cudastub, engine, manifest, verify

from .conftest import cli


def test_stub_exports_every_driver_symbol_vllm_imports(trees):
    site = trees(manifest.supported_versions()[-1]).path
    symbols = cudastub.driver_symbols(site)
    assert "cuGetErrorString" in symbols and not any(s.startswith(("cuda", "cublas")) for s in symbols)
    if shutil.which("nm"):  # our ELF reader agrees with binutils
        libs = [str(p) for p in cudastub.libraries(site)]
        out = subprocess.run(["nm", "-D", "--undefined-only", *libs], capture_output=True, text=True).stdout
        names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip().startswith("U ")}
        assert symbols == sorted(n for n in names if cudastub._DRIVER_SYMBOL.fullmatch(n.encode()))
    lib = ctypes.CDLL(str(cudastub.build(symbols) / "libcuda.so.1"))
    for name in symbols:
        assert getattr(lib, name)() == cudastub.CUDA_ERROR_NO_DEVICE


def test_verify_reports_each_module_and_fails_on_import_errors(tree, capsys):
    site = tree.path
    engine.apply(site)
    try:
        proc = cli("--vllm-site-packages", site, "--json", script="verify.py")
        assert proc.returncode == 1, proc.stderr
        r = json.loads(proc.stdout)
        rows = {m["module"]: m for m in r["modules"]}
        targets = [verify.module_name(p.target) for p in manifest.load(tree.version).patches]
        assert set(rows) >= {*targets, "vllm._dsa_overlay", "vllm._dsa_overlay.speculators"}
        assert rows["vllm._dsa_overlay.speculators"]["ok"] is True
        failed = [m for m in rows.values() if not m["ok"]]
        assert failed and all(m["error"].count("\n") == 0 and "Error" in m["error"] for m in failed)
        verify.render(r)
        table = capsys.readouterr().out
        assert ["vllm._dsa_overlay.speculators", "ok"] in [line.split()[:2] for line in table.splitlines()]
        assert table.rstrip().endswith("verify: FAILED")
    finally:
        engine.rollback(site)


def test_verify_hooks_and_selftest_extension_points(tree):
    site = tree.path
    engine.apply(site)
    hooks = site / "vllm/_dsa_overlay/verify_hooks.py"
    hooks.write_text("def report():\n    return 'backend  chosen\\nTRITON_MLA_SPARSE  yes'\n")
    (site / "vllm/_dsa_overlay/kernels/selftest.py").write_text("def main():\n    raise SystemExit('ran')\n")
    try:
        r = verify.run(site, sys.executable)
        assert r["hooks"] == {"ok": True, "report": "backend  chosen\nTRITON_MLA_SPARSE  yes"}
        assert r["selftest"] == {"ok": True, "report": "skipped: no CUDA device"}  # CPU machine: main() not run
        hooks.write_text("def report():\n    raise RuntimeError('no backend')\n")
        r = verify.run(site, sys.executable)
        assert r["hooks"] == {"ok": False, "report": "RuntimeError: no backend"} and r["ok"] is False
    finally:
        assert engine.rollback(site, force=True)["changed"]
    tree.assert_pristine()


def test_verify_on_a_pristine_tree_checks_the_targets(tree):
    r = verify.run(tree.path, sys.executable)
    assert r["checked"] == "no overlay applied (pristine targets)"
    assert [m["module"] for m in r["modules"]] == [verify.module_name(p.target)
                                                   for p in manifest.load(tree.version).patches]
    tree.assert_pristine()


def test_interpreter_is_the_venv_owning_the_site_packages(tmp_path):
    venv.create(tmp_path / "v", with_pip=False)
    site = next((tmp_path / "v" / "lib").glob("python3*/site-packages"))
    assert verify.interpreter_for(site) == str(tmp_path / "v" / "bin" / "python")
    assert verify.interpreter_for(tmp_path) == sys.executable


@pytest.mark.parametrize("rel, name", [("vllm/a/b.py", "vllm.a.b"), ("vllm/a/__init__.py", "vllm.a"),
                                       ("vllm/a/data.json", None)])
def test_module_names(rel, name):
    assert verify.module_name(rel) == name


def test_selftest_lines_reach_the_report_and_only_none_zero_true_pass(capsys):
    """The child captures what the GPU self-test's main() prints (one line per check) into the report that
    render() shows; 1 and False fail although they compare equal to True and 0."""
    lines = ["kernel self-test: seed 7, H200", "PASS  sparse_mla bf16  max abs err 1e-03 (tol 2e-02)  0.10 s",
             "FAIL  indexer decode  max abs err nan (tol 1e-01)  0.20 s"]

    def selftest(value=None, exc=None):
        def main():
            print("\n".join(lines))
            if exc is not None:
                raise exc
            return value
        return main

    for value in (None, 0, True):
        assert _verify_child.run_selftest(selftest(value)) == {"ok": True, "report": "\n".join(lines)}
    for value in (1, 3, False, "failed"):
        r = _verify_child.run_selftest(selftest(value))
        assert r == {"ok": False, "report": "\n".join(lines + [f"main() returned {value!r}"])}
    r = _verify_child.run_selftest(selftest(exc=RuntimeError("CUDA error: an illegal memory access")))
    assert r == {"ok": False, "report": "\n".join(lines + ["RuntimeError: CUDA error: an illegal memory access"])}
    assert capsys.readouterr().out == ""  # nothing leaked past the capture
    verify.render({"site": "/s", "checked": "overlay applied", "interpreter": "python", "libcuda": "system",
                   "ok": False, "modules": [], "hooks": None, "selftest": r})
    shown = capsys.readouterr().out.splitlines()
    assert shown[shown.index("kernel self-test: FAIL") + 1:][:len(lines)] == lines
    assert shown[-1] == "verify: FAILED"

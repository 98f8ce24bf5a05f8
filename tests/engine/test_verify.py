"""verify.py and the libcuda stub, on real vLLM wheels: in this interpreter (no vLLM dependencies) every
patched vLLM module fails to import for a named missing package and every overlay module imports; in the
real vLLM venvs that .ci/run creates, everything imports and the selection table is right."""

import ctypes
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from dsa_installer import _verify_child, cudastub, engine, manifest, verify
from tests import vllm_envs

from .conftest import REPO, cli, family_tree_fixture

family_tree = family_tree_fixture("family_tree")  # one release per family (conftest)

# Prefix of the one-line error of a module that cannot import because a package is missing.
NO_MODULE = "ModuleNotFoundError: No module named "


def overlay_modules() -> list[str]:
    """The modules apply drops in (every *.py below overlay/), named as verify names them."""
    rels = (p.relative_to(REPO / "overlay").as_posix() for p in (REPO / "overlay").rglob("*.py"))
    return sorted(verify.module_name(f"vllm/_dsa_overlay/{rel}") for rel in rels)


def expected_selftest(cuda: bool) -> dict | None:
    """verify's kernel self-test entry: none until the runtime tree ships the GPU self-test."""
    if not (REPO / "overlay/kernels/selftest.py").is_file():
        return None
    return {"ok": True, "report": "passed" if cuda else "skipped: no CUDA device"}


def _torch_sees_cuda(python: str, env: dict | None = None) -> bool:
    code = "import torch; print(torch.cuda.is_available())"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip() == "True"


def _package_import_error(site: Path) -> str | None:
    """The one-line error of a bare `import vllm` from `site` in this interpreter, None where it imports. From
    0.24.0 the package's own import needs vLLM's dependencies (vllm/env_override.py reaches vllm/utils/
    import_utils.py, which imports `regex`), so here nothing below `vllm` imports, the overlay's modules included."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import vllm"
    proc = subprocess.run([sys.executable, "-I", "-c", code, str(site)], capture_output=True, text=True)
    return None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]


def _missing_names(rows: list[dict]) -> set[str]:
    names = set()
    for m in rows:
        assert m["error"].startswith(NO_MODULE), m
        names.add(m["error"][len(NO_MODULE):].strip("'"))
    return names


def _vllm_package_imports_here(site: Path) -> bool:
    """Does the `vllm` package itself (its __init__) import in this interpreter, without vLLM's dependencies?"""
    return subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); import vllm"],
                          capture_output=True, cwd=site).returncode == 0


def test_stub_exports_every_driver_symbol_vllm_imports():
    _, site = vllm_envs.require("0.23.0")  # a real install: pristine trees carry no compiled libraries
    symbols = cudastub.driver_symbols(site)
    assert "cuGetErrorString" in symbols and not any(s.startswith(("cuda", "cublas")) for s in symbols)
    lib = ctypes.CDLL(str(cudastub.build(symbols) / "libcuda.so.1"))
    for name in symbols:
        assert getattr(lib, name)() == cudastub.CUDA_ERROR_NO_DEVICE
    # the stub is now loaded in this process (by path): loading libcuda.so.1 by name returns it, and it must not
    # count as a driver (else the next real-venv test would get no stub directory)
    assert ctypes.CDLL("libcuda.so.1")._handle == lib._handle and not cudastub.have_driver()


def test_stub_symbols_agree_with_binutils():
    """Our ELF reader against binutils' nm on the same libraries (CI installs binutils)."""
    if not shutil.which("nm"):
        pytest.skip("binutils (nm) is not installed")
    _, site = vllm_envs.require("0.23.0")
    libs = [str(p) for p in cudastub.libraries(site)]
    assert libs
    out = subprocess.run(["nm", "-D", "--undefined-only", *libs], capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip().startswith("U ")}
    assert cudastub.driver_symbols(site) == sorted(n for n in names if cudastub._DRIVER_SYMBOL.fullmatch(n.encode()))


def test_cpu_torch_gets_torch_cuda_stubs_that_abort_by_name():
    """vLLM 0.28.0's venv holds torch's CPU build (no libtorch_cuda.so): the stub directory adds libtorch_cuda.so
    and libc10_cuda.so exporting exactly the torch-CUDA names vLLM's libraries import and that torch lacks
    (checked against binutils' nm), each aborting with its name when called; a CUDA torch (0.26.0) gets none."""
    _, site = vllm_envs.require("0.28.0")
    _, cuda_site = vllm_envs.require("0.26.0")
    assert cudastub.torch_cuda_symbols(cuda_site) == []
    symbols = cudastub.torch_cuda_symbols(site)
    assert "aoti_torch_get_current_cuda_stream" in symbols and "torch_c10_cuda_check_msg" in symbols, symbols
    if shutil.which("nm"):
        vllm_libs = [str(p) for p in cudastub.libraries(site) if "torch" not in Path(p).parts]
        out = subprocess.run(["nm", "-D", "--undefined-only", *vllm_libs], capture_output=True, text=True,
                             check=True).stdout
        imported = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip().startswith("U ")}
        torch_libs = [str(p) for p in site.glob("torch/lib/*.so*")]
        out = subprocess.run(["nm", "-D", "--defined-only", *torch_libs], capture_output=True, text=True).stdout
        defined = {line.split()[-1].split("@")[0] for line in out.splitlines() if len(line.split()) == 3}
        assert set(symbols) <= imported and not set(symbols) & defined
        assert {"cublasGemmEx", "torch_get_current_cuda_blas_handle"} <= set(symbols)
    stub = cudastub.stub_dir_for(site)
    assert {p.name for p in stub.iterdir()} >= {"libcuda.so.1", *cudastub.TORCH_CUDA_LIBS}
    out = subprocess.run(["nm", "-D", "--defined-only", str(stub / "libtorch_cuda.so")], capture_output=True,
                         text=True, check=True).stdout if shutil.which("nm") else None
    if out is not None:
        assert set(symbols) <= {line.split()[-1] for line in out.splitlines()}
    call = f"import ctypes; ctypes.CDLL({str(stub / 'libtorch_cuda.so')!r}).aoti_torch_get_current_cuda_stream()"
    proc = subprocess.run([sys.executable, "-c", call], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -6 and "aoti_torch_get_current_cuda_stream called" in proc.stderr, proc


def test_verify_reports_each_module_and_fails_on_import_errors(family_tree, capsys):
    tree = family_tree
    """This interpreter lacks vLLM's dependencies: each patched vLLM module fails, naming a package that the
    real vLLM venv has and this interpreter has not; every overlay module imports (no vLLM at module level), unless
    the `vllm` package itself cannot (0.26.0), and then each fails the same way."""
    site = tree.path
    engine.apply(site)
    try:
        proc = cli("--vllm-site-packages", site, "--json", script="verify.py")
        assert proc.returncode == 1, proc.stderr
        r = json.loads(proc.stdout)
    finally:
        engine.rollback(site)
    targets = [verify.module_name(p.target) for p in manifest.load(tree.version).patches]
    assert [m["module"] for m in r["modules"]] == targets + overlay_modules()
    assert r["checked"] == f"overlay applied (patch set {tree.version})" and r["ok"] is False
    rows = {m["module"]: m for m in r["modules"]}
    package_error = _package_import_error(site)
    if package_error is None:
        assert [n for n in overlay_modules() if not rows[n]["ok"] or rows[n]["error"] is not None] == []
    else:  # 0.24.0 on: each overlay module reports exactly the package's own missing dependency
        assert package_error.startswith(NO_MODULE), package_error
        assert {(rows[n]["ok"], rows[n]["error"]) for n in overlay_modules()} == {(False, package_error)}
    # vllm/plugins/__init__.py (0.24-0.25) imports what the failed imports before it already left loaded in
    # verify's one interpreter (vllm.envs, vllm.logger), so it imports there; every other target fails
    assert [n for n in targets if rows[n]["ok"]] in ([], ["vllm.plugins"])
    failed = [rows[n] for n in targets if not rows[n]["ok"]]
    assert r["hooks"]["ok"] is False  # the selection table imports vLLM
    missing = _missing_names(failed + [r["hooks"] | {"error": r["hooks"]["report"]}]
                             + [rows[n] for n in overlay_modules() if not rows[n]["ok"]])
    if tree.version not in manifest.VENV_RELEASES:
        return  # the cross-check below needs the real venv, which CI builds for VENV_RELEASES only
    python, _ = vllm_envs.require(tree.version)
    probe = "import importlib.util as u, sys; print(sorted(n for n in sys.argv[1:] if u.find_spec(n) is None))"
    check = [sys.executable, "-c", probe, *sorted(missing)]
    assert subprocess.run(check, capture_output=True, text=True).stdout.strip() == repr(sorted(missing))
    check[0] = str(python)
    assert subprocess.run(check, capture_output=True, text=True).stdout.strip() == "[]", missing
    assert r["selftest"] == expected_selftest(_torch_sees_cuda(sys.executable))

    verify.render(r)
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in table if line.startswith("vllm.")] == [
        [m["module"], "ok" if m["ok"] else "FAIL"] for m in r["modules"]]
    assert table[-1] == "verify: FAILED"


@pytest.mark.xdist_group("vllm-venvs")
@pytest.mark.parametrize("version", manifest.VENV_RELEASES)
def test_verify_in_the_real_vllm_venv_passes(version, tmp_path_factory):
    """verify with the interpreter of the real vLLM venv (stub libcuda on a CPU machine): every module
    imports, the selection hook's table has every capability and cache format, exit code 0. (The run is
    shared with tests/backend/test_vllm_patched.py's selection tables: tests/vllm_envs.py verify_json.)"""
    python, site, env = vllm_envs.shared_site(version, tmp_path_factory)
    proc, r = vllm_envs.verify_json(version, tmp_path_factory)
    assert r, (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, [m for m in r["modules"] if not m["ok"]] + [r["hooks"]]
    targets = [verify.module_name(p.target) for p in manifest.load(version).patches]
    assert [(m["module"], m["ok"], m["error"]) for m in r["modules"]] == [
        (n, True, None) for n in targets + overlay_modules()]
    assert r["hooks"]["ok"] is True
    table, _, models = r["hooks"]["report"].partition("\n\n")
    table = table.splitlines()
    assert table[0] == ("| cc | kv cache | index_topk | selected | with DSA_OVERLAY_PORTABLE=1 | "
                        "explicit TRITON_MLA_SPARSE |")
    caps = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0", "12.1")
    assert [row.split(" | ")[:3] for row in table[2:]] == [
        [f"| {cc}", kv, topk] for cc in caps for kv in ("auto", "bfloat16", "fp8_ds_mla") for topk in ("2048", "256", "200")]
    # 0.29.0+: which model code serves DeepSeek-V3.2 / GLM-5 per capability (the deepseek_v32 hook)
    if vllm_envs.release(version) >= (0, 29, 0):
        rows = [line.split(" | ") for line in models.splitlines()[2:]]
        assert [(cc.strip("| "), code.startswith("generic")) for cc, code in rows] == [
            (cc, cc in ("8.0", "8.6")) for cc in caps], models
    else:
        assert models == ""
    assert r["selftest"] == expected_selftest(_torch_sees_cuda(str(python), env))
    assert r["ok"] is True


def test_verify_hooks_and_selftest_extension_points(family_tree):
    tree = family_tree
    site = tree.path
    stand_in = None
    if (package_error := _package_import_error(site)) is not None:  # 0.24.0 on (see _package_import_error)
        assert package_error == NO_MODULE + "'regex'", package_error
        stand_in = site / "regex.py"  # the stdlib's re stands in for the package import; removed below
        stand_in.write_text("from re import *  # noqa: F403 (test stand-in for the regex package)\n")
    engine.apply(site)
    hooks = site / "vllm/_dsa_overlay/verify_hooks.py"
    hooks.write_text("def report():\n    return 'backend  chosen\\nTRITON_MLA_SPARSE  yes'\n")
    (site / "vllm/_dsa_overlay/kernels/selftest.py").write_text("def main():\n    raise SystemExit('ran')\n")
    # the real venv's interpreter where the `vllm` package itself needs vLLM's dependencies (0.26.0)
    python = sys.executable if _vllm_package_imports_here(site) else str(vllm_envs.require(tree.version)[0])
    try:
        r = verify.run(site, python)
        assert r["hooks"] == {"ok": True, "report": "backend  chosen\nTRITON_MLA_SPARSE  yes"}
        assert r["selftest"] == {"ok": True, "report": "skipped: no CUDA device"}  # CPU machine: main() not run
        hooks.write_text("def report():\n    raise RuntimeError('no backend')\n")
        r = verify.run(site, python)
        assert r["hooks"] == {"ok": False, "report": "RuntimeError: no backend"} and r["ok"] is False
    finally:
        assert engine.rollback(site, force=True)["changed"]
        if stand_in is not None:
            stand_in.unlink()
    tree.assert_pristine()


def test_verify_on_a_pristine_tree_checks_the_targets(family_tree):
    tree = family_tree
    r = verify.run(tree.path, sys.executable)
    assert r["checked"] == "no overlay applied (pristine targets)"
    assert [m["module"] for m in r["modules"]] == [verify.module_name(p.target)
                                                   for p in manifest.load(tree.version).patches]
    ok = [m["module"] for m in r["modules"] if m["ok"]]
    assert ok in ([], ["vllm.plugins"])  # see test_verify_reports_each_module_and_fails_on_import_errors
    assert _missing_names([m for m in r["modules"] if not m["ok"]])  # no vLLM deps here
    assert (r["hooks"], r["selftest"], r["ok"]) == (None, None, False)
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

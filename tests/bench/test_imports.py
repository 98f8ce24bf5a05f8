"""bench/ and tests/ import each other in one direction only: tests/bench/ may import bench/ (to test its
pure logic); bench/ never imports tests/, and no other test imports bench/. Shared helpers live in tools/."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imported_roots(path: Path) -> set[str]:
    """Top-level package names a module imports (absolute imports, at any depth of the module)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in
              ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            roots.add(node.args[0].value.split(".")[0])
    return roots


def test_imported_roots_sees_every_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os, tests.kernels\nfrom . import sibling\ndef f():\n    from tests.x import y\n"
                 "    importlib.import_module('tests.z')\n    __import__('bench')\n")
    assert imported_roots(f) == {"os", "tests", "bench"}


def test_bench_never_imports_tests():
    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "bench").rglob("*.py"))
                 if "tests" in imported_roots(p)]
    assert offenders == [], f"bench/ modules importing tests/: {offenders} (move the helper to tools/)"


def test_only_tests_bench_imports_bench():
    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").rglob("*.py"))
                 if "bench" in imported_roots(p) and (REPO / "tests" / "bench") not in p.parents]
    assert offenders == [], f"tests outside tests/bench/ importing bench/: {offenders}"

"""Every shipped patch set: thin hooks only, and the applied tree compiles (patched targets and drop-ins)."""

from dsa_installer import engine, manifest, resources

MAX_ADDED_LINES = 16  # a hook that needs more belongs in an overlay module (ARCHITECTURE.md)


def _added(diff_text: str) -> int:
    return sum(1 for line in diff_text.splitlines() if line.startswith("+") and not line.startswith("+++"))


def test_diffs_are_thin_hooks(tree):
    for p in manifest.load(tree.version).patches:
        n = _added(p.diff.read_text())
        assert 0 < n <= MAX_ADDED_LINES, f"{resources.display(p.diff)}: {n} added lines is not a thin hook"


def test_applied_tree_compiles(tree):
    ps = manifest.load(tree.version)
    engine.apply(tree.path)
    try:
        for rel in [p.target for p in ps.patches] + [d.dest for d in ps.dropins]:
            path = tree.path / rel
            compile(path.read_text(), str(path), "exec")
    finally:
        engine.rollback(tree.path)
    tree.assert_pristine()

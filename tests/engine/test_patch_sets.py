"""Every shipped patch set: thin hooks only, and the applied tree compiles (patched targets and drop-ins)."""

import shutil

import pytest

from dsa_installer import engine, manifest, resources
from dsa_installer.errors import UserError

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


def test_layered_families_resolve_release_then_nearest_family_first(tmp_path, monkeypatch):
    """0.18.0 names ["0.18", "0.17-0.18"]: a diff comes from the release folder, else the first family that
    holds it; a plain string (the other releases) is a list of one."""

    patches = tmp_path / "patches"
    shutil.copytree(resources.patches_dir(), patches)
    monkeypatch.setattr(resources, "patches_dir", lambda: patches)
    fams = patches / manifest.FAMILIES

    def where(version):
        return {p.diff.name: p.diff.parent.relative_to(patches).as_posix() for p in manifest.load(version).patches}

    got = where("0.18.0")
    assert got["config.diff"] == got["platforms_cuda.diff"] == got["mla_indexer.diff"] == "families/0.18"
    assert got["sparse_attn_indexer.diff"] == "families/0.17-0.18"
    assert set(where("0.17.0").values()) == {"families/0.17-0.18"}  # `family = "0.17-0.18"`
    shutil.copy(fams / "0.17-0.18" / "sparse_attn_indexer.diff", fams / "0.18")  # the nearer layer wins
    assert where("0.18.0")["sparse_attn_indexer.diff"] == "families/0.18"
    shutil.copy(fams / "0.18" / "config.diff", patches / "0.18.0")              # the release's override wins
    assert where("0.18.0")["config.diff"] == "0.18.0"
    (fams / "0.18" / "platforms_cuda.diff").unlink()                           # absent nearer: the next layer
    assert where("0.18.0")["platforms_cuda.diff"] == "families/0.17-0.18"
    assert where("0.18.1")["platforms_cuda.diff"] == "families/0.17-0.18"

    m = patches / "0.18.0" / "manifest.toml"
    text = m.read_text()
    for family, message in [('["0.18", "0.18"]', "a folder name or a list of distinct ones"), ("[]", "a list of"),
                            ('["0.18", "../x"]', "folder name under patches/families/ (got '../x')"),
                            ('["0.0", "0.17-0.18"]', "patches/families/0.0 is missing; restore it from git")]:
        m.write_text(text.replace('family = ["0.18", "0.17-0.18"]', f"family = {family}"))
        with pytest.raises(UserError) as err:
            manifest.load("0.18.0")
        assert message in str(err.value) and str(err.value).count("\n") == 0, err.value


def test_every_family_has_a_real_venv_release():
    """CI's real-venv smoke (tests/backend/test_vllm_patched.py) covers each family: a release's family is its
    widest layer (the last name of `family`), or the release itself without one."""
    def family(version):
        names = manifest.family_names(manifest._read_toml(resources.patches_dir() / version / "manifest.toml"))
        return names[-1] if names else version

    covered = {family(v) for v in manifest.VENV_RELEASES if v in manifest.supported_versions()}
    missing = {family(v): v for v in manifest.supported_versions() if family(v) not in covered}
    assert missing == {}, f"families without a release in manifest.VENV_RELEASES: {missing}"

"""tools/patchset.py: the committed patch sets are exactly what `edit` + `regen` produce, and regen picks
up a new edit with the right pristine hash."""

import shutil

import pytest

from dsa_installer import fsops, manifest, resources
from tools import patchset

from .conftest import VERSIONS


@pytest.mark.parametrize("version", VERSIONS)
def test_edit_then_regen_reproduces_the_committed_set(version, tmp_path):
    tree = patchset.edit(version, tmp_path / "edit")
    ps = manifest.load(version)
    for p in ps.patches:  # the edit tree holds the patched targets
        assert fsops.file_sha256(tree / p.target) != p.sha256
    patches = tmp_path / "patches"
    shutil.copytree(resources.patches_dir(), patches)
    assert patchset.regen(version, tree, patches) == [p.target for p in ps.patches]
    assert _files(patches) == _files(resources.patches_dir())  # the same files (release and family), same bytes

    # a maintainer adds a hook to another file: regen writes its diff and its pristine hash
    extra = "vllm/envs.py"
    original = (tree / extra).read_bytes()
    (tree / extra).write_bytes(original.replace(b"\n", b"\n# dsa-overlay hook\n", 1))
    assert patchset.regen(version, tree, patches)[-1] == extra
    text = (patches / version / "manifest.toml").read_text()
    assert f'target = "{extra}"\nsha256 = "{fsops.sha256(original)}"' in text
    layers = manifest.family_names(manifest._read_toml(patches / version / "manifest.toml"))
    where = patches / manifest.FAMILIES / layers[0] if layers else patches / version  # new: the nearest family
    assert (where / "envs.diff").read_text().startswith(f"--- a/{extra}\n+++ b/{extra}\n")

    (tree / extra).write_bytes(original)  # and drops it again when the edit is undone
    assert patchset.regen(version, tree, patches) == [p.target for p in ps.patches]
    assert _files(patches) == _files(resources.patches_dir())


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_edit_refuses_an_existing_tree(tmp_path):
    (tmp_path / "edit").mkdir()
    with pytest.raises(Exception, match="exists; finish with `regen"):
        patchset.edit(VERSIONS[-1], tmp_path / "edit")

"""A regular (non-editable) wheel carries patches/ (as data) and the runtime tree `overlay` (as a package), and
applies the same set."""

import importlib.util
import subprocess
import sys
import zipfile

import pytest

from dsa_installer import manifest

from .conftest import REPO

RUN = "import sys; sys.path.insert(0, sys.argv.pop(1)); from dsa_installer.cli import main; main()"


@pytest.fixture(scope="module")
def wheel_lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # build with this environment's setuptools when it has one (no index needed), else pip's isolated build
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(out),
                           str(REPO)], capture_output=True, text=True, cwd=out)
    assert proc.returncode == 0, proc.stderr
    (whl,) = out.glob("dsa_overlay-*.whl")
    lib = out / "lib"
    zipfile.ZipFile(whl).extractall(lib)
    return lib


def test_wheel_contains_the_patch_sets_and_overlay(wheel_lib):
    data = wheel_lib / "dsa_installer" / "_data"
    for version in manifest.supported_versions():
        assert (data / "patches" / version / "manifest.toml").read_bytes() == \
            (REPO / "patches" / version / "manifest.toml").read_bytes()
    runtime = lambda root: sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    assert runtime(wheel_lib / "overlay") == runtime(REPO / "overlay")  # every subpackage of the runtime tree
    assert not (wheel_lib / "patches").exists() and not (data / "overlay").exists()


def test_installed_wheel_applies_and_rolls_back(wheel_lib, tree, tmp_path):
    ps = manifest.load(tree.version)
    run = lambda *a: subprocess.run([sys.executable, "-c", RUN, str(wheel_lib), *map(str, a)], capture_output=True,
                                    text=True, cwd=tmp_path)
    proc = run("--vllm-site-packages", tree.path)
    assert proc.returncode == 0, proc.stderr
    for d in ps.dropins:
        assert (tree.path / d.dest).read_bytes() == d.src.read_bytes(), d.dest
    assert run("rollback", "--vllm-site-packages", tree.path).returncode == 0
    tree.assert_pristine()

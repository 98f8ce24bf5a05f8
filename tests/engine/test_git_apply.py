"""`git apply` as an independent check of every shipped diff: on a copy of the pristine wheel's files it
applies each patch set cleanly (exact context, no --unidiff-zero) and writes, for every target, the bytes
the engine's apply writes."""

import os
import shutil
import subprocess

from dsa_installer import engine, manifest


def git_apply(cwd, *args) -> subprocess.CompletedProcess:
    """`git apply` as plain patch(1) would run it: outside any repository, no user or system config."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(cwd.parent), GIT_CONFIG_GLOBAL=os.devnull,
               GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", "apply", "-p1", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True)


def test_git_apply_writes_what_the_engine_writes(tree, tmp_path):
    patches = manifest.load(tree.version).patches
    targets = [p.target for p in patches]
    assert len(set(targets)) == len(targets)  # one diff per target: applying all at once is each applied once
    site = tmp_path / "site"  # the diffs' paths (a/vllm/...) are relative to site-packages
    for rel in targets:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree.pristine / rel, site / rel)
    diffs = [p.diff for p in patches]

    check = git_apply(site, "--check", *diffs)
    assert check.returncode == 0 and check.stderr == "", check.stderr
    applied = git_apply(site, *diffs)
    assert applied.returncode == 0 and applied.stderr == "", applied.stderr
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()) == sorted(targets)

    engine.apply(tree.path)
    try:
        for rel in targets:
            ours = (tree.path / rel).read_bytes()
            assert ours != (tree.pristine / rel).read_bytes(), f"{rel}: the engine left it unchanged"
            assert ours == (site / rel).read_bytes(), f"{rel}: the engine's bytes differ from git apply's"
    finally:
        engine.rollback(tree.path)
    tree.assert_pristine()

"""A second apply/rollback while one runs: a clear error, or a wait with --wait; never a mixed tree."""

import fcntl
import json
import os
import subprocess
import sys
import time

from dsa_installer import engine

from .conftest import family_tree_fixture, REPO, assert_error, cli

tree = family_tree_fixture()  # the engine's exhaustive cases: one release per family (conftest)


def _hold_lock(site):
    """Hold the engine's lock (an flock on the vllm/ directory) the way a running apply does."""
    fd = os.open(site / "vllm", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_second_apply_fails_clearly_while_locked(tree):
    site = tree.path
    fd = _hold_lock(site)
    try:
        message = (f"{site}/vllm: another dsa-overlay apply/rollback is running on this vLLM; "
                   "wait for it to finish (or pass --wait)")
        assert_error(cli("--vllm-site-packages", site), message)
        assert not (site / "vllm/.dsa_overlay").exists()
        assert not (site / "vllm/_dsa_overlay").exists()
    finally:
        os.close(fd)
    engine.apply(site)
    fd = _hold_lock(site)
    try:
        assert_error(cli("rollback", "--vllm-site-packages", site), message)
        assert engine.status(site)["state"] == "applied"
    finally:
        os.close(fd)
    engine.rollback(site)
    tree.assert_pristine()


def test_wait_blocks_until_the_lock_is_released(tree):
    site = tree.path
    fd = _hold_lock(site)
    proc = subprocess.Popen([sys.executable, str(REPO / "apply.py"), "--vllm-site-packages", str(site), "--wait"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, proc.communicate()
        assert not (site / "vllm/_dsa_overlay").exists()
    finally:
        os.close(fd)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert engine.status(site)["state"] == "applied"
    engine.rollback(site)
    tree.assert_pristine()


def test_concurrent_applies_and_rollbacks_never_mix(tree):
    """Two real processes race: each either does its job, finds it done, or reports the lock; the tree is
    always exactly applied or exactly pristine."""
    site = tree.path
    for action in ([], ["rollback"]):
        if action:
            engine.apply(site)
        procs = [subprocess.Popen([sys.executable, str(REPO / "apply.py"), *action, "--vllm-site-packages",
                                   str(site), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        results = [(p.wait(60), *p.communicate()) for p in procs]
        changed = 0
        for rc, out, err in results:
            if rc == 0:
                changed += json.loads(out)["changed"]
            else:
                assert rc == 2 and "another dsa-overlay apply/rollback is running" in err, err
        assert changed == 1, results
        expected = "pristine" if action else "applied"
        assert engine.status(site)["state"] == expected
    tree.assert_pristine()
    assert not (site / "vllm/.dsa_overlay").exists()

"""The command line as a new user meets it: a Python without the tool's dependencies, the explicit `apply`
command, a file given as --vllm-site-packages, and --wait saying that it waits."""

import json
import os
import select
import subprocess
import sys
import time
import venv

import pytest

from dsa_installer import engine, manifest
from dsa_installer.bootstrap import DEFAULT_VLLM

from .conftest import family_tree_fixture, REPO, assert_error, cli
from .test_lock import _hold_lock

tree = family_tree_fixture()  # the engine's exhaustive cases: one release per family (conftest)

BARE_FIX = "run `python apply.py bootstrap` (a venv with everything) or `pip install -e .`"


def bare(python, *args, script="apply.py") -> subprocess.CompletedProcess:
    """`cli()` with another interpreter."""
    return subprocess.run([str(python), str(REPO / script), *map(str, args)], capture_output=True, text=True,
                          cwd=REPO)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A plain venv of this Python's base interpreter: no click, no unidiff, no pip needed."""
    where = tmp_path_factory.mktemp("bare")
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    probe = subprocess.run([python, "-c", "import click"], capture_output=True, text=True)
    assert probe.returncode == 1 and "No module named 'click'" in probe.stderr
    return python


@pytest.mark.parametrize("args, command", [(["status"], "apply.py status"), ([], "apply.py"),
                                           (["--vllm-site-packages", "/x", "rollback"], "apply.py"),
                                           (["apply", "--help"], "apply.py apply")])
def test_a_python_without_click_gets_one_line_saying_what_to_run(bare_python, args, command):
    missing = "click, unidiff" + (", tomli" if sys.version_info < (3, 11) else "")
    assert_error(bare(bare_python, *args),
                 f"{command} needs {missing}, which this Python ({bare_python}) lacks; {BARE_FIX}")
    assert_error(bare(bare_python, "--json", script="verify.py"),
                 f"verify.py needs {missing}, which this Python ({bare_python}) lacks; {BARE_FIX}")


def test_bootstrap_runs_on_a_python_without_click(bare_python, tmp_path):
    """The stdlib-only path up to its first install (the whole run is tests/engine/test_fresh_venv.py)."""
    supported = ", ".join(manifest.supported_versions())
    target = tmp_path / "venv"
    assert_error(bare(bare_python, "bootstrap", "--venv", target, "--vllm", "0.1.0"),
                 f"--vllm 0.1.0: no patch set for it (supported: {supported})")
    target.write_text("not a venv")
    assert_error(bare(bare_python, "bootstrap", "--venv", target),
                 f"{target} exists and is not a venv; choose another --venv")
    helped = bare(bare_python, "bootstrap", "--help")
    assert helped.returncode == 0 and "--vllm VERSION" in helped.stdout and DEFAULT_VLLM in helped.stdout


def test_apply_is_also_an_explicit_command(tree):
    site = tree.path
    dry = cli("apply", "--vllm-site-packages", site, "--dry-run")
    assert dry.returncode == 0 and "nothing changed" in dry.stdout, dry.stderr
    tree.assert_pristine()
    done = cli("apply", "--vllm-site-packages", site)
    assert done.returncode == 0 and "applied patch set" in done.stdout, done.stderr
    again = json.loads(cli("--vllm-site-packages", site, "apply", "--json").stdout)  # options before it too
    assert (again["changed"], again["message"]) == (False, "already applied; nothing to do")
    assert engine.status(site)["state"] == "applied"
    assert cli("rollback", "--vllm-site-packages", site).returncode == 0
    tree.assert_pristine()


def test_a_file_as_site_packages_is_a_one_line_error(tmp_path):
    f = tmp_path / "site-packages"
    f.write_text("")
    message = f"{f}: no vllm/ package here; pass the site-packages directory of the venv that has vLLM"
    for args in (["--vllm-site-packages", f], ["apply", "--vllm-site-packages", f],
                 ["rollback", "--vllm-site-packages", f], ["status", "--vllm-site-packages", f]):
        assert_error(cli(*args), message)
    assert_error(cli("--vllm-site-packages", f, script="verify.py"), message)


def _stderr_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stderr], [], [], timeout)
    return proc.stderr.readline() if ready else ""


@pytest.mark.parametrize("action", [[], ["rollback"]])
def test_wait_says_that_it_waits(tree, action):
    site = tree.path
    if action:
        engine.apply(site)
    fd = _hold_lock(site)
    proc = subprocess.Popen([sys.executable, str(REPO / "apply.py"), *action, "--vllm-site-packages", str(site),
                             "--wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _stderr_line(proc, 60)
        assert line == f"waiting for the lock held by another apply/rollback on {site} ...\n"
        time.sleep(0.5)
        assert proc.poll() is None  # still blocked on the lock
    finally:
        os.close(fd)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == "", err
    assert engine.status(site)["state"] == ("pristine" if action else "applied")
    again = cli(*action, "--vllm-site-packages", site, "--wait", "--json")  # lock free: no word about waiting
    assert (again.returncode, again.stderr, json.loads(again.stdout)["changed"]) == (0, "", False)
    if not action:
        engine.rollback(site)
    tree.assert_pristine()

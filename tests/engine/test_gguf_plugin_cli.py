"""What apply, status and bootstrap say and do about vllm-gguf-plugin, the GGUF loader of vLLM >= 0.24
(real pristine 0.26.0 and 0.23.0 trees; the plugin installed with pip --target where it is present)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from dsa_installer import bootstrap, cli as cli_module, gguf_plugin
from tests import vllm_envs

from .conftest import cli

MISSING = ("GGUF: vllm-gguf-plugin is not installed, so vLLM 0.26.0 cannot load GGUF files (everything else is "
           "unaffected); for GGUF run pip install vllm==0.26.0 'vllm-gguf-plugin==0.0.3' 'gguf>=0.17' in one command")


def test_status_says_whether_the_plugin_is_installed(trees):
    site = trees("0.26.0").path
    st = cli("status", "--vllm-site-packages", site)
    assert st.returncode == 0 and st.stdout.rstrip().splitlines()[-1] == MISSING, st.stdout + st.stderr
    assert json.loads(cli("status", "--vllm-site-packages", site, "--json").stdout)["gguf_plugin"] == {
        "installed": None, "line": MISSING}
    vllm_envs.install_plugin(site)
    try:
        st = cli("status", "--vllm-site-packages", site)
        assert st.stdout.rstrip().splitlines()[-1] == ("GGUF: vllm-gguf-plugin 0.0.3 installed; glm-dsa files "
                                                      "load through it with the overlay's adapter"), st.stdout
    finally:
        trees("0.26.0").copy()
    old = cli("status", "--vllm-site-packages", trees("0.23.0").path, "--json")
    assert "gguf_plugin" not in json.loads(old.stdout), "0.23.0 has its own GGUF loader"


def test_apply_without_the_plugin_says_so_in_one_line_and_applies(trees):
    t = trees("0.26.0")
    try:
        with vllm_envs.hook_patch_set("0.26.0", t.path):
            out = CliRunner().invoke(cli_module.cli, ["apply", "--vllm-site-packages", str(t.path)])
            assert out.exit_code == 0, out.output
            lines = out.output.rstrip().splitlines()
            assert lines[-1] == MISSING and "applied patch set 0.26.0" in lines[-2], lines
            assert (t.path / "vllm/_dsa_overlay/gguf/plugin.py").is_file()
            again = CliRunner().invoke(cli_module.cli, ["apply", "--vllm-site-packages", str(t.path)])
            assert again.output.rstrip().splitlines()[-1] == MISSING
            back = CliRunner().invoke(cli_module.cli, ["rollback", "--vllm-site-packages", str(t.path)])
            assert back.exit_code == 0, back.output
        t.assert_pristine(full=True)
    finally:
        t.copy()


def test_bootstrap_pins_the_plugin_with_vllm_in_one_command():
    assert bootstrap.DEFAULT_VLLM == "0.26.0"
    assert bootstrap.pip_packages("0.26.0") == ["vllm==0.26.0", "vllm-gguf-plugin==0.0.3", "gguf>=0.17"]
    assert bootstrap.pip_packages("0.24.0")[1:] == list(gguf_plugin.PINS)
    assert bootstrap.pip_packages("0.23.0") == ["vllm==0.23.0"]
    assert [gguf_plugin.needed(v) for v in ("0.16.0", "0.23.0", "0.24.0", "0.25.1", "0.26.0", "1.0.0", "dev")] == [
        False, False, True, True, True, True, False]

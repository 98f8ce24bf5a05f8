"""overlay/speculators.py without vLLM (the end-to-end check inside a real vLLM is in test_fresh_venv)."""

import pytest

from overlay import speculators

# the exact message of transformers' GGUF config reader (modeling_gguf_pytorch_utils.load_gguf_checkpoint)
UNREADABLE = "GGUF model with architecture {} is not supported yet."


def _raising(exc):
    def get_config_dict(*args, **kwargs):
        raise exc

    return get_config_dict


@pytest.mark.parametrize("arch", ["glm-dsa", "deepseek2", "some-future-arch"])
def test_unreadable_gguf_means_no_speculators(arch):
    fn = _raising(ValueError(UNREADABLE.format(arch)))
    assert speculators.unreadable_gguf_architecture(ValueError(UNREADABLE.format(arch))) == arch
    assert speculators.probe_config_dict(fn, True, "/models", revision=None, gguf_file="m.gguf") == ({}, {})


def test_passes_arguments_through_and_returns_the_result():
    seen = {}

    def get_config_dict(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return {"speculators_config": {"x": 1}}, {"rest": True}

    out = speculators.probe_config_dict(get_config_dict, False, "org/model", revision="r", token=None)
    assert out == ({"speculators_config": {"x": 1}}, {"rest": True})
    assert seen == {"args": ("org/model",), "kwargs": {"revision": "r", "token": None}}


@pytest.mark.parametrize("is_gguf, exc", [
    (False, ValueError(UNREADABLE.format("glm-dsa"))),     # not a GGUF: the error is real
    (True, ValueError("GGUF file is corrupted")),            # another GGUF problem
    (True, OSError("Can't load the configuration of '/x'")),  # missing file
    (True, RuntimeError(UNREADABLE.format("glm-dsa"))),       # same words, other type
])
def test_other_errors_surface(is_gguf, exc):
    with pytest.raises(type(exc), match=str(exc).split("'")[0][:20]):
        speculators.probe_config_dict(_raising(exc), is_gguf, "/models")


def test_module_does_not_import_vllm():
    import subprocess
    import sys

    code = "import sys; import overlay.speculators; assert 'vllm' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "ok\n"

"""The tokenizer rebuilt from a glm-dsa GGUF's metadata encodes like the original tokenizer.json."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from overlay import gguf_glm_dsa as hooks
from overlay.gguf import reader, tokenizer
from transformers import AutoTokenizer
ref = AutoTokenizer.from_pretrained(sys.argv[2])
d = hooks.tokenizer_for_gguf(sys.argv[3])
assert hooks.tokenizer_for_gguf(sys.argv[2]) == sys.argv[2]       # not a GGUF: unchanged
got = AutoTokenizer.from_pretrained(d)
texts = ["The sparse attention index 12345 selects 7 tokens!", "  two  spaces\nand\ttabs\n\n",
         "[gMASK]<sop><|user|>hello<|assistant|>", "Ünïcödé 中文 🚀 (emoji) ---=== '''", "gguf vllm 3.3 3..3"]
out = {"same_ids": [ref.encode(t, add_special_tokens=False) == got.encode(t, add_special_tokens=False) for t in texts],
       "roundtrip": [got.decode(got.encode(t, add_special_tokens=False)) == t for t in texts],
       "eos": [ref.eos_token, got.eos_token], "dir": d}
try:
    tokenizer.tokenizer_json({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default"})
    out["error"] = None
except reader.GGUFError as e:
    out["error"] = str(e)
print("JSON" + json.dumps(out))
"""


def test_tokenizer_from_gguf_matches_original(tiny, tmp_path, fixtures_python):
    proc = subprocess.run([fixtures_python, "-c", _PROBE, str(REPO), str(tiny.hf), tiny.gguf("Q4_K_M")],
                          capture_output=True, text=True, env={"DSA_OVERLAY_CACHE": str(tmp_path),
                                                               "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("JSON")), None)
    assert line, proc.stderr[-3000:]
    out = json.loads(line[4:])
    assert all(out["same_ids"]), out
    assert all(out["roundtrip"]), out
    assert out["eos"][0] == out["eos"][1] == "<|endoftext|>"
    assert out["dir"].startswith(str(tmp_path))
    assert "pass --tokenizer" in out["error"] and "\n" not in out["error"]

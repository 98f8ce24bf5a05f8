"""bench/train_reference.py (issue 17's trained reference) with toy dims on the CPU, in the fixture builder's venv
(transformers' GlmMoeDsa): it learns, its split is by file and reproducible, and what it saves is the checkpoint,
tokenizer and held-out ids that the perplexity runs read."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.gguf.conftest import fixtures_python, tiny  # noqa: F401 (the GGUF tests' fixtures: builder venv, tiny set)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.reference_ppl import nll_sum, ppl, same_prefix, windows  # noqa: E402
from bench.train_reference import corpus, heldout  # noqa: E402


def _corpus_dir(tmp_path: Path) -> Path:
    """A small real corpus: this repository's own Python sources (about 2 MB), copied so the test is stable."""
    root = tmp_path / "corpus"
    for f in sorted(p for d in ("overlay", "dsa_installer", "bench", "tools", "tests") for p in (REPO / d).rglob("*.py")
                    if "__pycache__" not in p.parts):
        dest = root / "src" / f.relative_to(REPO)   # (under "src": the corpus skips folders named tests)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f.read_text())
    return root


def test_the_split_is_by_file_and_stable(tmp_path):
    root = _corpus_dir(tmp_path)
    train, held, stats = corpus([root], 1 << 30)
    again = corpus([root], 1 << 30)
    assert (train, held) == again[:2] and held and train
    assert stats["heldout_files"] == len(held) and stats["files"] == len(train) + len(held)
    rels = [f"{root.name}/{p.relative_to(root)}" for p in sorted(root.rglob("*.py")) if "tests" not in p.parts]
    assert sum(map(heldout, rels)) == len(held)
    assert not set(held) & set(train)


STEPS = 150  # a fixed length: the schedule runs over steps, the run is reproducible (--minutes only caps it)


@pytest.fixture(scope="module")
def trained(tiny, fixtures_python, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("train")
    root = _corpus_dir(tmp_path)
    out = tmp_path / "ref"
    proc = subprocess.run([fixtures_python, str(REPO / "bench" / "train_reference.py"), "--out", str(out), "--tiny",
                           "--corpus", str(root), "--steps", str(STEPS), "--minutes", "4", "--seq", "64", "--batch", "8",
                           "--lr", "3e-3", "--warmup", "10", "--eval-every", "1000", "--eval-windows", "32"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_training_learns_and_saves_what_the_perplexity_runs_read(trained, fixtures_python):
    out = trained
    log = json.loads((out / "train_log.json").read_text())
    vocab = log["corpus"]["tokenizer_vocab"]
    first, last = log["curve"][0]["loss"], log["curve"][-1]["loss"]
    assert last < first - 1.0, log["curve"]                       # it learns
    assert log["steps"] == log["recipe"]["steps"] == STEPS and log["curve"][-1]["lr"] < 0.2 * 3e-3  # cosine ran out
    assert log["heldout_loss"] < 0.75 * math.log(vocab), log["evals"]  # well below a uniform guess on unseen files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["topk_method"] == "noaux_tc"
    assert cfg["indexer_rope_interleave"] is True and cfg["vocab_size"] >= vocab
    held = np.load(out / "heldout.npy")
    assert held.dtype == np.int32 and len(held) == log["corpus"]["heldout_tokens"] and held.max() < vocab
    # the saved checkpoint and tokenizer reload, and reproduce the held-out loss the log reports
    check = r"""
import json, math, sys, numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
biases = [b.dtype for n, b in m.named_buffers() if n.endswith("e_score_correction_bias")]
tok = AutoTokenizer.from_pretrained(out)
ids = np.load(out + "/heldout.npy")[: 32 * 64 + 1]
x = torch.from_numpy(ids.astype("int64"))
with torch.no_grad():
    rows = torch.stack([x[i * 64:(i + 1) * 64 + 1] for i in range(32) if (i + 1) * 64 < len(x)])
    logits = m(input_ids=rows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
print(json.dumps({"loss": float(loss), "special": tok.convert_tokens_to_ids("[gMASK]"), "n_bias": len(biases),
                  "text": tok.decode(tok.encode("def f(x):\n    return x"))}))
"""
    res = subprocess.run([fixtures_python, "-c", check, str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["n_bias"] > 0 and got["text"] == "def f(x):\n    return x" and got["special"] >= vocab - 32
    assert abs(got["loss"] - log["heldout_loss"]) < 0.05, (got, log["heldout_loss"])  # bf16 save, fp32 reload


class _LP:
    def __init__(self, logprob):
        self.logprob = logprob


def test_perplexity_from_prompt_logprobs():
    """vLLM's prompt_logprobs: None at position 0, then a dict per position holding the actual token."""
    toks = [5, 7, 9, 7]
    pl = [None, {7: _LP(-0.5), 1: _LP(-2.0)}, {9: _LP(-1.0)}, {7: _LP(-1.5), 9: _LP(-0.1)}]
    total, count = nll_sum(pl, toks)
    assert (total, count) == (3.0, 3) and abs(ppl(total, count) - math.e) < 1e-12
    with pytest.raises(ValueError, match="position 2 lack token 9"):
        nll_sum([None, {7: _LP(-0.5)}, {8: _LP(-1.0)}, {7: _LP(-1.5)}], toks)
    with pytest.raises(ValueError, match="non-finite"):
        nll_sum([None, {7: _LP(float("nan"))}], toks[:2])
    assert windows(np.arange(10), 4, 5) == [[0, 1, 2, 3], [4, 5, 6, 7]] and same_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_reference_ppl_scores_the_trained_model_and_reports_engines_that_fail(trained, fixtures_python, tmp_path):
    """transformers float32 on the held-out windows (what every engine is judged against); an engine that cannot
    start (no vLLM in that venv) is a report row, not a crash."""
    out = tmp_path / "ppl"
    proc = subprocess.run([fixtures_python, str(REPO / "bench" / "reference_ppl.py"), "--ref", str(trained),
                           "--out", str(out), "--engines", "triton:auto", "--windows", "8", "--seq", "64",
                           "--greedy", "2x6", "--timeout", "120", "--repeats", "2"], capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((out / "reference_ppl.json").read_text())
    ref, eng = data["results"]["transformers fp32"], data["results"]["triton:auto"]
    log = json.loads((trained / "train_log.json").read_text())
    assert ref["count"] == 8 * 63 and len(ref["greedy"]) == 2 and all(len(g) == 6 for g in ref["greedy"])
    assert [len(m) for m in ref["greedy_margin"]] == [6, 6] and all(x >= 0 for m in ref["greedy_margin"] for x in m)
    assert abs(ref["nll"] / ref["count"] - log["heldout_loss"]) < 0.3   # other windows, same held-out text
    assert eng["error"] == "exit 1" and "No module named 'vllm'" in eng["log"]
    md = (out / "reference_ppl.md").read_text()
    assert f"| transformers fp32 | {math.exp(ref['nll'] / ref['count']):.4f} |" in md and "| triton:auto | not measured (exit 1" in md


def test_the_reference_converts_to_every_gguf_type_with_the_packed_tools(trained, fixtures_python, tmp_path):
    """What the H200 session runs to make the reference's GGUFs: the converter and tools packed into a folder (no
    network, no compiler there), then --from-hf with that folder as the cache; every file is a glm-dsa GGUF that
    check-gguf accepts, the UD-style mix keeps attention at Q8_0."""
    import gguf

    builder = REPO / "tests" / "fixtures" / "make_glm_dsa_gguf.py"
    packed = tmp_path / "pack"
    proc = subprocess.run([fixtures_python, str(builder), "--pack", str(packed)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (packed / "bin-0.3.36").iterdir()) == ["llama-gguf-split", "llama-quantize"]
    out = tmp_path / "gguf"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DSA_OVERLAY_FIXTURES": str(packed)}
    proc = subprocess.run([fixtures_python, str(builder), "--from-hf", str(trained), "--outdir", str(out)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((out / "fixture.json").read_text())
    assert sorted(info["gguf"]) == ["BF16", "IQ4_XS", "Q4_K_M", "Q8_0", "UD_MIX"]
    for tag, name in info["gguf"].items():
        check = subprocess.run([sys.executable, str(REPO / "apply.py"), "check-gguf", str(out / name)],
                               capture_output=True, text=True, timeout=300)
        assert check.returncode == 0, (tag, check.stdout[-2000:], check.stderr[-2000:])
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out / info["gguf"]["UD_MIX"])).tensors}
    attn = [n for n in types if n.startswith("blk.1.attn_") and n.endswith(".weight") and "norm" not in n]
    assert attn and all(types[n] in ("Q8_0", "F32", "BF16", "F16") for n in attn), {n: types[n] for n in attn}


def test_the_device_session_trains_converts_and_scores_in_one_background_job(tiny, fixtures_python, tmp_path):
    """bench/reference_session.py as the H200 runs it, with toy dims and no vLLM: `start` returns at once, the job
    waits for the overlay's file, converts with the packed tools, scores the checkpoint and every GGUF (engines
    that cannot start are rows), and `poll` brings it back as one tarball."""
    import tarfile

    builder = REPO / "tests" / "fixtures" / "make_glm_dsa_gguf.py"
    packed = tmp_path / "pack"
    proc = subprocess.run([fixtures_python, str(builder), "--pack", str(packed)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    root, work, ready, out = _corpus_dir(tmp_path), tmp_path / "r17", tmp_path / "setup.done", tmp_path / "out"
    session = [fixtures_python, str(REPO / "bench" / "reference_session.py")]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(session + ["start", "--workdir", str(work), "--llama-tools", str(packed), "--wait-for",
                                     str(ready), f"--train-args=--tiny --corpus {root} --steps 40 --minutes 3 "
                                     "--seq 64 --batch 8 --eval-every 1000 --eval-windows 8",
                                     "--ppl-args=--engines triton:auto --windows 4 --seq 64 --greedy 1x4 --timeout 120"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and "[session] started pid" in proc.stdout, proc.stderr[-3000:]
    poll = session + ["poll", "--workdir", str(work), "--out", str(out)]
    deadline = time.time() + 600
    while "convert" not in json.loads((work / "state.json").read_text())["stages"]:
        state = json.loads((work / "state.json").read_text())
        assert not state["done"] and time.time() < deadline, state
        if state["stage"].startswith("waiting for"):
            assert subprocess.run(poll, capture_output=True, text=True, env=env).returncode == 1  # not done yet
            ready.touch()
        time.sleep(1)
    proc = subprocess.run(poll + ["--wait", "900"], capture_output=True, text=True, timeout=960, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with tarfile.open(out / "reference_session.tgz") as tf:
        names = set(tf.getnames())
        data = json.load(tf.extractfile("ppl/reference_ppl.json"))
        state = json.load(tf.extractfile("state.json"))
    assert {"state.json", "train.log", "convert.log", "score.log", "ref/train_log.json", "gguf/fixture.json",
            "ppl/reference_ppl.md"} <= names
    assert [s["rc"] for s in state["stages"].values()] == [0, 0, 0] and list(state["stages"]) == ["train", "convert",
                                                                                                  "score"]
    results = data["results"]
    assert results["transformers fp32"]["count"] == 4 * 63
    assert sorted(results) == sorted(["transformers fp32", "triton:auto"] + [f"gguf {t}:triton" for t in
                                                                            ("BF16", "Q8_0", "Q4_K_M", "IQ4_XS", "UD_MIX")])
    assert all("No module named 'vllm'" in r["log"] for n, r in results.items() if n != "transformers fp32")

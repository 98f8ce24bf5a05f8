#!/usr/bin/env python3
"""Issue 17's device session as one background job: train the reference model, convert it to GGUF, score every
engine, one step after the other on one warm machine (the checkpoint exists only there, and a lease lost midway
loses it), with a poll that brings back what is done so far.

    # first staging call, image python (torch + transformers), vLLM not needed yet:
    python3 bench/reference_session.py start --workdir /root/r17 --llama-tools /root/llama-tools \\
        --wait-for /root/setup.done --vllm-env /root/vllm-env.sh --pythonpath /tmp/whl
    # ... the remaining staging calls; the last one applies the overlay, then `touch /root/setup.done`
    python3 bench/reference_session.py poll --workdir /root/r17 --wait 560 --out $OUT   # back to back until done

Stages: train (bench/train_reference.py --steps 2000 --minutes 7 by default; `--train-args` replaces the extra
arguments), wait for --wait-for (the overlay applied), convert (tests/fixtures/make_glm_dsa_gguf.py --from-hf with
--llama-tools as its cache: BF16, Q8_0, Q4_K_M, IQ4_XS, UD_MIX), score (bench/reference_ppl.py on the checkpoint and
every GGUF, one engine at a time, under --vllm-env; `--ppl-args` adds arguments). A failed conversion still scores
the checkpoint; a failed training ends the job. `state.json` in --workdir records every stage's times and exit
status; poll packs it with the logs, the training log, fixture.json and the perplexity report into
$OUT/reference_session.tgz (one file: $OUT brings back at most 8).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["--steps", "2000", "--minutes", "7"]


def _state(work: Path) -> dict:
    p = work / "state.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _save(work: Path, state: dict) -> None:
    tmp = work / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(work / "state.json")


def _stage(work: Path, state: dict, name: str, cmd: list[str], env: dict | None = None) -> int:
    """Run one stage's command with its output in <work>/<name>.log; record start, end and exit status."""
    state["stages"][name] = {"start": time.strftime("%H:%M:%S"), "cmd": shlex.join(cmd)}
    state["stage"] = name
    _save(work, state)
    t0 = time.time()
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=REPO).returncode
    state["stages"][name].update(end=time.strftime("%H:%M:%S"), s=round(time.time() - t0, 1), rc=rc)
    _save(work, state)
    return rc


def run(args) -> int:
    work = Path(args.workdir)
    state = dict(_state(work), stages={}, stage="start", done=False, pid=os.getpid())
    _save(work, state)
    ref, gguf_dir, ppl = work / "ref", work / "gguf", work / "ppl"
    train_args = shlex.split(args.train_args) if args.train_args is not None else TRAIN
    if _stage(work, state, "train", [sys.executable, str(REPO / "bench" / "train_reference.py"), "--out", str(ref),
                                     *train_args]) != 0:
        state.update(stage="train failed", done=True)
        _save(work, state)
        return 1
    if args.wait_for:
        state["stage"] = f"waiting for {args.wait_for}"
        _save(work, state)
        while not Path(args.wait_for).exists():
            time.sleep(2)
    ggufs = []
    if args.llama_tools:
        env = dict(os.environ, DSA_OVERLAY_FIXTURES=args.llama_tools)
        if _stage(work, state, "convert", [sys.executable, str(REPO / "tests" / "fixtures" / "make_glm_dsa_gguf.py"),
                                           "--from-hf", str(ref), "--outdir", str(gguf_dir)], env) == 0:
            info = json.loads((gguf_dir / "fixture.json").read_text())
            ggufs = [f"{tag}={gguf_dir / name}" for tag, name in info["gguf"].items()]
    score = [sys.executable, str(REPO / "bench" / "reference_ppl.py"), "--ref", str(ref), "--out", str(ppl),
             *[a for g in ggufs for a in ("--gguf", g)], *shlex.split(args.ppl_args or "")]
    if args.vllm_env:
        score = ["bash", "-c", f". {shlex.quote(args.vllm_env)} && exec \"$@\"", "score", *score]
    env = dict(os.environ)
    if args.pythonpath:  # --vllm-env then puts the staged vLLM in front
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), args.pythonpath) if p)
    rc = _stage(work, state, "score", score, env)
    state.update(stage="done" if rc == 0 else "score failed", done=True)
    _save(work, state)
    return rc


def start(args) -> int:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if _state(work).get("stage") not in (None, "done", "train failed", "score failed"):
        raise SystemExit(f"{work}: a session is already running there (state.json: {_state(work)['stage']})")
    cmd = [sys.executable, str(Path(__file__).resolve()), "run", *sys.argv[2:]]
    _save(work, {"stage": "starting", "stages": {}, "done": False})
    with open(work / "session.log", "w") as log:   # its own session: it outlives this call's process group
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=REPO)
    print(f"[session] started pid {proc.pid}, workdir {work}")
    return 0


def poll(args) -> int:
    """Wait up to --wait seconds for the job to end, then pack what it has into --out and print where it is."""
    work = Path(args.workdir)
    end = time.time() + args.wait
    while time.time() < end and not _state(work).get("done"):
        time.sleep(2)
    state = _state(work)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "reference_session.tgz", "w:gz") as tf:
        for p in ["state.json", "session.log", "train.log", "convert.log", "score.log", "ref/train_log.json",
                  "ref/train_log.md", "gguf/fixture.json", "ppl/reference_ppl.json", "ppl/reference_ppl.md"]:
            if (work / p).exists():
                tf.add(work / p, arcname=p)
    print(f"[session] stage: {state.get('stage')}, done: {state.get('done')}")
    for name, s in state.get("stages", {}).items():
        print(f"[session] {name}: {s.get('start')} -> {s.get('end', '...')} rc {s.get('rc', '-')}")
    for name in ("train.log", "score.log"):
        p = work / name
        if p.exists():
            lines = [x for x in p.read_text(errors="replace").splitlines() if x.startswith(("[train]", "[ppl]"))]
            for x in lines[-3:]:
                print(x[:300])
    return 0 if state.get("done") and state.get("stage") == "done" else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("start", "run"):
        p = sub.add_parser(name)
        p.add_argument("--workdir", required=True)
        p.add_argument("--llama-tools", help="make_glm_dsa_gguf.py --pack folder (no GGUFs without it)")
        p.add_argument("--wait-for", help="a file whose existence means the overlay is applied")
        p.add_argument("--vllm-env", help="a shell file to source before scoring (the staged vLLM)")
        p.add_argument("--pythonpath", help="appended to PYTHONPATH for scoring (gguf, vllm-gguf-plugin)")
        p.add_argument("--train-args", default=None, help=f"train_reference.py's arguments (default: {shlex.join(TRAIN)})")
        p.add_argument("--ppl-args", default="", help="extra reference_ppl.py arguments")
    p = sub.add_parser("poll")
    p.add_argument("--workdir", required=True)
    p.add_argument("--wait", type=float, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    return {"start": start, "run": run, "poll": poll}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""Running the proof on the device: a patched vLLM (applied in SITE, or a private patched copy), the tiny
checkpoints (and the GGUF fixture's files), every engine in its own worker process (one at a time by
default: ../shared/FACTS.md, engines started together fail in vLLM's memory profiling), runs in the plan's order
of value until the time budget, the results and the report rewritten after every run (a budget cut or a
killed call leaves partial tables), then the dump comparisons."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .judge import compare_dumps
from .plan import (ATTENTION_BACKEND, DEFAULT_CHUNK, GREEDY_STEPS, MODELS, TPS_BATCH, UPSTREAM_PATHS, VOCAB, Model,
                   estimate_s, index_topk)
from .report import report, results_markdown
from .worker import spec_arg

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "bench" / "e2e_proof.py"   # the worker entry: e2e_proof.py --worker SPEC
RESULTS_JSON = "results.json"            # in --workdir: what --resume continues from


def make_model(out_dir: Path, model: Model) -> None:
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    overrides = model.config
    cfg = GlmMoeDsaConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=2, first_k_dense_replace=1, num_key_value_heads=overrides[
            "num_attention_heads"], n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=512, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_head_dim=128,
        max_position_embeddings=4096, initializer_range=0.1, bos_token_id=0, eos_token_id=1,
    ), **overrides})
    torch.manual_seed(0)
    net = GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16)
    net.save_pretrained(out_dir)
    # vLLM builds gate.e_score_correction_bias only for topk_method == "noaux_tc"
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data.update(topk_method="noaux_tc", scoring_func="sigmoid", torch_dtype="bfloat16", **model.json)
    path.write_text(json.dumps(data, indent=2))


def model_sources(work: Path, models: set, gguf_fixture: str | None) -> tuple[dict, dict]:
    """-> ({model: dict(model=, tokenizer=, vocab=)}, {model: why it cannot run}). Checkpoints are made
    once per work dir (seeded: the same weights on every call, so --resume can mix calls)."""
    sources, missing = {}, {}
    info = None
    if gguf_fixture:
        fx = Path(gguf_fixture)
        info = json.loads((fx / "fixture.json").read_text())
    for name in sorted(models):
        m = MODELS[name]
        if m.gguf:
            if info is None:
                missing[name] = "skipped: no --gguf-fixture"
                continue
            sources[name] = dict(model=str(fx / info["gguf"][m.gguf]), tokenizer=str(fx / info["hf"]),
                                 vocab=info["config"]["vocab_size"])
            continue
        d = work / name
        if not (d / "config.json").exists():
            make_model(d, m)
        sources[name] = dict(model=str(d), tokenizer=None, vocab=VOCAB)
    return sources, missing


def make_prompts(model: Model, vocab: int) -> dict:
    """Seeded token ids: the greedy prompts, the teacher-forced sequences (prompt + a fixed
    continuation), the tok/s batch."""
    import torch

    g = torch.Generator().manual_seed(1234)
    rand = lambda n: torch.randint(2, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(n) for n in model.prompt_lens]
    return dict(prompts=prompts, tf_sequences=[p + rand(GREEDY_STEPS) for p in prompts],
                tps_prompts=[rand(300 + 7 * i) for i in range(TPS_BATCH)])


def prepare_vllm(args, log) -> tuple[str, str, str]:
    """-> (PYTHONPATH for patched runs, PYTHONPATH for upstream runs, how)."""
    site = Path(args.site)
    base = os.environ.get("PYTHONPATH", "")
    join = lambda *p: os.pathsep.join(x for x in p if x)  # noqa: E731
    if args.apply and (REPO / "apply.py").exists():
        for cmd in (["apply.py", "--vllm-site-packages", str(site)],
                    ["verify.py", "--vllm-site-packages", str(site)]):
            proc = subprocess.run([sys.executable, str(REPO / cmd[0]), *cmd[1:]], cwd=REPO,
                                  capture_output=True, text=True)
            log.append(f"$ python {' '.join(cmd)}  (exit {proc.returncode})\n"
                       f"{(proc.stdout + proc.stderr)[-6000:]}")
            if proc.returncode:
                raise SystemExit(f"{cmd[0]} failed; see the log in the report")
    if (site / "vllm" / "_dsa_overlay").is_dir():
        return base, base, f"overlay applied in {site} (upstream runs: switch off, backend by name)"
    dest = stage_patched_copy(site)
    return join(str(dest), base), base, f"private patched copy {dest} over pristine {site}"


def stage_patched_copy(site: Path) -> Path:
    """A private patched vLLM: SITE's vllm/ and its dist-info hard-linked (copied where links cannot
    be made, e.g. across file systems) into a new temp dir, the overlay applied there by the real
    engine, which replaces files through new inodes: SITE is never written."""
    from dsa_installer import engine

    dest = Path(tempfile.mkdtemp(prefix="dsa_stage_"))
    for src in (site / "vllm", next(site.glob("vllm-*.dist-info"))):
        if subprocess.run(["cp", "-al", str(src), str(dest)], capture_output=True).returncode:
            shutil.copytree(src, dest / src.name, symlinks=True, dirs_exist_ok=True)
    engine.apply(dest)
    return dest


def start_worker(spec: dict, pythonpath: str, cli: Path = CLI):
    """The worker process (`cli --worker SPEC`, which ends in worker.serve), in a session of its own: its
    leftovers (compile workers) can be ended with it."""
    env = dict(os.environ, PYTHONPATH=pythonpath)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return subprocess.Popen([sys.executable, str(cli), "--worker", spec_arg(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish_worker(proc, t0: float, timeout: float) -> dict:
    """The worker's RESULT line (res["ended"]: "exited", or "killed at timeout"). The worker ends with
    os._exit (a vLLM 0.26.0 engine does not exit by itself after generate, ../shared/FACTS.md); whatever it left
    running in its session (which could hold the output pipe open) is killed once it has exited, and a
    worker still alive at the timeout is killed with it, its result kept if it printed one."""
    lines: list = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        own_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:   # already gone (and reaped)
        own_group = False
    try:
        proc.wait(timeout=max(timeout, 1))
        ended = "exited"
    except subprocess.TimeoutExpired:
        ended = f"killed at timeout ({timeout:.0f} s)"
    if own_group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elif proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(10)
    out = "".join(lines)
    wall = round(time.perf_counter() - t0, 1)
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res.update(wall_s=wall, ended=ended)
            return res
    if ended != "exited":
        return {"error": f"timeout after {timeout:.0f}s", "log": out[-3000:], "wall_s": wall}
    return {"error": f"exit {proc.returncode}", "log": out[-3000:], "wall_s": wall}


def failure_line(res: dict) -> str:
    """A failed worker's result in one line: its error and the last line of its log."""
    last = (res.get("log") or "").strip().splitlines()[-1:]
    return f"{res['error']}: {last[0][-300:]}" if last else res["error"]


def memory_race(res: dict) -> bool:
    """A failure caused by a neighbouring engine (vLLM's memory profiling saw memory come or go)."""
    log = res.get("log", "")
    return "error" in res and any(k in log for k in (
        "memory profiling", "Free memory on device", "CUDA out of memory", "OutOfMemoryError",
        "No available memory for the cache blocks"))


def run_all(runs: list, make_spec, pythonpath_for, t_start: float, parallel: int = 1,
            budget_s: float = 470.0, on_result=None, done: dict | None = None) -> dict:
    """Runs in plan order (most valuable first). A run starts only if its estimate (plan.estimate_s)
    fits in what is left of `budget_s`; the first one that does not ends the schedule (it and the rest
    are marked skipped). Up to `parallel` engines at once (small memory share each) for runs without a
    tok/s measurement; a tok/s run, or any run with parallel 1, runs alone. Then, time permitting, a
    lone retry of a run that lost a memory race. `done`: results of an earlier call to keep (--resume);
    `on_result(results)` after every finished run."""
    results: dict = dict(done or {})
    left = lambda: budget_s - (time.perf_counter() - t_start)  # noqa: E731
    mem_shared = 0.5 if parallel <= 1 else round(0.8 / parallel, 2)
    active: list = []

    def timeout():
        return min(max(left(), 30) + 15, 300)

    def collect(entry):
        run, proc, t0 = entry
        results[run.name] = finish_worker(proc, t0, timeout())
        print(f"{run.name}: {results[run.name].get('error', 'ok')} ({results[run.name].get('wall_s')} s)",
              flush=True)
        if on_result:
            on_result(results)

    todo = [r for r in runs if r.name not in results]
    stopped = False
    for i, run in enumerate(todo):
        alone = run.tps or parallel <= 1
        while active and (alone or len(active) >= parallel):
            collect(active.pop(0))
        if stopped or estimate_s(run) > left():
            stopped = True
            results[run.name] = {"error": f"skipped: time budget spent ({left():.0f} s left, "
                                          f"run needs ~{estimate_s(run):.0f} s)"}
            continue
        t0 = time.perf_counter()
        proc = start_worker(make_spec(run, 0.5 if alone else mem_shared), pythonpath_for(run))
        if alone:
            collect((run, proc, t0))
        else:
            active.append((run, proc, t0))
            time.sleep(3)  # stagger the engines' memory profiling a little
    while active:
        collect(active.pop(0))
    for run in [r for r in todo if memory_race(results.get(r.name, {}))]:
        if estimate_s(run) > left():
            continue
        t0 = time.perf_counter()
        collect((run, start_worker(make_spec(run, 0.5), pythonpath_for(run)), t0))
    return results


def prove(args, plan) -> tuple[str, bool]:
    """The whole proof on this machine's GPU: patched vLLM, checkpoints, every run the budget allows,
    the dump comparisons, the report (args.out; the raw results beside it as JSON, and a
    tables for bench/RESULTS.md). -> (report, overall pass)."""
    t_start = time.perf_counter()
    import torch

    args.device_name = (f"{torch.cuda.get_device_name()} (cc "
                        f"{'.'.join(map(str, torch.cuda.get_device_capability()))})"
                        if torch.cuda.is_available() else "no GPU")
    log: list[str] = []
    patched_pp, upstream_pp, how = prepare_vllm(args, log)
    how = f"vLLM {vllm_version(upstream_pp)}; {how}"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dsa_proof_"))
    work.mkdir(parents=True, exist_ok=True)
    runs = plan.runs
    if args.only:
        only = set(args.only.split(","))
        runs = [r for r in runs if r.name in only]
    sources, missing = model_sources(work, {r.model for r in runs}, args.gguf_fixture)
    done = {}
    if args.resume and (work / RESULTS_JSON).exists():
        done = {n: r for n, r in json.loads((work / RESULTS_JSON).read_text())["runs"].items()
                if "error" not in r}
    done.update({r.name: {"error": missing[r.model]} for r in runs if r.model in missing})
    absent = backends_absent(upstream_pp, {ATTENTION_BACKEND[r.path] for r in runs if r.path in ATTENTION_BACKEND})
    done.update({r.name: {"error": f"{ATTENTION_BACKEND[r.path]} is not in this vLLM release"}
                 for r in runs if ATTENTION_BACKEND.get(r.path) in absent})
    prompts = {m: make_prompts(MODELS[m], s["vocab"]) for m, s in sources.items()}

    dump_dir = work / "dumps"
    dump_dir.mkdir(exist_ok=True)
    dumping = not args.no_dump
    if dumping:
        how += "; every run with sparse_mla_force_mqa where the release has it (0.26+: no dense-MHA prefill)"

    def dump_path(run):
        # another schedule (chunking) or a model whose dumps would be huge: no dump
        ok = (dumping and run.chunk == DEFAULT_CHUNK and index_topk(run.name) <= 256
              and run.path != "upstream_fa")
        return str(dump_dir / (run.name.replace("/", "_") + ".pt")) if ok else None

    def make_spec(run, mem):
        src, model = sources[run.model], MODELS[run.model]
        return dict(model_dir=src["model"], tokenizer=src["tokenizer"], path=run.path, kv=run.kv,
                    graphs=run.graphs, tps=run.tps, **prompts[run.model],
                    mem=mem, chunk=run.chunk,
                    max_model_len=model.max_model_len, census=run.path in ("upstream", "triton"),
                    dump_path=dump_path(run),
                    # every run alike, so that floors and candidates take the same paths (0.26+)
                    force_mqa=dumping)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    dumps: dict = {}

    def write(results):
        """Report, JSON and bench/RESULTS.md tables of what has run so far (after every run)."""
        for cand, ref, _ in plan.comparisons:
            pc = dump_dir / (cand.replace("/", "_") + ".pt")
            pr = dump_dir / (ref.replace("/", "_") + ".pt")
            if (cand not in dumps and pc.exists() and pr.exists()
                    and "error" not in results.get(cand, {"error": 1})
                    and "error" not in results.get(ref, {"error": 1})):
                dumps[cand] = compare_dumps(str(pc), str(pr), index_topk(cand))
        elapsed = time.perf_counter() - t_start
        text, ok = report(args, how, log, results, runs, plan, dumps, elapsed)
        data = {"meta": {"device": args.device_name, "how": how, "elapsed_s": round(elapsed, 1)},
                "runs": results, "dumps": dumps}
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(data))
        out.with_name(out.stem + "-results.md").write_text(
            results_markdown(args, how, results, runs, plan, dumps, elapsed))
        (work / RESULTS_JSON).write_text(json.dumps(data))
        return text, ok

    results = run_all(runs, make_spec,
                      lambda run: upstream_pp if run.path in UPSTREAM_PATHS else patched_pp,
                      t_start, max(1, args.parallel), args.max_minutes * 60, write, done)
    return write(results)


def backends_absent(pythonpath: str, names: set) -> set:
    """The attention backends of `names` that the release's registry does not list (FLASH_ATTN_MLA_SPARSE
    is new in 0.25.0), read from the file without importing vLLM; empty where the registry is not found."""
    for root in pythonpath.split(os.pathsep):
        reg = Path(root) / "vllm" / "v1" / "attention" / "backends" / "registry.py"
        if reg.is_file():
            text = reg.read_text()
            return {n for n in names if f"{n} =" not in text}
    return set()


def vllm_version(pythonpath: str) -> str:
    """The vLLM release the runs import (read from its dist-info, without importing vLLM)."""
    proc = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                          env=dict(os.environ, PYTHONPATH=pythonpath), capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"

"""Running the proof on the device: a patched vLLM (applied in SITE, or a private patched copy), the tiny
checkpoints, every engine in its own worker process (up to --parallel at once, the tok/s runs alone, a
lone retry for a run that lost a memory race), then the dump comparisons and the report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .judge import compare_dumps
from .plan import CHUNK_SUFFIX, GREEDY_STEPS, MODELS, PROMPT_LENS, TIME_BUDGET_S, TPS_BATCH, VOCAB, index_topk
from .report import report

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "bench" / "e2e_proof.py"   # the worker entry: e2e_proof.py --worker SPEC


def make_model(out_dir: Path, overrides: dict) -> None:
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=2, first_k_dense_replace=1, num_key_value_heads=overrides[
            "num_attention_heads"], n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=512, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_head_dim=128,
        max_position_embeddings=4096, initializer_range=0.1, bos_token_id=0, eos_token_id=1,
    ), **overrides})
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    # vLLM builds gate.e_score_correction_bias only for topk_method == "noaux_tc"
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data.update(topk_method="noaux_tc", scoring_func="sigmoid", torch_dtype="bfloat16")
    path.write_text(json.dumps(data, indent=2))


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
        return base, base, f"overlay applied in {site} (upstream runs: switch off, FLASHMLA_SPARSE)"
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


def start_worker(spec: dict, pythonpath: str):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return subprocess.Popen([sys.executable, str(CLI), "--worker", json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_worker(proc, t0: float, timeout: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return {"error": f"timeout after {timeout:.0f}s", "log": (out or "")[-3000:]}
    wall = round(time.perf_counter() - t0, 1)
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["wall_s"] = wall
            return res
    return {"error": f"exit {proc.returncode}", "log": out[-3000:], "wall_s": wall}


def memory_race(res: dict) -> bool:
    """A failure caused by a neighbouring engine (vLLM's memory profiling saw memory come or go)."""
    log = res.get("log", "")
    return "error" in res and any(k in log for k in (
        "memory profiling", "Free memory on device", "CUDA out of memory", "OutOfMemoryError",
        "No available memory for the cache blocks"))


def run_all(runs: list, make_spec, pythonpath_for, t_start: float, parallel: int) -> dict:
    """Non-tok/s runs first, `parallel` at a time (small memory share each); then the tok/s runs
    alone; then, time permitting, a lone retry of any run that lost a memory race."""
    results: dict = {}
    left = lambda: TIME_BUDGET_S - (time.perf_counter() - t_start)  # noqa: E731
    shared = [r for r in runs if not r[5]]
    alone = [r for r in runs if r[5]]

    def note(name):
        print(f"{name}: {results[name].get('error', 'ok')} ({results[name].get('wall_s')} s)",
              flush=True)

    pending = list(shared)
    active: list = []
    mem = 0.5 if parallel <= 1 else round(0.8 / parallel, 2)
    while pending or active:
        while pending and len(active) < parallel and left() > 40:
            run = pending.pop(0)
            spec = make_spec(run, mem)
            active.append((run, start_worker(spec, pythonpath_for(run)), time.perf_counter()))
            time.sleep(3)  # stagger the engines' memory profiling a little
        if not active:
            break
        run, proc, t0 = active.pop(0)
        results[run[0]] = finish_worker(proc, t0, min(left() + 60, 240))
        note(run[0])
    for run in pending:
        results[run[0]] = {"error": "skipped: time budget spent"}
    for run in alone + [r for r in shared if memory_race(results.get(r[0], {}))]:
        if left() < 40:
            results[run[0]] = {"error": "skipped: time budget spent"}
            continue
        t0 = time.perf_counter()
        results[run[0]] = finish_worker(start_worker(make_spec(run, 0.5), pythonpath_for(run)),
                                        t0, min(left(), 180))
        note(run[0])
    return results


def prove(args, runs: list, comparisons: list) -> tuple[str, bool]:
    """The whole proof on this machine's GPU: patched vLLM, checkpoints, every run, the dump comparisons,
    the report (written to args.out, the raw results beside it as JSON). -> (report, overall pass)."""
    t_start = time.perf_counter()
    import torch

    args.device_name = (f"{torch.cuda.get_device_name()} (cc "
                        f"{'.'.join(map(str, torch.cuda.get_device_capability()))})"
                        if torch.cuda.is_available() else "no GPU")
    log: list[str] = []
    patched_pp, upstream_pp, how = prepare_vllm(args, log)
    explicit_upstream = patched_pp == upstream_pp  # same tree: ask for FLASHMLA_SPARSE by name
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dsa_proof_"))
    if args.only:
        only = set(args.only.split(","))
        runs = [r for r in runs if r[0] in only]
    model_dirs = {}
    for name, overrides in MODELS.items():
        if not any(r[1] == name for r in runs):
            continue
        model_dirs[name] = work / name
        if not (model_dirs[name] / "config.json").exists():
            make_model(model_dirs[name], overrides)

    g = torch.Generator().manual_seed(1234)
    rand = lambda n: torch.randint(2, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(n) for n in PROMPT_LENS]
    tf_sequences = [p + rand(GREEDY_STEPS) for p in prompts]
    tps_prompts = [rand(300 + 7 * i) for i in range(TPS_BATCH)]

    dumping = args.isolate or not args.no_dump
    dump_dir = work / "dumps"
    dump_dir.mkdir(exist_ok=True)

    def make_spec(run, mem):
        name, model, path, kv, graphs, tps = run
        chunked = name.endswith(CHUNK_SUFFIX)  # other schedule: its dumps cannot be compared
        return dict(model_dir=str(model_dirs[model]), path=path, kv=kv, graphs=graphs, tps=tps,
                    prompts=prompts, tf_sequences=tf_sequences, tps_prompts=tps_prompts,
                    explicit_upstream=explicit_upstream, mem=mem, chunk=512 if chunked else 256,
                    dump_path=str(dump_dir / (name.replace("/", "_") + ".pt"))
                    if dumping and not chunked else None)

    results = run_all(runs, make_spec,
                      lambda run: upstream_pp if run[2] == "upstream" else patched_pp,
                      t_start, max(1, args.parallel))

    dumps = {}
    if dumping:
        for cand, ref, _ in comparisons:
            pc = dump_dir / (cand.replace("/", "_") + ".pt")
            pr = dump_dir / (ref.replace("/", "_") + ".pt")
            if pc.exists() and pr.exists() and "error" not in results.get(cand, {"error": 1}):
                dumps[cand] = compare_dumps(str(pc), str(pr), index_topk(cand))
    elapsed = time.perf_counter() - t_start
    text, ok = report(args, how, log, results, runs, comparisons, dumps, elapsed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({
        "meta": {"device": args.device_name, "how": how, "elapsed_s": round(elapsed, 1)},
        "runs": results, "dumps": dumps}))
    return text, ok

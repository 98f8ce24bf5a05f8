"""check-gguf on hostile files: every one gets OK or exact PROBLEM lines (exit 1), fast, in little memory.

Each file is written here byte by byte (tests/gguf/ggufbytes.py): lying counts, values of the wrong type,
bounds no model has, files that are not files.  A passing small glm-dsa header is the base every
case changes in one place.
"""
from __future__ import annotations

import math
import os
import signal
import stat
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsa_installer.gguf_check import SHOWN, check_gguf
from overlay.gguf import reader

from . import ggufbytes as gb

REPO = Path(__file__).resolve().parents[2]
CORRUPT = ": corrupt metadata; re-download or re-convert the file"
# check-gguf in a child: python -c CLI REPO PATH
CLI = ("import sys; sys.path.insert(0, sys.argv[1]); from dsa_installer.gguf_check import check_gguf; "
       "check_gguf(sys.argv[2:])")


def run(*args):
    res = CliRunner().invoke(check_gguf, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res.exit_code, res.output


def problems(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("PROBLEM ")]


def timed_and_small(*args, limit_s: float = 2.0, limit_mib: int = 64):
    """Run check-gguf; assert it took under ``limit_s`` and allocated under ``limit_mib`` at its peak."""
    t0 = time.perf_counter()
    code, out = run(*args)
    elapsed = time.perf_counter() - t0
    assert elapsed < limit_s, f"check-gguf took {elapsed:.2f}s"
    tracemalloc.start()
    try:
        assert run(*args) == (code, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit_mib << 20, f"check-gguf allocated {peak / 2**20:.0f} MiB at its peak"
    return code, out


def refused_lines(path) -> list[str]:
    """check-gguf must refuse ``path`` (exit 1, fast, small): its PROBLEM lines."""
    code, out = timed_and_small(path)
    assert code == 1 and "check-gguf: OK" not in out, out
    return problems(out)


def refused(tmp_path, meta: dict | None = None, **kw) -> tuple[Path, list[str]]:
    """The base file with ``meta`` changed (``kw``: ggufbytes.write's lies), refused: its PROBLEM lines."""
    p = tmp_path / "hostile.gguf"
    gb.glm_dsa_file(p, meta=meta, **kw)
    return p, refused_lines(p)


def _payload_at(path, key: str) -> int:
    """Byte offset just after the array header (type, element type, count) of metadata key ``key``."""
    raw = Path(path).read_bytes()
    return raw.index(gb.s(key)) + len(gb.s(key)) + 4 + 12


def test_base_file_is_ok(tmp_path):
    p = tmp_path / "small.gguf"
    gb.glm_dsa_file(p)
    code, out = timed_and_small(p)
    assert code == 0 and problems(out) == [] and out.rstrip().endswith("check-gguf: OK"), out
    assert "layers: 3 (1 dense, 2 MoE)" in out


# --- lying array counts, alignment, nesting ---

@pytest.mark.parametrize("count", [2**61, 2**63 + 5, 2**64 - 1])
def test_array_count_beyond_the_file(tmp_path, count):
    p, probs = refused(tmp_path, meta={"general.junk": gb.Typed(gb.ARR, (gb.U8, []), count=count)})
    assert probs == [f"PROBLEM {p}: the array general.junk at byte {_payload_at(p, 'general.junk')} "
                     f"claims {count} elements, more than the file can hold or than 2097152 in all: "
                     "corrupt header"]


def test_arrays_beyond_the_element_budget(tmp_path):
    # every element really in the file, but more than a header may hold in all
    n = reader.MAX_ARRAY_ELEMENTS + 1
    p, probs = refused(tmp_path, meta={"general.big": gb.Raw(gb.ARR, struct.pack("<IQ", gb.U8, n) + bytes(n))})
    assert probs == [f"PROBLEM {p}: the array general.big at byte {_payload_at(p, 'general.big')} claims "
                     f"{n} elements, more than the file can hold or than {n - 1} in all: corrupt header"]


def test_string_array_count_beyond_the_file(tmp_path):
    p, probs = refused(tmp_path, meta={"tokenizer.ggml.tokens": gb.Typed(gb.ARR, (gb.STR, ["a", "b"]), count=2**62)})
    at = _payload_at(p, "tokenizer.ggml.tokens")
    assert probs == [f"PROBLEM {p}: the string array tokenizer.ggml.tokens at byte {at} claims "
                     f"{2**62} elements, more than the file can hold or than 2097152 in all: corrupt header"]


@pytest.mark.parametrize("align, shown", [(0, "0 (an integer)"), ("x", "'x' (a string)"), (48, "48 (an integer)"),
                                          (gb.Typed(gb.F32, math.nan), "nan (a float)")])
def test_bad_alignment(tmp_path, align, shown):
    p, probs = refused(tmp_path, meta={"general.alignment": align})
    assert probs == [f"PROBLEM {p}: general.alignment is {shown}, expected a power of two: corrupt header"]


def test_arrays_nested_5000_deep(tmp_path):
    deep = struct.pack("<IQ", gb.ARR, 1) * 5000 + struct.pack("<IQ", gb.U8, 0)
    p, probs = refused(tmp_path, meta={"general.nested": gb.Raw(gb.ARR, deep)})
    assert probs == [f"PROBLEM {p}: metadata key general.nested nests arrays deeper than 3 levels: corrupt header"]


def test_key_with_a_newline_stays_one_line(tmp_path):
    p, probs = refused(tmp_path, meta={"evil\nPROBLEM none": gb.Typed(gb.ARR, (gb.U8, []), count=2**61)})
    at = _payload_at(p, "evil\nPROBLEM none")
    assert probs == [f"PROBLEM {p}: the array evil\\nPROBLEM none at byte {at} claims {2**61} elements, "
                     "more than the file can hold or than 2097152 in all: corrupt header"]


@pytest.mark.parametrize("field, n", [("tensors", 2**63), ("keys", 2**40)])
def test_header_counts_beyond_the_file(tmp_path, field, n):
    p, probs = refused(tmp_path, **{"n_tensors" if field == "tensors" else "n_kv": n})
    what = f"{n} tensors, more than the file can hold (or than 65536)" if field == "tensors" else \
        f"{n} metadata keys, more than the file can hold"
    assert probs == [f"PROBLEM {p}: the header claims {what}: corrupt header"]


# --- values of the wrong type or out of bounds where the config is made ---

A = "glm-dsa."


@pytest.mark.parametrize("key, value, expected", [
    (A + "block_count", gb.Typed(gb.F32, math.nan), "nan (a float), expected an integer"),
    (A + "embedding_length", gb.Typed(gb.F64, math.inf), "inf (a float), expected an integer"),
    (A + "block_count", "79", "'79' (a string), expected an integer"),
    ("tokenizer.ggml.tokens", gb.Typed(gb.U32, 7), "7 (an integer), expected an array of strings"),
    ("tokenizer.ggml.tokens", gb.Typed(gb.ARR, (gb.U32, [1, 2])),
     "[1, 2] (an array of 2), expected an array of strings"),
    (A + "attention.indexer.types", gb.Typed(gb.U32, 1), "1 (an integer), expected an array of integers"),
    (A + "block_count", 0, "0 (an integer), expected 1 to 4096"),
    (A + "block_count", 2**32 - 1, "4294967295 (an integer), expected 1 to 4096"),
    (A + "block_count", 200000, "200000 (an integer), expected 1 to 4096"),
    (A + "nextn_predict_layers", 4, "4 (an integer), expected 0 to 3"),
    (A + "leading_dense_block_count", 9, "9 (an integer), expected 0 to 3"),
    (A + "attention.layer_norm_rms_epsilon", gb.Typed(gb.F32, -1.0),
     "-1.0 (a float), expected a finite positive number"),
    (A + "expert_weights_norm", gb.Typed(gb.U32, 2), "2 (an integer), expected a boolean"),
])
def test_metadata_of_the_wrong_type_or_bounds(tmp_path, key, value, expected):
    p, probs = refused(tmp_path, meta={key: value})
    assert probs == [f"PROBLEM {p}: {key} is {expected}{CORRUPT}"]


def test_rope_scaling_factor_not_a_number(tmp_path):
    p, probs = refused(tmp_path, meta={A + "rope.scaling.type": "yarn", A + "rope.scaling.factor": "x"})
    assert probs == [f"PROBLEM {p}: {A}rope.scaling.factor is 'x' (a string), expected a finite positive "
                     f"number{CORRUPT}"]


def test_thousands_of_missing_tensors_are_capped(tmp_path):
    # a block_count inside the bounds, tensors for 4 blocks: ~92,000 problems, 40 printed and counted
    p = tmp_path / "blocks.gguf"
    gb.glm_dsa_file(p, meta={A + "block_count": 4000})
    code, out = timed_and_small(p)
    probs = problems(out)
    assert code == 1 and len(probs) == SHOWN + 1 and probs[-1].startswith("PROBLEM ... and ")
    total = int(out.splitlines()[-1].split()[1])
    assert probs[-1] == f"PROBLEM ... and {total - SHOWN} more" and total > 90000
    assert out.splitlines()[-1] == f"check-gguf: {total} problem(s), the first {SHOWN} shown; fix them before loading"
    assert probs[0] == f"PROBLEM {p}: tensor blk.4.attn_norm.weight missing (expected shape [256])"
    assert len(out.splitlines()) < 60


def test_q4_k_rows_of_8(tmp_path):
    # kv_lora_rank 8: attn_v_b's rows are 8 wide; as Q4_K (blocks of 256) no row is whole
    p = tmp_path / "rows.gguf"
    c = dict(gb.SMALL, kv_lora_rank=8)
    infos = [(n, shp, "Q4_K" if n == "blk.0.attn_v_b.weight" else t) for n, shp, t in gb.glm_dsa_tensors(c)]
    assert ("blk.0.attn_v_b.weight", (2, 32, 8), "Q4_K") in infos
    gb.write(p, gb.glm_dsa_meta(c), infos)
    assert refused_lines(p) == [f"PROBLEM {p}: tensor blk.0.attn_v_b.weight: ggml type Q4_K packs rows in blocks "
                                "of 256 elements, but its rows have 8; the file is corrupt, re-convert it"]


def test_garbage_named_as_part_1_of_0(tmp_path):
    p = tmp_path / "x-00001-of-00000.gguf"
    p.write_bytes(os.urandom(4096))
    assert refused_lines(p) == [f"PROBLEM {p}: the name says part 1 of 0, which no split set has (llama-gguf-split "
                                "names them -00001-of-0000N.gguf); rename the file"]


def test_garbage_file(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"\x7fELF" + os.urandom(4092))
    assert refused_lines(p) == [f"PROBLEM {p}: not a GGUF file (magic b'\\x7fELF')"]


def test_huge_sparse_file_under_a_4_gib_address_space(tmp_path):
    """A 400 GiB (sparse) GLM-5-sized file: the header is read without mapping the file."""
    ok, junk = tmp_path / "GLM-5.gguf", tmp_path / "zeros.gguf"
    gb.glm_dsa_file(ok, gb.GLM5)
    os.truncate(ok, 400 << 30)
    with open(junk, "wb") as f:
        f.truncate(400 << 30)
    probe = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); " + CLI
    for path, code, last in ((ok, 0, "check-gguf: OK"), (junk, 1, "check-gguf: 1 problem(s); fix them before loading")):
        proc = subprocess.run([sys.executable, "-c", probe, str(REPO), str(path)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == code, proc.stdout + proc.stderr
        assert proc.stdout.splitlines()[-1] == last and "Traceback" not in proc.stderr
    assert problems(proc.stdout) == [f"PROBLEM {junk}: not a GGUF file (magic b'\\x00\\x00\\x00\\x00')"]


# --- paths that are not GGUF files: each says what it is, none hangs ---

class _NoHang:
    def __enter__(self):
        def boom(*_):
            raise TimeoutError("check-gguf hung")
        self.old = signal.signal(signal.SIGALRM, boom)
        signal.alarm(10)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.old)


def _unreadable_problem(tmp_path) -> str:
    """The PROBLEM line for a file this user cannot read: as root, from a child without the capabilities
    that bypass file permissions (setpriv); else in-process."""
    p = tmp_path / "secret.gguf"
    gb.glm_dsa_file(p)
    os.chmod(p, 0)
    if os.geteuid() != 0:
        return problems(run(p)[1])[0]
    proc = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-c",
                           CLI, str(REPO), str(p)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return problems(proc.stdout)[0]


def test_paths_that_are_not_gguf_files(tmp_path):
    missing = tmp_path / "missing.gguf"
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.gguf"
    os.symlink(loop.name, loop)
    dangling = tmp_path / "dangling.gguf"
    os.symlink("nowhere.gguf", dangling)
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    want = {
        missing: f"PROBLEM {missing}: no such file",
        Path("/dev/zero"): "PROBLEM /dev/zero: is a character device, not a GGUF file",
        fifo: f"PROBLEM {fifo}: is a named pipe (FIFO), not a GGUF file; give the downloaded .gguf file",
        loop: f"PROBLEM {loop}: symlink loop (the link resolves back to itself); point it at the .gguf file",
        dangling: f"PROBLEM {dangling}: broken symlink (its target nowhere.gguf does not exist)",
        folder: f"PROBLEM {folder}: is a directory, not a GGUF file; give the .gguf file (of a split model: its "
                "-00001-of- part)",
    }
    assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)
    with _NoHang():
        got = {path: refused_lines(path) for path in want}
    assert got == {path: [line] for path, line in want.items()}
    secret = _unreadable_problem(tmp_path)
    assert secret == f"PROBLEM {tmp_path / 'secret.gguf'}: permission denied; make the file (and its folders) " \
                     "readable to this user"
    messages = [line.split(": ", 1)[1] for line in [*want.values(), secret]]
    assert len(set(messages)) == len(messages) and not any("shard missing" in m for m in messages)


def test_split_part_that_is_a_directory(tmp_path):
    # a part other than the one named on the command line is still described, not called "missing"
    first = tmp_path / "m-00001-of-00002.gguf"
    gb.glm_dsa_file(first, meta={"split.count": gb.Typed(gb.U16, 2), "split.no": gb.Typed(gb.U16, 0)})
    (tmp_path / "m-00002-of-00002.gguf").mkdir()
    assert refused_lines(first) == [f"PROBLEM {tmp_path / 'm-00002-of-00002.gguf'}: is a directory, not a GGUF "
                                    "file; give the .gguf file (of a split model: its -00001-of- part)"]


def test_loader_hooks_on_hostile_files(tmp_path):
    """vLLM's hooks pass what is not a glm-dsa file on to vLLM and refuse a corrupt one in one line."""
    from overlay import gguf_glm_dsa as hooks

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    garbage = tmp_path / "x-00001-of-00000.gguf"
    garbage.write_bytes(os.urandom(64))
    with _NoHang():
        for p in (fifo, garbage, tmp_path / "missing.gguf", Path("/dev/zero")):
            assert hooks.weights_map(p) is None and hooks.config_for_gguf(str(p)) is None
            assert hooks.tokenizer_for_gguf(str(p)) == str(p)
    corrupt = tmp_path / "blocks.gguf"
    gb.glm_dsa_file(corrupt, meta={A + "block_count": 200000})
    with pytest.raises(reader.GGUFError) as exc:
        hooks.config_for_gguf(str(corrupt))
    assert str(exc.value) == f"{A}block_count is 200000 (an integer), expected 1 to 4096{CORRUPT}"

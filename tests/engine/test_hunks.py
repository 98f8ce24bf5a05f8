"""The in-memory hunk applier on real vLLM sources: exact context, offsets, ambiguity, EOF without newline."""

import random
from pathlib import Path

import pytest

from dsa_installer import hunks
from dsa_installer.errors import UserError

from .conftest import VERSIONS
from tools import patchset


def _diff_file(tmp_path: Path, text: str) -> hunks.FileDiff:
    path = tmp_path / "x.diff"
    path.write_text(text)
    return hunks.parse(path)


def _random_edit(lines: list[bytes], rng: random.Random) -> list[bytes]:
    out = list(lines)
    for _ in range(rng.randint(1, 6)):
        i = rng.randrange(len(out) + 1)
        kind = rng.choice(["insert", "delete", "replace"])
        if kind == "insert" or not out or i == len(out):
            out[i:i] = [f"# inserted {rng.random()}\n".encode() for _ in range(rng.randint(1, 3))]
        elif kind == "delete":
            del out[i : i + rng.randint(1, 3)]
        else:
            out[i] = b"    pass  # replaced\n"
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_make_diff_then_apply_reproduces_random_edits_of_real_files(version, tmp_path):
    root = patchset.fetch(version, quiet=True)
    rng = random.Random(20261129)
    files = sorted((root / "vllm").rglob("*.py"))
    for src in rng.sample(files, 25):
        before = src.read_bytes()
        if not before:
            continue
        after = b"".join(_random_edit(hunks._lf_split(before), rng))
        rel = src.relative_to(root).as_posix()
        diff = _diff_file(tmp_path, hunks.make_diff(before, after, rel))
        assert diff.target == rel
        result, offsets = hunks.apply(before, diff)
        assert result == after and set(offsets) == {0}, rel


def test_last_line_without_newline(tmp_path):
    before, after = b"a\nb\nc", b"a\nb\nC\nd"
    diff = _diff_file(tmp_path, hunks.make_diff(before, after, "vllm/x.py"))
    assert "\\ No newline at end of file" in diff.path.read_text()
    assert hunks.apply(before, diff)[0] == after
    back = _diff_file(tmp_path, hunks.make_diff(after, before, "vllm/x.py"))
    assert hunks.apply(after, back)[0] == before


def test_offset_is_found_only_when_unique(tmp_path):
    base = [f"line {i}\n".encode() for i in range(40)]
    before = b"".join(base)
    after = before.replace(b"line 20\n", b"line twenty\n")
    diff = _diff_file(tmp_path, hunks.make_diff(before, after, "vllm/x.py"))
    shifted = b"new\n" * 7 + before
    assert hunks.apply(shifted, diff) == (b"new\n" * 7 + after, [7])
    doubled = before + before  # the context now occurs twice below the expected place: ambiguous
    with pytest.raises(UserError, match="hunk 1 .* does not apply to vllm/x.py: its context lines differ"):
        hunks.apply(b"x\n" * 3 + doubled, diff)
    # at the expected place the first occurrence wins without a search
    assert hunks.apply(doubled, diff)[0] == after + before


def test_whitespace_counts(tmp_path):
    before = b"def f():\n    return 1\n\nx = 2\n"
    diff = _diff_file(tmp_path, hunks.make_diff(before, before.replace(b"x = 2", b"x = 3"), "vllm/x.py"))
    with pytest.raises(UserError, match="context lines differ"):
        hunks.apply(before.replace(b"    return 1", b"    return 1 "), diff)
    with pytest.raises(UserError, match="context lines differ"):
        hunks.apply(before.replace(b"\n", b"\r\n"), diff)


def test_form_feed_and_crlf_inside_lines_are_plain_bytes(tmp_path):
    before = b"a = 1\n\x0c\nb = '\r'\nc = 3\n"
    after = before.replace(b"c = 3", b"c = 4")
    diff = _diff_file(tmp_path, hunks.make_diff(before, after, "vllm/x.py"))
    assert hunks.apply(before, diff)[0] == after

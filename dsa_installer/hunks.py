"""Parse a one-file unified diff with unidiff and apply its hunks in memory, with zero fuzz.

Every context and removed line must match the target byte for byte. A hunk is tried at the line its
header names (shifted by what earlier hunks added or removed); only if the context is not there is it
searched elsewhere, and then it must match at exactly one place after the previous hunk (an offset, as
with `patch`, never fuzz). With the pristine-hash check in force the first try always hits; offsets
matter only for `--force-version` on a neighbouring release."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from unidiff import PatchSet
from unidiff.constants import LINE_TYPE_ADDED, LINE_TYPE_CONTEXT, LINE_TYPE_NO_NEWLINE, LINE_TYPE_REMOVED
from unidiff.errors import UnidiffParseError

from . import resources
from .errors import UserError


@dataclass(frozen=True)
class Hunk:
    header: str              # "@@ -651,7 +651,9 @@"
    start: int               # 0-based index of the first source line (insertion point if `old` is empty)
    old: tuple[bytes, ...]   # context + removed lines, as in the source
    new: tuple[bytes, ...]   # context + added lines, as in the result


@dataclass(frozen=True)
class FileDiff:
    path: Path               # the .diff file
    target: str              # "vllm/..." relative to site-packages
    hunks: tuple[Hunk, ...]


def parse(path: Path) -> FileDiff:
    """Parse `path`; a malformed diff, or one not patching exactly one existing file, is a UserError."""
    name = resources.display(path)
    try:
        text = path.read_bytes().decode("utf-8")
        files = PatchSet(_lf_split(text))
    except (OSError, UnicodeDecodeError, UnidiffParseError) as exc:
        raise UserError(f"{name}: malformed patch ({exc}); restore it from git or regenerate it") from None
    if len(files) != 1:
        raise UserError(f"{name}: malformed patch (patches {len(files)} files, expected exactly one); regenerate it")
    pf = files[0]
    if pf.is_binary_file or pf.is_added_file or pf.is_removed_file or not len(pf):
        raise UserError(f"{name}: malformed patch (must modify one existing text file with hunks); regenerate it")
    source, target = _strip(pf.source_file, "a/"), _strip(pf.target_file, "b/")
    if source is None or target is None or source != target:
        raise UserError(f"{name}: malformed patch (paths must be a/vllm/... and b/vllm/..., the same file); regenerate it")
    return FileDiff(path, target, tuple(_hunk(h) for h in pf))


def apply(data: bytes, diff: FileDiff) -> tuple[bytes, list[int]]:
    """The patched bytes and each hunk's offset (0 when it applied where its header says)."""
    lines = _lf_split(data)
    out: list[bytes] = []
    pos = 0          # next unconsumed source line
    shift = 0        # offset carried from earlier hunks (applies to later ones, like `patch`)
    offsets = []
    for number, hunk in enumerate(diff.hunks, 1):
        at = _locate(lines, hunk, pos, hunk.start + shift)
        if at is None:
            where = resources.display(diff.path)
            raise UserError(
                f"{where}: hunk {number} ({hunk.header}) does not apply to {diff.target}: its context lines "
                f"differ (zero fuzz); this patch set does not fit this vLLM build"
            )
        shift = at - hunk.start
        offsets.append(shift)
        out.extend(lines[pos:at])
        out.extend(hunk.new)
        pos = at + len(hunk.old)
    out.extend(lines[pos:])
    return b"".join(out), offsets


def _locate(lines: list[bytes], hunk: Hunk, lo: int, expected: int) -> int | None:
    n = len(hunk.old)

    def fits(i: int) -> bool:
        return lo <= i <= len(lines) - n and tuple(lines[i : i + n]) == hunk.old

    if fits(expected):
        return expected
    matches = [i for i in range(lo, len(lines) - n + 1) if fits(i)]
    return matches[0] if len(matches) == 1 and n else None


def _hunk(h) -> Hunk:
    old: list[bytes] = []
    new: list[bytes] = []
    last = None
    for line in h:
        kind = line.line_type
        if kind == LINE_TYPE_NO_NEWLINE:  # "\ No newline at end of file" ends the previous line
            for side in last:
                side[-1] = side[-1].removesuffix(b"\n")
            continue
        value = line.value.encode("utf-8")
        sides = {LINE_TYPE_CONTEXT: (old, new), LINE_TYPE_REMOVED: (old,), LINE_TYPE_ADDED: (new,)}.get(kind, ())
        for side in sides:
            side.append(value)
        last = sides
    start = h.source_start - 1 if h.source_length else h.source_start
    header = f"@@ -{h.source_start},{h.source_length} +{h.target_start},{h.target_length} @@"
    return Hunk(header, start, tuple(old), tuple(new))


def _strip(name: str | None, prefix: str) -> str | None:
    if not name or not name.startswith(prefix):
        return None
    p = PurePosixPath(name[len(prefix):])
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] != "vllm":
        return None
    return str(p)


def _lf_split(data):
    """Split on '\\n' only, keeping it (str.splitlines would also split on \\r, \\f, \\x1c, ...)."""
    nl = b"\n" if isinstance(data, bytes) else "\n"
    parts = data.split(nl)
    lines = [p + nl for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def make_diff(before: bytes, after: bytes, target: str, context: int = 3) -> str:
    """A unified diff `a/<target>` -> `b/<target>` that `parse`/`apply` read back exactly (including a
    last line without a newline)."""
    a, b = _lf_split(before.decode("utf-8")), _lf_split(after.decode("utf-8"))
    out = []
    for line in difflib.unified_diff(a, b, f"a/{target}", f"b/{target}", n=context):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)

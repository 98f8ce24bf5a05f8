"""Every repository path cited in the docs, and in the comments and docstrings of the code, exists.

Read: README.md, ARCHITECTURE.md, bench/*.md, CHANGELOG.md's [Unreleased] section (a released section is
history and may name files moved since; nothing is released yet), outside fenced code blocks (those hold
commands and examples); the comments and docstrings of every *.py of dsa_installer/, overlay/, tools/,
bench/, tests/ and the repository root.

A citation is a path with a `/` that starts at a top-level folder of the repository (`overlay/`,
`tests/gpu/`, ...) or ends in a known extension (`kernels/indexer.py`), or a bare upper-case markdown name
(`FACTS.md`). Not repository paths, so not checked: vLLM's own paths (`vllm/...`, except
`vllm/_dsa_overlay/...`, which apply copies from `overlay/`), paths outside the checkout (`../`, `~`, `/`,
`$OUT`, `<site-packages>/...`), URLs, and working folders .gitignore keeps out of the repository (`.stage/`).
A cited path exists when it names a file or folder relative to the repository root, the citing file's folder,
the runtime tree `overlay/` (for the files inside it, whose comments cite it so), an installed wheel's
package data (pyproject's package-dir), or vLLM's package in a supported release (`platforms/cuda.py`).
Placeholders (`<version>`, `{name}`, `X`, `VERSION`, `*`, one-letter names such as `x.py`) match any name.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import tokenize
from pathlib import Path

import pytest

from dsa_installer import manifest
from tools import patchset

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
TOP = ("overlay", "dsa_installer", "patches", "tests", "bench", "tools", ".ci")
CODE_DIRS = ("dsa_installer", "overlay", "tools", "bench", "tests")
EXTENSIONS = ("py", "md", "toml", "diff", "json", "sh", "txt", "cfg", "yaml", "yml", "csv")
PATH = re.compile(r"(?<![\w./~$@:<>+-])((?:[\w.<>{}*+-]+/)+[\w.<>{}*+-]*)")
BARE_MD = re.compile(r"(?<![\w./~$@:-])([A-Z][A-Z0-9_]*\.md)\b")
PLACEHOLDER = re.compile(r"<[^>]*>|\{[^}]*\}|\bX\b|\bVERSION\b|\.\.\.|^[a-z](?=\.\w+$|$)")



def markdown_prose(path: Path) -> list[tuple[int, str]]:
    lines, fenced = [], False
    text = path.read_text().splitlines()
    if path.name == "CHANGELOG.md":  # the current section only
        start = text.index("## [Unreleased]")
        end = next((i for i in range(start + 1, len(text)) if text[i].startswith("## ")), len(text))
        text = [""] * start + text[start:end]
    for number, line in enumerate(text, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    return out


def sources() -> dict[str, list[tuple[int, str]]]:
    docs = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "CHANGELOG.md", *sorted((REPO / "bench").glob("*.md"))]
    code = sorted(REPO.glob("*.py")) + [p for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    out = {p.relative_to(REPO).as_posix(): markdown_prose(p) for p in docs}
    out.update({p.relative_to(REPO).as_posix(): comments_and_docstrings(p) for p in code
                if p != Path(__file__)})  # this file quotes dead paths on purpose
    return out


def citations(text: str) -> list[str]:
    found = []
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        parts = path.split("/")
        last = parts[-1] if parts[-1] else parts[-2]
        if parts[0] in TOP or parts[0] == "vllm" or ("." in last and last.rsplit(".", 1)[1] in EXTENSIONS):
            found.append(path)
    return found + BARE_MD.findall(text)


def ignored_roots() -> list[str]:
    """Root folders .gitignore keeps out of the repository (`/.stage/` -> `.stage`)."""
    lines = (REPO / ".gitignore").read_text().splitlines()
    return [line.strip("/") for line in lines if line.startswith("/") and line.endswith("/")]


def repo_path(cited: str) -> str | None:
    """The repository-relative form of a cited path, or None when it is not a repository path."""
    if cited.startswith(("../", "~", "/", "$", "<", "http")) or "://" in cited:
        return None
    parts = cited.split("/")
    if any(fnmatch.fnmatch(parts[0], pattern) for pattern in ignored_roots()):
        return None
    if cited.startswith("vllm/_dsa_overlay"):
        return "overlay" + cited[len("vllm/_dsa_overlay"):]
    if "vllm" in parts:  # vLLM's own tree (vllm/..., a/vllm/..., site-packages/vllm/...)
        return None
    return cited


def installed_layout() -> dict[str, str]:
    """Package data an installed wheel holds elsewhere: {installed folder: repository folder}."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {package.replace(".", "/"): folder for package, folder in setuptools.get("package-dir", {}).items()}


def exists(path: str, base: Path) -> bool:
    pattern = "/".join(PLACEHOLDER.sub("*", part) for part in path.split("/") if part)
    return next(base.glob(pattern), None) is not None


@pytest.fixture(scope="module")
def vllm_packages() -> list[Path]:
    return [patchset.fetch(v, quiet=True) / "vllm" for v in manifest.supported_versions()]


def resolves(path: str, citing: str, vllm_packages: list[Path]) -> bool:
    for installed, folder in installed_layout().items():
        if installed.startswith(path.rstrip("/")):
            return True
        if path.startswith(installed + "/"):
            path = folder + path[len(installed):]
    bases = [REPO, (REPO / citing).parent] + ([REPO / "overlay"] if citing.startswith("overlay/") else [])
    if path.split("/")[0] not in TOP:  # a path relative to vLLM's package
        bases += vllm_packages
    return any(exists(path, base) for base in bases)


def dead_references(vllm_packages) -> set[tuple[str, str]]:
    dead = set()
    for citing, texts in sources().items():
        for _, text in texts:
            for cited in citations(text):
                path = repo_path(cited)
                if path is not None and not resolves(path, citing, vllm_packages):
                    dead.add((citing, cited))
    return dead


def test_every_cited_path_exists(vllm_packages):
    dead = dead_references(vllm_packages)
    assert sorted(dead) == [], "cited paths that do not exist (citing file, path)"


def test_the_checker_on_a_made_up_text(vllm_packages):
    """Each kind of citation is found; paths outside the repository are left out; the dead ones are dead."""
    text = ("see `overlay/selection.py`, tests/gpu/ and FACTS.md; the hook in `platforms/cuda.py`; "
            "`patches/<version>/manifest.toml`, patches/0.23.0/x.diff, `kernels/nothing_here.py`, bench/*.md, "
            "vllm/_dsa_overlay/kernels/sparse_mla.py, vllm/_dsa_overlay/kernels/gone.py, `kernels/indexer.py`, "
            "dsa_installer/_data/patches/0.23.0/manifest.toml; not: vllm/config.py, a/vllm/platforms/cuda.py, "
            "../shared/device/README.md, .stage/p6/unpack.sh, <site-packages>/vllm/.dsa_overlay/state.json; "
            "not even found: ~/.cache/dsa-overlay/x.py, $OUT/a.md, https://github.com/vllm-project/vllm/x.py, "
            "sm_80/86/89, auto/bfloat16, config.json")
    cited = citations(text)
    checked = [c for c in cited if repo_path(c) is not None]
    assert checked == ["overlay/selection.py", "tests/gpu/", "platforms/cuda.py", "patches/<version>/manifest.toml",
                       "patches/0.23.0/x.diff", "kernels/nothing_here.py", "bench/*.md",
                       "vllm/_dsa_overlay/kernels/sparse_mla.py", "vllm/_dsa_overlay/kernels/gone.py",
                       "kernels/indexer.py", "dsa_installer/_data/patches/0.23.0/manifest.toml", "FACTS.md"]
    assert [c for c in cited if c not in checked] == ["vllm/config.py", "a/vllm/platforms/cuda.py",
                                                      "../shared/device/README.md", ".stage/p6/unpack.sh",
                                                      "<site-packages>/vllm/.dsa_overlay/state.json"]
    dead = [c for c in checked if not resolves(repo_path(c), "overlay/indexer_ops.py", vllm_packages)]
    assert dead == ["tests/gpu/", "kernels/nothing_here.py", "vllm/_dsa_overlay/kernels/gone.py", "FACTS.md"]
    assert not resolves("kernels/indexer.py", "bench/RESULTS.md", [])  # runtime-tree-relative only inside it

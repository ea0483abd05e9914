"""House rules of the code (docs/contributing.md, "House rules"), read from every tracked Python
file and the docs' section titles:

- no banner comment blocks (``# ----``, ``# ====``, ``#####`` lines);
- no history in names or section titles ("round three", "new in ...", ``*_v2`` names);
- no paths outside the repository in comments and docstrings (``shared/...``, ``../``,
  absolute paths of a machine);
- flags passed by keyword: a call of a function of the project with a bare ``True`` or
  ``False`` among its positional arguments fails (compiled functions, ``@triton.jit`` and
  ``jax.jit`` ones, are left out: their launches and static arguments follow the compiler's
  conventions).

Each rule is a function from a file's text to the violations it finds, so the test that plants
one of each in a temporary file runs the same functions.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BANNER = re.compile(r"^\s*#\s*(#{4,}|={4,}|-{4,}|\*{4,}|~{4,})")
HISTORY = re.compile(
    r"\bround (one|two|three|four|five|six|\d+)\b|\bnew in\b|\bv\d+ style\b", re.IGNORECASE
)
VERSIONED_NAME = re.compile(r"(^|_)v\d+$|[a-z]V\d+$")
OUTSIDE_PATH = re.compile(r"(?<![\w./-])(\.\./|shared/|/work/|/home/|/tmp/|/Users/)")


def _tracked(pattern: str) -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in listed if (ROOT / p).is_file()]


def _comments(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None and node.body:
                out.append((node.body[0].lineno, doc))
    return out


def banners(text: str) -> list[str]:
    return [f"{n}: banner" for n, line in enumerate(text.splitlines(), 1) if BANNER.match(line)]


def history(text: str) -> list[str]:
    out = [f"{n}: history in {c.strip()[:60]!r}" for n, c in _comments(text) if HISTORY.search(c)]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if VERSIONED_NAME.search(node.name):
                out.append(f"{node.lineno}: versioned name {node.name}")
    return out


def outside_paths(text: str) -> list[str]:
    return [
        f"{n}: path outside the repository in {c.strip()[:60]!r}"
        for n, c in _comments(text)
        if OUTSIDE_PATH.search(c)
    ]


def positional_flags(text: str, project: set[str]) -> list[str]:
    """Calls of a function named in ``project`` with a bare True/False passed positionally."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name not in project:
            continue
        if any(isinstance(a, ast.Constant) and isinstance(a.value, bool) for a in node.args):
            out.append(f"{node.lineno}: {name}(...) takes a flag positionally")
    return out


def project_functions(files: list[Path]) -> set[str]:
    """Names of the functions and classes defined in ``files``, less compiled functions and
    those that share a name with a common method of other libraries (a call cannot tell them
    apart)."""
    names, compiled = set(), set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    compiled.add(node.name)
    return names - compiled - SHARED_NAMES


# Names the project defines that calls of other libraries also use (dict.get, list.append, ...).
SHARED_NAMES = {"get", "update", "append", "run", "main", "__init__", "__call__", "setdefault"}


def violations(path: Path, project: set[str]) -> list[str]:
    text = path.read_text()
    found = banners(text) + history(text) + outside_paths(text)
    found += positional_flags(text, project)
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{v}" for v in found]


def doc_title_violations(path: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{n}: history in a section title"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if line.startswith("#") and HISTORY.search(line)
    ]


def test_the_code_keeps_the_house_rules():
    # this file names the violations it looks for (its patterns and planted examples)
    files = [f for f in _tracked("*.py") if f != Path(__file__).resolve()]
    project = project_functions(files)
    found = [v for path in files for v in violations(path, project)]
    found += [v for path in _tracked("*.md") for v in doc_title_violations(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        "# ------------------------------------------------------------ helpers\nx = 1\n",
        "x = 1\n# ========\n",
        "# round three: more families\nx = 1\n",
        "def attention_v2():\n    pass\n",
        "x = 1  # see shared/notes/kernels.md\n",
        'def f():\n    """Read ../shared/spec/fpa.md."""\n',
        "def flag(x, exact=False):\n    return x\n\n\nflag(1, True)\n",
    ],
)
def test_a_planted_violation_fails(tmp_path, planted):
    path = tmp_path / "planted.py"
    path.write_text(planted)
    assert violations(path, project_functions([path])), planted


def test_a_clean_file_passes(tmp_path):
    path = tmp_path / "clean.py"
    path.write_text(
        '"""The docs (docs/spec/fpa.md)."""\n\n\ndef flag(x, exact=False):\n    return x\n\n\n'
        "flag(1, exact=True)\n# a comment, 2 - 1 = 1\n"
    )
    assert violations(path, project_functions([path])) == []

"""The docs stay true to the code: includes resolve, every spec label is cited in the code and
shown beside it, the README and tutorial examples run, the citation metadata agree."""

import ast
import contextlib
import io
import os
import re
import shlex
import sys
import tomllib

import numpy as np
import pytest

from attnspec.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
EQUATION_PAGES = ["docs/fpa.md", "docs/interdomain.md"]
SPECS = ["docs/spec/fpa.md", "docs/spec/interdomain.md"]
INCLUDE = re.compile(r'^\s*-+8<-+\s+"([^"]+)"\s*$', re.M)
SECTION = re.compile(r"--8<-- \[(start|end):([a-z][-_0-9a-z]*)\]")


def read(path):
    with open(os.path.join(ROOT, path)) as fh:
        return fh.read()


def docs_pages():
    """Every Markdown page of the site, except the verbatim spec copy."""
    pages = []
    for folder, _, names in os.walk(DOCS):
        rel = os.path.relpath(folder, ROOT)
        if rel.startswith(os.path.join("docs", "spec")):
            continue
        pages += [os.path.join(rel, n) for n in sorted(names) if n.endswith(".md")]
    return sorted(pages)


def python_blocks(path, title=None):
    """Python code blocks of a page; with ``title``, those whose fence carries it ("": no title)."""
    blocks = re.findall(r'```python( title="[^"]*")?\n(.*?)```', read(path), flags=re.S)
    if title is None:
        return [body for _, body in blocks]
    want = f' title="{title}"' if title else ""
    return [body for fence, body in blocks if fence == want]


def spec_labels():
    """The labels the spec defines: (F1)-(F7), (G1)-(G4), T1-T6, (I1)-(I13), H1-H11."""
    labels = set()
    for spec in SPECS:
        text = read(spec)
        labels |= set(re.findall(r"\(([FGI]\d+)\)", text))
        labels |= set(re.findall(r"\((T\d+)\b", text))
        labels |= set(re.findall(r"\b(H\d+)\b", text))
    return labels


def section_lines(path):
    """{name: (first, last)} 1-based lines of each snippet section of a source file."""
    spans, starts = {}, {}
    for n, line in enumerate(read(path).splitlines(), 1):
        match = SECTION.search(line)
        if match and match.group(1) == "start":
            assert match.group(2) not in starts, f"{path}: section {match.group(2)} twice"
            starts[match.group(2)] = n
        elif match:
            spans[match.group(2)] = (starts.pop(match.group(2)), n)
    assert not starts, f"{path}: sections never ended: {sorted(starts)}"
    return spans


def cited_text(path, name):
    """What the code beside an equation says: the section's lines, and the docstring of the
    function (or class) that holds them, where the label of a whole function is cited."""
    first, last = section_lines(path)[name]
    lines = read(path).splitlines()
    text = "\n".join(lines[first : last - 1])
    tree = ast.parse(read(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            if node.lineno <= first <= node.end_lineno:
                text += "\n" + (ast.get_docstring(node) or "")
    return text


def test_spec_defines_the_labels_we_expect():
    expected = (
        {f"F{i}" for i in range(1, 8)}
        | {f"G{i}" for i in range(1, 5)}
        | {f"T{i}" for i in range(1, 7)}
        | {f"I{i}" for i in range(1, 15)}
        | {f"H{i}" for i in range(1, 12)}
    )
    assert spec_labels() == expected


@pytest.mark.parametrize("page", docs_pages())
def test_snippet_includes_resolve(page):
    for target in INCLUDE.findall(read(page)):
        path, _, section = target.partition(":")
        assert os.path.isfile(os.path.join(ROOT, path)), f"{page}: no file {path}"
        if re.fullmatch(r"\d+(:\d*)?", section):  # a line range: start[:end]
            length = read(path).count("\n")
            lines = [int(n) for n in section.split(":") if n]
            assert all(1 <= n <= length for n in lines), f"{page}: {path} has {length} lines"
        elif section:
            assert section in section_lines(path), f"{page}: no section {section} in {path}"


@pytest.mark.parametrize("page", docs_pages())
def test_no_mangled_snippet_markers(page):
    for line in read(page).splitlines():
        if re.search(r"-\s*8\s*<\s*-", line):
            assert INCLUDE.match(line), f"{page}: a snippet marker that will not resolve: {line}"


@pytest.mark.parametrize("page", docs_pages())
def test_code_excerpts_appear_verbatim_in_their_source(page):
    """A hand-copied excerpt (a block whose first line names a source file) must match it;
    the equation pages copy nothing by hand: their code comes from snippet sections."""
    for block in python_blocks(page):
        source, *lines = block.rstrip("\n").split("\n")
        path = source[2:].strip()
        if not source.startswith("# ") or not os.path.isfile(os.path.join(ROOT, path)):
            continue
        assert page not in EQUATION_PAGES, f"{page}: use a snippet section, not a copy"
        assert "\n".join(lines) in read(path), f"{page}: excerpt not found in {path}:\n{block}"


def test_every_spec_label_is_cited_in_the_code_and_shown_on_a_page():
    code = ""
    for package in ("reference", "theory"):
        for name in sorted(os.listdir(os.path.join(ROOT, package))):
            if name.endswith(".py"):
                code += read(os.path.join(package, name))
    shown = "".join(read(page) for page in docs_pages())
    for label in sorted(spec_labels()):
        assert re.search(rf"\b{label}\b", code), f"{label} is not cited in reference/ or theory/"
        assert f"\\tag{{{label}}}" in shown, f"{label} is not shown as a labelled equation"


@pytest.mark.parametrize("page", EQUATION_PAGES)
def test_labelled_equations_sit_beside_code_that_cites_them(page):
    """Each equation block holds a tagged equation and code from the source that cites it."""
    # An eq-code block: the equation's div, then the code fence, closed by the outer div.
    blocks = re.findall(r'<div class="eq-code" markdown>(.*?)```\n\n</div>', read(page), re.S)
    tagged = set()
    for block in blocks:
        labels = re.findall(r"\\tag\{([A-Z]\d+)\}", block)
        includes = INCLUDE.findall(block)
        assert labels and includes, f"{page}: an eq-code block without a label or code"
        cited = "".join(cited_text(*target.split(":")) for target in includes)
        for label in labels:
            assert re.search(rf"\b{label}\b", cited), f"{page}: code beside {label} cites it not"
        tagged |= set(labels)
    kinds = "FG" if page.endswith("fpa.md") else "I"
    expected = {label for label in spec_labels() if label[0] in kinds}
    assert expected <= tagged, f"{page}: not beside code: {sorted(expected - tagged)}"


def test_the_all_extra_installs_every_extra_a_user_can_want():
    """pip install ".[all]" (README's Install section) brings every extra but the developers'
    (test, docs, bench), hf and flax included; the README names the ones it adds."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    (everything,) = extras["all"]
    named = set(re.fullmatch(r"attnspec\[([a-z,]+)\]", everything)[1].split(","))
    assert named == set(extras) - {"all", "test", "docs", "bench"}
    install = read("README.md").split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra in ("torch", "jax", "flax", "hf", "all"):
        assert f'pip install ".[{extra}]"' in install, extra


def test_readme_example_runs():
    (block,) = python_blocks("README.md", title="")
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["o"].shape == (1, 2, 16, 8)
    assert namespace["live"].dtype == np.bool_


def test_readme_torch_example_runs():
    pytest.importorskip("torch")
    (block,) = python_blocks("README.md", title="PyTorch")
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["o"].shape == (2, 64, 4, 32)
    assert namespace["q"].grad.shape == (2, 64, 4, 32)
    assert namespace["y"].shape == (2, 64, 128)


def test_readme_jax_example_runs():
    pytest.importorskip("jax")
    (block,) = python_blocks("README.md", title="JAX")
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["o"].shape == (2, 64, 4, 32)
    assert namespace["dq"].shape == (2, 64, 4, 32)


def test_tutorial_python_runs(capsys):
    (block,) = python_blocks("docs/tutorial.md", title="Python")
    namespace = {}
    exec(compile(block, "docs/tutorial.md", "exec"), namespace)
    assert namespace["case"].op == "fpa_attention"
    assert set(namespace["expected"]) == {"o", "lse"}
    assert "largest field step" in capsys.readouterr().out


def test_tutorial_empty_backend_is_accepted_and_implements_nothing(tmp_path, capsys):
    (block,) = python_blocks("docs/tutorial.md", title="my_backend.py")
    path = tmp_path / "my_backend.py"
    path.write_text(block)
    cases = ["--cases", "fox/shapes/0", "fpa/walk/0"]
    assert main(["conformance", "--backend", f"{path}:MyBackend", *cases]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n0 passed, 0 failed, [1-9]\d* not implemented, 0 skipped", out), out


def test_citation_metadata_agree():
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with the docs extra")
    cff = yaml.safe_load(read("CITATION.cff"))
    assert cff["cff-version"] == "1.2.0"
    for key in ("message", "title", "authors", "version"):
        assert cff[key], f"CITATION.cff: {key} is empty"
    for author in cff["authors"] + [a for r in cff["references"] for a in r["authors"]]:
        assert author.get("name") or author.get("family-names"), author
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        assert cff["version"] == tomllib.load(fh)["project"]["version"]
    bibtex = read("docs/citing.md")
    assert f"title   = {{{cff['title']}}}" in bibtex
    assert f"version = {{{cff['version']}}}" in bibtex
    for reference in cff["references"]:
        assert reference["title"] in bibtex, f"citing.md lacks {reference['title']!r}"


def test_spec_copies_match_the_shared_spec():
    shared = os.path.join(os.path.dirname(ROOT), "shared", "spec")
    if not os.path.isdir(shared):
        pytest.skip("no ../shared/spec beside this checkout")
    for name in os.listdir(shared):
        with (
            open(os.path.join(shared, name)) as a,
            open(os.path.join(ROOT, "docs/spec", name)) as b,
        ):
            assert a.read() == b.read(), f"docs/spec/{name} differs from ../shared/spec/{name}"


# outputs shown in the tutorial

# A ```text block right after this comment shows (part of) the output of the command that
# precedes the comment, or of the block's own `repro:` line; tests/test_docs.py compares it with
# a fresh run, and `python tests/test_docs.py` rewrites it from one.
GENERATED = (
    "<!-- output of a run: tests/test_docs.py checks it, python tests/test_docs.py rewrites it -->"
)
GENERATED_BLOCK = re.compile(
    r"(?P<before>(?:^|\n)(?P<command>[^\n]*)\n\n" + re.escape(GENERATED) + r"\n```text\n)"
    r"(?P<body>.*?)\n```",
    re.S,
)


def _kit_output(command):
    """stdout of ``attnspec ...`` run in-process from the repository root."""
    argv = shlex.split(command)
    assert argv[0] == "attnspec", command
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            main(argv[1:])
    finally:
        os.chdir(cwd)
    return out.getvalue()


def _generated_body(command, body):
    """What the block should show: the report's table for a command line, or the failure and
    repro lines of the block's case when it shows one."""
    repro = re.search(r"^\s*repro: (.*)$", body, re.M)
    if repro:
        lines = _kit_output(repro.group(1)).splitlines()
        case = shlex.split(repro.group(1))[shlex.split(repro.group(1)).index("--cases") + 1]
        first = next(i for i, line in enumerate(lines) if line.startswith(f"  {case} ["))
        last = next(i for i in range(first, len(lines)) if lines[i].startswith("    repro: "))
        return "\n".join(line[2:] for line in lines[first : last + 1])  # failure, case, repro
    lines = _kit_output(command.strip()).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("op "))
    last = lines.index("", first)
    return "\n".join(lines[first:last])


def _tokens(text):
    return text.split()


# unit roundoff of the dtype a table row names: below 64 of these an error's digits are set by
# the order the machine's vector kernels sum in, not by the backend (float64 call_order: 1.94e-15
# on one x86 CPU, 2.12e-15 on another)
ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}


def _agree(shown, run):
    """Same text, integers equal, decimals within 5 % (another BLAS may round differently) or
    both at the roundoff level of their row's dtype."""
    a_lines, b_lines = shown.splitlines(), run.splitlines()
    if len(a_lines) != len(b_lines):
        return False
    for a_line, b_line in zip(a_lines, b_lines, strict=True):
        a, b = _tokens(a_line), _tokens(b_line)
        if len(a) != len(b):
            return False
        floor = 64 * max((ROUNDOFF[t] for t in a if t in ROUNDOFF), default=0.0)
        for x, y in zip(a, b, strict=True):
            if x == y:
                continue
            number = re.fullmatch(r"-?\d+\.\d+(e[-+]\d+)?[,;]?", x) and re.fullmatch(
                r"-?\d+\.\d+(e[-+]\d+)?[,;]?", y
            )
            if not number or x[-1] != y[-1]:
                return False
            u, v = float(x.rstrip(",;")), float(y.rstrip(",;"))
            if max(abs(u), abs(v)) <= floor:
                continue
            if abs(u - v) > 0.05 * max(abs(u), abs(v)):
                return False
    return True


def test_tutorial_outputs_come_from_a_run():
    text = read("docs/tutorial.md")
    blocks = list(GENERATED_BLOCK.finditer(text))
    assert len(blocks) == 2, "docs/tutorial.md: expected two generated output blocks"
    for block in blocks:
        run = _generated_body(block["command"], block["body"])
        assert _agree(block["body"], run), (
            f"docs/tutorial.md shows\n{block['body']}\na run gives\n{run}\n"
            "(python tests/test_docs.py rewrites the block)"
        )


def rewrite_tutorial():
    path = os.path.join(ROOT, "docs", "tutorial.md")
    text = read("docs/tutorial.md")
    text = GENERATED_BLOCK.sub(
        lambda m: m["before"] + _generated_body(m["command"], m["body"]) + "\n```", text
    )
    with open(path, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    sys.exit(rewrite_tutorial())

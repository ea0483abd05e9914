"""No two files import each other, directly or around a longer circle (docs/contributing.md, "The
layers and their direction").

tests/test_layering.py judges folders; a circle inside one folder passes it. Here every import
of every code file is an edge from file to file, a lazy import inside a function and a type-only
import under ``if TYPE_CHECKING`` included (tests/import_graph.py reads them all), and the graph
must have no strongly connected component of more than one file. Importing ``a.b.c`` runs
``a/b/__init__.py`` first, but that is Python's order of loading, not a dependency one file
chose: only the file named is an edge.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import imports, modules


def _graph(files: list[tuple[str, Path]]) -> dict[str, set[str]]:
    """module -> the project modules it imports (an imported name resolves to its module)."""
    known = dict(files)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in files:
        for _, target in imports(module, path):
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()  # "attnspec.reference.fpa.fpa_forward" -> "attnspec.reference.fpa"
            if parts and ".".join(parts) != module:
                graph[module].add(".".join(parts))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, with an
    explicit stack: the graph is deeper than a comfortable recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_circle_of_files():
    found = circles(_graph(modules()))
    assert not found, "files that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"a": "import p.b\n", "b": "def f():\n    from p import a\n"}, [["p.a", "p.b"]]),
        (
            {
                "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
                "b": "from .c import C\n",
                "c": "from p.a import A\n",
            },
            [["p.a", "p.b", "p.c"]],
        ),
        ({"a": "from p.b import f\n", "b": "from p import c\n", "c": "x = 1\n"}, []),
    ],
    ids=["lazy", "type_only_three_files", "no_circle"],
)
def test_the_checker_sees_a_planted_circle(tmp_path, files, expected):
    """The walk itself: a lazy import and a type-only import close a circle; a chain does not."""
    paths = []
    for name, source in files.items():
        (tmp_path / f"{name}.py").write_text(source)
        paths.append((f"p.{name}", tmp_path / f"{name}.py"))
    assert circles(_graph(paths)) == expected

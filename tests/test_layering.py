"""The direction of imports between the code folders (docs/contributing.md, "The layers and their
direction"): reference <- theory; reference <- conformance <- the backends' kit adapters;
experiments above all; the ``attnspec`` command (src/attnspec/cli.py) above everything.

Every ``import`` statement of every code file is read with ``ast`` (tests/import_graph.py; module
level or inside a function alike: a lazy import is still an edge), resolved to a module of the
project, and judged against the table below. Backends are loaded by the kit only by name, as strings
(``attnspec.conformance.registry``), which is how a third-party backend is loaded too.
"""

from __future__ import annotations

import sys

import pytest
from import_graph import ROOT, edges, imports, modules

# layer -> the layers it may import ("attnspec" alone is the top package's __init__: the version)
ALLOWED = {
    "attnspec": {"attnspec", "reference", "theory", "conformance"},
    "reference": {"reference"},
    "theory": {"theory", "reference"},
    "conformance": {"conformance", "reference", "attnspec"},
    "backends": {"backends", "reference", "conformance", "attnspec"},
    "models": {"models", "reference", "backends", "attnspec"},
    "experiments": {
        "experiments",
        "reference",
        "theory",
        "backends",
        "conformance",
        "models",
        "attnspec",
    },
}

# Inside backends/ only the adapters to the kit import it.
KIT_ADAPTERS = {"kit.py", "context_parallel_kit.py"}

# What `import attnspec.reference` may pull in besides the standard library.
REFERENCE_THIRD_PARTY = {"numpy", "scipy"}


def _layer(module: str) -> str | None:
    """The layer of a project module, None for a module outside the project."""
    if module == "attnspec" or module.startswith("attnspec.__"):
        return "attnspec"
    if not module.startswith("attnspec."):
        return None
    sub = module.split(".")[1]
    return sub if sub in ALLOWED else "attnspec"  # attnspec.cli: the command, the top


def test_every_code_folder_is_read():
    found = dict(modules())
    assert "attnspec.reference.fpa" in found
    assert "attnspec.conformance.registry" in found
    assert "attnspec.backends.torch.kit" in found
    assert "attnspec.cli" in found
    assert len(found) > 60


def test_imports_follow_the_direction_of_the_layers():
    wrong = []
    for module, path, line, target in edges():
        source, dest = _layer(module), _layer(target)
        if dest is None:
            continue
        if dest == "attnspec" and target.startswith("attnspec.cli") and source != "attnspec":
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports the command {target}")
        elif dest not in ALLOWED[source]:
            wrong.append(f"{path.relative_to(ROOT)}:{line} ({source}) imports {target} ({dest})")
        elif source == "backends" and dest == "conformance" and path.name not in KIT_ADAPTERS:
            wrong.append(f"{path.relative_to(ROOT)}:{line}: only the kit adapters import {target}")
        elif source == "backends" and dest == "backends":
            frameworks = {module.split(".")[2], target.split(".")[2]} & {"torch", "jax"}
            if len(frameworks) == 2:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}")
        elif source == "attnspec" and module == "attnspec" and dest != "attnspec":
            wrong.append(f"{path.relative_to(ROOT)}:{line}: import attnspec loads {target}")
    assert not wrong, "imports against the architecture:\n" + "\n".join(wrong)


def test_the_reference_needs_only_numpy_and_scipy():
    allowed = set(sys.stdlib_module_names) | REFERENCE_THIRD_PARTY | {"attnspec"}
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for module, path, line, target in edges()
        if _layer(module) == "reference" and target.split(".")[0] not in allowed
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("source", "line", "layer"),
    [
        ("from attnspec.backends.torch import ops", "attnspec.reference.fpa", "reference"),
        ("from attnspec.theory import registry", "attnspec.conformance.runner", "conformance"),
        ("from ..backends import registry", "attnspec.conformance.cli", "conformance"),
    ],
)
def test_the_checker_sees_a_wrong_edge(tmp_path, source, line, layer):
    """The walk itself: a planted wrong import (absolute or relative) resolves to a layer the
    table forbids."""
    path = tmp_path / "planted.py"
    path.write_text(source + "\n")
    (target,) = [t for _, t in imports(line, path)]
    assert _layer(target) not in ALLOWED[layer]

"""The direction of imports between the code folders (docs/contributing.md, "The layers and their
direction"): reference <- theory; reference <- conformance <- the backends' kit adapters;
experiments above all; the ``attnspec`` command (src/attnspec/cli.py) above everything.

Every ``import`` statement of every code file is read with ``ast`` (module level or inside a
function alike: a lazy import is still an edge), resolved to a module of the project, and judged
against the table below. Backends are loaded by the kit only by name, as strings
(``attnspec.conformance.registry``), which is how a third-party backend is loaded too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# import name of each code folder (pyproject.toml's package-dir)
FOLDERS = {
    "attnspec": ROOT / "src" / "attnspec",
    "attnspec.reference": ROOT / "reference",
    "attnspec.theory": ROOT / "theory",
    "attnspec.conformance": ROOT / "conformance",
    "attnspec.backends": ROOT / "backends",
    "attnspec.experiments": ROOT / "experiments",
    "attnspec.models": ROOT / "models",
}

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


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join([package, *parts]), path))
    return out


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # "from attnspec.reference import fpa" names the module attnspec.reference.fpa
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _layer(module: str) -> str | None:
    """The layer of a project module, None for a module outside the project."""
    if module == "attnspec" or module.startswith("attnspec.__"):
        return "attnspec"
    if not module.startswith("attnspec."):
        return None
    sub = module.split(".")[1]
    return sub if sub in ALLOWED else "attnspec"  # attnspec.cli: the command, the top


def _edges() -> list[tuple[str, Path, int, str]]:
    return [(m, p, line, t) for m, p in _modules() for line, t in _imports(m, p)]


def test_every_code_folder_is_read():
    modules = dict(_modules())
    assert "attnspec.reference.fpa" in modules
    assert "attnspec.conformance.registry" in modules
    assert "attnspec.backends.torch.kit" in modules
    assert "attnspec.cli" in modules
    assert len(modules) > 60


def test_imports_follow_the_direction_of_the_layers():
    wrong = []
    for module, path, line, target in _edges():
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
        for module, path, line, target in _edges()
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
    (target,) = [t for _, t in _imports(line, path)]
    assert _layer(target) not in ALLOWED[layer]

"""The import graph of the code folders, read with ``ast``: every ``import`` statement of every
code file, at module level, inside a function (a lazy import) or under ``if TYPE_CHECKING`` (a
type-only import) alike, resolved to an absolute module name. tests/test_layering.py judges the
edges between folders against the layers' table; tests/test_import_circles.py looks for circles
of files.
"""

from __future__ import annotations

import ast
from pathlib import Path

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


def modules() -> list[tuple[str, Path]]:
    """(module name, path) of every code file."""
    out = []
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join([package, *parts]), path))
    return out


def imports(module: str, path: Path) -> list[tuple[int, str]]:
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


def edges() -> list[tuple[str, Path, int, str]]:
    """(module, path, line, imported name) of every import of every code file."""
    return [(m, p, line, t) for m, p in modules() for line, t in imports(m, p)]

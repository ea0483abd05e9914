"""Let mkdocstrings find the ``attnspec`` packages by static analysis, and show them as they are.

``attnspec`` is a namespace package whose subpackages live in folders at the repository root
(``reference/`` installs as ``attnspec.reference``, see ``[tool.setuptools.package-dir]``), a
layout that griffe cannot map from the editable install. This hook lays out ``build/api/attnspec/``
with one symbolic link per subpackage, and ``mkdocs.yml`` gives ``build/api`` to the Python
handler as its search path, so the API pages are read from the source without importing it.
The griffe extension :class:`SourcePaths` then names each file by its real path
(``reference/fpa.py``) and shows the docstrings' Sphinx roles (``:func:`x```) as code.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import griffe

SPHINX_ROLE = re.compile(r":(?:func|meth|class|data|attr|mod):`~?([^`]+)`")


def package_dirs(root: str) -> dict[str, str]:
    """``{"reference": "reference", ...}``: attnspec's subpackages and their folders."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        mapping = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix("attnspec."): folder for name, folder in mapping.items()}


def link_packages(root: str) -> str:
    """Create ``build/api/attnspec/<name>`` -> ``<folder>`` links; return ``build/api``."""
    namespace = os.path.join(root, "build", "api", "attnspec")
    os.makedirs(namespace, exist_ok=True)
    for name, folder in package_dirs(root).items():
        link = os.path.join(namespace, name)
        target = os.path.relpath(os.path.join(root, folder), namespace)
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)
    return os.path.dirname(namespace)


# At import, while MkDocs loads its hooks: before the handler's search paths are checked.
link_packages(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class SourcePaths(griffe.Extension):
    """Real file paths for the "Source code in" labels; Sphinx roles rendered as code."""

    def on_module_instance(self, *, mod: griffe.Module, **kwargs) -> None:
        if isinstance(mod.filepath, Path):
            real = mod.filepath.resolve()
            if real != mod.filepath:
                mod.lines_collection[real] = mod.lines_collection[mod.filepath]
                mod._filepath = real  # no public setter

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = SPHINX_ROLE.sub(r"`\1`", obj.docstring.value)

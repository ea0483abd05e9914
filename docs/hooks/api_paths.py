"""Let mkdocstrings find the ``attnspec`` packages by static analysis, and show them as they are.

``attnspec``'s own files live in ``src/attnspec/`` and its subpackages in folders at the
repository root (``reference/`` installs as ``attnspec.reference``, see
``[tool.setuptools.package-dir]``), a layout that griffe cannot map from the editable install.
This hook lays out ``build/api/attnspec/`` with one symbolic link per file of the top package and
one per subpackage, and ``mkdocs.yml`` gives ``build/api`` to the Python
handler as its search path, so the API pages are read from the source without importing it.
The griffe extension :class:`SourcePaths` then names each file by its real path
(``reference/fpa.py``) and shows the docstrings' Sphinx roles (``:func:`x```) as code.
"""

from __future__ import annotations

import fcntl
import os
import re
import tomllib
from pathlib import Path

import griffe

SPHINX_ROLE = re.compile(r":(?:func|meth|class|data|attr|mod):`~?([^`]+)`")


def package_dirs(root: str) -> dict[str, str]:
    """``{"reference": "reference", ...}``: attnspec's subpackages and their folders; the top
    package's own folder under the key ``""``."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        mapping = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix("attnspec").lstrip("."): folder for name, folder in mapping.items()}


def link_packages(root: str) -> str:
    """Lay out ``build/api/attnspec/`` as the installed package: real folders, one symbolic link
    per source file (griffe does not walk into linked folders); return ``build/api``."""
    namespace = os.path.join(root, "build", "api", "attnspec")
    os.makedirs(os.path.dirname(namespace), exist_ok=True)
    # one build at a time: the test suite's workers may build the site at once
    with open(os.path.join(os.path.dirname(namespace), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _link_files(root, namespace)
    return os.path.dirname(namespace)


def _link_files(root: str, namespace: str) -> None:
    links = {}
    for name, folder in package_dirs(root).items():
        top = os.path.join(root, folder)
        for here, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(here, top)
            for file in files:
                if file.endswith((".py", ".pyi")):
                    links[os.path.normpath(os.path.join(name, rel, file))] = os.path.join(
                        here, file
                    )
    for here, _, files in os.walk(namespace):  # files gone from the source, old folder links
        for file in files:
            path = os.path.join(here, file)
            if os.path.relpath(path, namespace) not in links:
                os.remove(path)
    for name in os.listdir(namespace) if os.path.isdir(namespace) else []:
        if os.path.islink(os.path.join(namespace, name)):
            os.remove(os.path.join(namespace, name))
    for name, path in links.items():
        link = os.path.join(namespace, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        target = os.path.relpath(path, os.path.dirname(link))
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)


# At import, while MkDocs loads its hooks: before the handler's search paths are checked.
link_packages(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class SourcePaths(griffe.Extension):
    """Real file paths for the "Source code in" labels; Sphinx roles rendered as code."""

    def on_module_instance(self, *, mod: griffe.Module, **kwargs) -> None:
        # not the top package: griffe finds its subpackages beside its __init__.py, and only
        # build/api/attnspec/ holds them all (its real folder, src/attnspec/, holds none)
        if isinstance(mod.filepath, Path) and mod.path != "attnspec":
            real = mod.filepath.resolve()
            if real != mod.filepath:
                mod.lines_collection[real] = mod.lines_collection[mod.filepath]
                mod._filepath = real  # no public setter

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = SPHINX_ROLE.sub(r"`\1`", obj.docstring.value)

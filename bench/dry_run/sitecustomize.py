"""Loaded by ``bench/gpu_check.sh --dry-run`` only (this folder on PYTHONPATH): a fix of Triton
3.6's interpreter for numpy >= 2.4, so that the dry run runs the GPU machine's stack as it is.

Triton 3.6's interpreter turns a scalar into an index by ``int()`` of a one-element array, which
numpy 2.4 and later refuse ("only 0-dimensional arrays can be converted to Python scalars");
Triton 3.7 squeezes the array first. The GPU run compiles its kernels and never interprets them,
so only the dry run needs this. Applied when ``triton.runtime.interpreter`` is first imported,
and only on a Triton whose interpreter still has the old conversion.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

TARGET = "triton.runtime.interpreter"


def _fix(module: Any) -> None:
    patch = module._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    module._patch_lang_tensor = patched


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or spec.origin is None:
            return spec
        with open(spec.origin) as fh:
            if "int(self.handle.data))" not in fh.read():  # a Triton that squeezes
                return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _fix(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Finder())

"""Backend names and how to load them.

A backend is selected by a registered name or by ``module:attribute`` for third-party code.
Frameworks are imported only when their backend is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

BUILTIN = {
    "numpy": "attnspec.conformance.numpy_backend:NumpyBackend",
    "torch": "attnspec.backends.torch.kit:TorchBackend",
    "triton": "attnspec.backends.torch.kit:TritonBackend",
    "jax": "attnspec.backends.jax.kit:JaxBackend",
    "pallas": "attnspec.backends.jax.kit:PallasBackend",
    "mosaic": "attnspec.backends.jax.kit:MosaicBackend",
}

# The context-parallel adapters (conformance/context_parallel.py): sharded runs of a framework.
CONTEXT_PARALLEL = {
    "torch": "attnspec.backends.torch.context_parallel_kit:KitBackend",
    "jax": "attnspec.backends.jax.context_parallel_kit:KitBackend",
}

# The extra that provides each framework backend, for the message when it is missing.
EXTRAS = {"torch": "torch", "triton": "torch", "jax": "jax", "pallas": "jax", "mosaic": "jax"}


def _import_file(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise ValueError(f"backend: no such file {path!r}")
    name = "attnspec_user_backend_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"backend: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:  # its sibling modules import, as under ``python file.py``
        sys.path.insert(0, folder)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_object(spec: str) -> Any:
    """Import ``module:attribute`` (or ``path/to/file.py:attribute``) and return the attribute.

    The attribute is whatever the module holds (a class, a factory, a backend object): ``Any``.
    """
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ValueError(f"backend: expected 'module:attribute', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            module = _import_file(module_name)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"backend: cannot import module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ValueError(
            f"backend: module {module_name!r} has no attribute {attribute!r}"
        ) from None


def _require_extra(name: str) -> None:
    framework = {"torch": "torch", "jax": "jax"}[EXTRAS[name]]
    if importlib.util.find_spec(framework) is None:
        raise ImportError(
            f"backend: {name!r} needs {framework}; install the {EXTRAS[name]!r} extra from the "
            f"attnspec checkout: pip install '.[{EXTRAS[name]}]' (attnspec is not on a package "
            f"index; pip install {framework} also works)"
        )


def get_backend(name: str, device: str = "cpu") -> Any:
    """Instantiate a backend by registered name or ``module:attribute``.

    ``module:attribute`` may name a class or factory (called with ``device=``) or a ready object.
    Returns the backend object (the protocol of :mod:`attnspec.conformance.protocol`, whose ops
    are looked up by name, so ``Any``).
    """
    if name in BUILTIN:
        if name in EXTRAS:
            _require_extra(name)
        return load_object(BUILTIN[name])(device=device)
    if ":" in name:
        obj = load_object(name)
        return obj(device=device) if callable(obj) else obj
    raise ValueError(
        f"backend: unknown name {name!r}; registered: {sorted(BUILTIN)}, or give 'module:attribute'"
    )


def available_backends() -> list[str]:
    """Registered backends whose dependencies import on this machine."""
    names = []
    for name in BUILTIN:
        try:
            get_backend(name)
        except (ImportError, ValueError):
            continue
        names.append(name)
    return names


def get_context_parallel_backend(name: str) -> Any:
    """The context-parallel adapter ``"torch"`` (gloo processes), ``"jax"`` (forced host
    devices), or ``module:attribute`` (a class or factory, called with no argument, or an
    object)."""
    if name in CONTEXT_PARALLEL:
        _require_extra(name)
        return load_object(CONTEXT_PARALLEL[name])()
    if ":" in name:
        obj = load_object(name)
        return obj() if isinstance(obj, type) else obj
    raise ValueError(
        f"backend: unknown context-parallel backend {name!r}; registered: "
        f"{sorted(CONTEXT_PARALLEL)}, or give 'module:attribute'"
    )

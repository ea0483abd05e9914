"""Which implementation computes each kernel: the eager torch twin or a Triton kernel.

Every kernel has an eager twin (the CPU path and the fallback) and may have a Triton kernel
beside it. Both register here under the same kernel name with the same signature; the public ops
look them up by ``impl``. Layout: the torch layout ``[B, T, H, D]``; per-token scalars
``[B, T, H]``; everything contiguous.

A kernel's signature is its eager twin's (the functions registered as "eager" in
``eager_fpa.py`` and ``eager_interdomain.py``, whose docstrings give shapes and dtypes); every
implementation takes it. GQA: q has HQ heads, k and v have H heads, HQ a multiple of H;
per-token scalars have HQ heads. Varlen: B = 1 and ``packing`` the
:class:`~attnspec.reference.packing.Packing` the op checked, without zero-length sequences, or
None: the kernels read no offsets back from the device.

A Triton implementation is stored wrapped in the device guard (:func:`.devices.guard`) of its
first tensor argument: the custom ops launch it on the device of their tensors whatever device
is current.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from attnspec.reference.ops import OPS

from . import devices

# The torch.library tags of every custom op of the backend (ops.py, paged.py): opcheck passes
# for each (tests/test_torch_library.py), and the kernels take contiguous tensors only, so a
# compiled graph must hand them contiguous ones. Not cudagraph_unsafe: without cu_seqlens a
# custom op reads nothing back while a CUDA graph captures it (docs/decisions.md).
OP_TAGS = (torch.Tag.pt2_compliant_tag, torch.Tag.needs_contiguous_strides)

# Kernels differ in their signatures (their eager twins'); the registry holds them by name,
# and ``register`` hands each function back with its own signature.
Kernel = Callable[..., Any]
KernelT = TypeVar("KernelT", bound=Kernel)

# the kernel names, from the op table (each op's forward and backward)
KERNELS = tuple(name for spec in OPS.values() for name in spec.torch_kernels)

_REGISTRY: dict[str, dict[str, Kernel]] = {name: {} for name in KERNELS}


def register(kernel: str, impl: str) -> Callable[[KernelT], KernelT]:
    """Decorator: register ``fn`` as implementation ``impl`` ("eager", "triton") of ``kernel``."""
    if kernel not in _REGISTRY:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")

    def decorate(fn: KernelT) -> KernelT:
        _REGISTRY[kernel][impl] = _guarded(fn) if impl == "triton" else fn
        return fn

    return decorate


def _guarded(fn: Kernel) -> Kernel:
    """``fn`` run with the device of its first tensor argument current (a Triton launch goes to
    the current device, not to its tensors')."""

    @functools.wraps(fn)
    def launch(*args: Any, **kwargs: Any) -> Any:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with devices.guard(device):
            return fn(*args, **kwargs)

    return launch


def lookup(kernel: str, impl: str) -> Kernel:
    """The implementation ``impl`` of ``kernel``; ValueError naming what is available."""
    try:
        return _REGISTRY[kernel][impl]
    except KeyError:
        available = sorted(_REGISTRY.get(kernel, {}))
        raise ValueError(
            f"impl: no {impl!r} implementation of {kernel!r}; available: {available}"
        ) from None


def implementations(kernel: str) -> list[str]:
    """Names of the registered implementations of ``kernel``."""
    return sorted(_REGISTRY[kernel])

"""Which implementation computes each kernel: the eager torch twin or a Triton kernel.

Every kernel has an eager twin (the CPU path and the fallback) and may have a Triton kernel
beside it. Both register here under the same kernel name with the same signature; the public ops
look them up by ``impl``. Layout: the torch layout ``[B, T, H, D]``; per-token scalars
``[B, T, H]``; everything contiguous.

Kernel signatures (GQA: q has HQ heads, k and v have H heads, HQ a multiple of H; per-token
scalars have HQ heads; varlen: B = 1 and ``packing`` the
:class:`~attnspec.reference.packing.Packing` the op checked, without zero-length sequences, or
None: the kernels read no offsets back from the device):

- ``fpa_fwd(q, k, v, field, level, scale, packing) -> (o, lse)``: o ``[B, T, HQ, V]`` in
  q's dtype; lse ``[B, T, HQ]`` in the dtype of field (float32, float64 for float64 inputs),
  natural-log units. field and level are float32 or wider.
- ``fpa_bwd(q, k, v, field, level, o, lse, do, dlse, scale, packing)
  -> (dq, dk, dv, dfield, dlevel)``: shaped and typed like their inputs (dk, dv reduced over the
  query heads of each group); ``dlse`` may be None. Conventions of spec/fpa.md section 6.
- ``fox_fwd(q, k, v, log_f, scale, packing) -> (o, lse)`` and
  ``fox_bwd(q, k, v, log_f, o, lse, do, dlse, scale, packing) -> (dq, dk, dv, dlog_f)``.
- ``s4d_fwd(fq, kt, vt, lam, b, c, readout, packing, initial_state, return_saved=False)
  -> (o, final_state)``, with return_saved ``(o, final_state, saved)``:
  fq, kt ``[B, T, H, R]``, vt ``[B, T, H, V]``; lam, b ``[H, M, 2]`` and c ``[H, M, M, 2]``
  real (re, im in the last axis) in float32 or wider; readout "linear" or "ratio"; states
  ``[N, H, M, C, 2]`` in float32 or wider (N sequences, C = R + V, + 1 for "ratio"),
  initial_state may be None; saved: a list of tensors the implementation keeps from its forward
  for its backward (empty for one that recomputes everything).
- ``s4d_bwd(fq, kt, vt, lam, b, c, readout, packing, initial_state, do, dfinal_state,
  saved=None) -> (dfq, dkt, dvt, dlam, db, dc, dinitial_state)``: saved from the forward of the
  same implementation on the same inputs, or None / [] (recompute); an implementation ignores
  what it does not use.
- ``legs_fwd(fq, fk, v, M, packing) -> o`` and
  ``legs_bwd(fq, fk, v, M, packing, do) -> (dfq, dfk, dv)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from attnspec.reference.ops import OPS

# Kernels differ in their signatures (listed above); the registry holds them by name, and
# ``register`` hands each function back with its own signature.
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
        _REGISTRY[kernel][impl] = fn
        return fn

    return decorate


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

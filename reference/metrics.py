"""The normwise relative error of the conformance criterion (spec/conformance.md): one definition
for the kit's comparisons (:mod:`attnspec.conformance.metrics`), the theory checks, the tests and
the benchmarks. NumPy only, so every layer of the project can use it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = ["difference", "normwise", "relative_error"]


def relative_error(x: ArrayLike, ref: ArrayLike, *, floor: float = 0.0) -> float:
    """The normwise relative error ||x - ref|| / max(||ref||, floor) of ``x`` against ``ref``.

    The one definition for the kit and for every test and benchmark that compares with a
    reference. Both sides are taken as float64 arrays (complex128 when either is complex; a torch
    tensor converts first: ``t.detach().double().cpu().numpy()``); an infinite entry of ``ref``
    that ``x`` matches counts as equal, and the norm of ``ref`` is over its finite entries. With
    a zero denominator the error is 0 if ``x`` equals ``ref`` and inf otherwise; NaN in ``x``
    gives NaN, which fails every ``<=``. Shapes must match: nothing is broadcast.

    Args:
        floor: lower bound of the denominator, for a reference that is essentially zero
            (a gradient that vanishes): the error is then absolute on that scale.
    """
    x, ref = np.asarray(x), np.asarray(ref)
    kind = np.complex128 if np.iscomplexobj(x) or np.iscomplexobj(ref) else np.float64
    x, ref = x.astype(kind), ref.astype(kind)
    if x.shape != ref.shape:
        raise ValueError(f"x: expected the shape of ref {ref.shape}, got {x.shape}")
    return normwise(*difference(x, ref), floor)


def difference(x: NDArray[Any], ref: NDArray[Any]) -> tuple[NDArray[np.float64], NDArray[Any]]:
    """|x - ref| with matching infinities 0, and ref with its non-finite entries 0."""
    with np.errstate(invalid="ignore"):  # inf - inf where the infinities match
        diff = np.asarray(np.abs(x - ref))  # an array also for 0-d inputs
    finite = np.isfinite(ref)
    diff[~finite & (x == ref)] = 0.0  # matching infinities
    return diff, np.where(finite, ref, 0.0)


def normwise(diff: NDArray[np.float64], ref: NDArray[Any], floor: float) -> float:
    """||diff|| / max(||ref||, floor); with a zero denominator 0 if diff is 0, else inf."""
    error = float(np.linalg.norm(diff))
    denominator = max(float(np.linalg.norm(ref)), floor)
    if denominator > 0:
        return error / denominator
    return 0.0 if error == 0 else error * math.inf  # NaN stays NaN

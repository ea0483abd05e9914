"""Comparison of a backend's array with the reference: normwise relative error and worst entry."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TINY = 1e-30


@dataclass(frozen=True)
class Comparison:
    """rel: ||x - ref|| / max(||ref||, tiny); worst_abs and worst_index: the largest |x - ref|."""

    rel: float
    tolerance: float
    worst_abs: float
    worst_index: tuple[int, ...]
    problem: str = ""  # shape, dtype or non-finite trouble; never passes

    @property
    def ratio(self) -> float:
        """rel / tolerance; with a zero tolerance (exact quantities) 0 if equal, else inf."""
        if self.tolerance:
            return self.rel / self.tolerance
        return 0.0 if self.rel == 0 else float("inf")

    @property
    def passed(self) -> bool:
        return not self.problem and self.rel <= self.tolerance  # NaN fails this comparison

    def describe(self) -> str:
        if self.problem:
            return self.problem
        return (
            f"rel {self.rel:.2e} vs tol {self.tolerance:.0e}; worst |diff| {self.worst_abs:.2e} "
            f"at {self.worst_index}"
        )


def compare(x, ref: np.ndarray, tolerance: float) -> Comparison:
    """Compare a backend result with the float64 reference."""
    ref = np.asarray(ref, dtype=np.float64)
    x = np.asarray(x)
    if x.shape != ref.shape:
        return Comparison(
            np.inf, tolerance, np.inf, (), f"wrong shape {x.shape}, expected {ref.shape}"
        )
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        return Comparison(np.inf, tolerance, np.inf, (), f"wrong dtype {x.dtype}, expected real")
    x = x.astype(np.float64)
    bad = ~np.isfinite(x) & np.isfinite(ref)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        return Comparison(
            np.inf,
            tolerance,
            np.inf,
            index,
            f"non-finite value {x[index]} at {index} where the reference is {ref[index]:.3g}",
        )
    diff = np.asarray(np.abs(x - ref))  # an array also for 0-d inputs
    diff[~np.isfinite(ref) & (x == ref)] = 0.0  # matching infinities
    rel = float(np.linalg.norm(diff) / max(float(np.linalg.norm(ref[np.isfinite(ref)])), TINY))
    if diff.size == 0:
        return Comparison(rel, tolerance, 0.0, ())
    index = tuple(int(i) for i in np.unravel_index(np.nanargmax(diff), diff.shape))
    return Comparison(rel, tolerance, float(diff[index]), index)

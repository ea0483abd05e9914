"""Comparison of a backend's array with the reference.

Three numbers per array: the normwise relative error ||x - ref|| / max(||ref||, floor)
(:func:`relative_error`, defined in :mod:`attnspec.reference.metrics` for every layer), the worst
row's relative error (a row is one token's vector, or one scalar for per-token quantities), and
the largest elementwise error with its index. The row error keeps a bug confined to one tile from
being averaged away; the floor keeps a gradient that is essentially zero in the reference from
failing a correct backend with relative error 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from attnspec.reference.metrics import difference, normwise
from attnspec.reference.metrics import relative_error as relative_error  # re-exported

TINY = 1e-30

# The worst row may exceed the normwise tolerance by this factor. Rounding errors of a correct
# backend concentrate in a few rows (a FlashAttention-style rounding emulation, on every FPA and
# FoX case: worst row up to 20x its normwise error, and up to 2.2x the tolerance in float32,
# 1.1x in bfloat16), while a wrong row is off by far more (a dropped diagonal key: 10x-20x).
ROW_FACTOR = 8.0

# Per-token quantities: each element is a row of its own.
PER_TOKEN = frozenset({"lse", "field", "level", "log_f"})


@dataclass(frozen=True)
class Comparison:
    """rel: ||x - ref|| / max(||ref||, floor); row_rel: the worst row's relative error, over
    max(||ref_row||, RMS row norm); worst_abs and worst_index: the largest |x - ref|."""

    rel: float
    tolerance: float
    worst_abs: float
    worst_index: tuple[int, ...]
    problem: str = ""  # shape, dtype, mutation or non-finite trouble; never passes
    row_rel: float = 0.0
    row_index: tuple[int, ...] = ()

    @property
    def ratio(self) -> float:
        """max(rel, row_rel / ROW_FACTOR) / tolerance; with a zero tolerance (exact quantities)
        0 if equal, else inf."""
        if self.problem:
            return math.inf
        error = max(self.rel, self.row_rel / ROW_FACTOR)
        if self.tolerance:
            return error / self.tolerance
        return 0.0 if error == 0 else math.inf

    @property
    def passed(self) -> bool:
        # NaN fails both comparisons.
        return (
            not self.problem
            and self.rel <= self.tolerance
            and self.row_rel <= ROW_FACTOR * self.tolerance
        )

    def describe(self) -> str:
        if self.problem and math.isfinite(self.rel):  # right values, another fault (dtype)
            return (
                f"{self.problem} (the values pass: rel {self.rel:.2e} vs tol {self.tolerance:.0e})"
            )
        if self.problem:
            return self.problem
        text = (
            f"rel {self.rel:.2e} vs tol {self.tolerance:.0e}; worst |diff| {self.worst_abs:.2e} "
            f"at {self.worst_index}"
        )
        if self.row_rel > ROW_FACTOR * self.tolerance:
            text += f"; worst row {self.row_index} rel {self.row_rel:.2e} vs {ROW_FACTOR:g} x tol"
        return text

    def failed_with(self, problem: str) -> Comparison:
        """This comparison failed for ``problem`` (a dtype fault), its measured errors kept."""
        return Comparison(
            self.rel,
            self.tolerance,
            self.worst_abs,
            self.worst_index,
            problem,
            self.row_rel,
            self.row_index,
        )


def _problem(problem: str, tolerance: float, index: tuple[int, ...] = ()) -> Comparison:
    return Comparison(math.inf, tolerance, math.inf, index, problem, math.inf, ())


def compare(
    x: ArrayLike, ref: ArrayLike, tolerance: float, *, row_ndim: int = 1, floor: float = 0.0
) -> Comparison:
    """Compare a backend result with the float64 reference.

    Args:
        x: the backend's array (NumPy); ref: the reference.
        tolerance: for the normwise error; the worst row may reach ``ROW_FACTOR`` times it.
        row_ndim: trailing axes that form one row (1: a token's vector; 0: each element).
        floor: lower bound of the normwise denominator (see :func:`gradient_floors`).
    """
    ref = np.asarray(ref, dtype=np.float64)
    x = np.asarray(x)
    if x.shape != ref.shape:
        return _problem(f"wrong shape {x.shape}, expected {ref.shape}", tolerance)
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        return _problem(f"wrong dtype {x.dtype}, expected real", tolerance)
    x = x.astype(np.float64)
    bad = ~np.isfinite(x) & np.isfinite(ref)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        return _problem(
            f"non-finite value {x[index]} at {index} where the reference is {ref[index]:.3g}",
            tolerance,
            index,
        )
    diff, ref0 = difference(x, ref)
    rel = normwise(diff, ref0, max(floor, TINY))
    if diff.size == 0:
        return Comparison(rel, tolerance, 0.0, ())
    index = tuple(int(i) for i in np.unravel_index(np.nanargmax(diff), diff.shape))
    row_rel, row_index = _worst_row(diff, ref0, min(row_ndim, ref.ndim), floor)
    return Comparison(rel, tolerance, float(diff[index]), index, "", row_rel, row_index)


def _worst_row(
    diff: NDArray[np.float64], ref: NDArray[np.float64], row_ndim: int, floor: float
) -> tuple[float, tuple[int, ...]]:
    lead = diff.shape[: diff.ndim - row_ndim]
    rows_diff = np.linalg.norm(diff.reshape(*lead, -1), axis=-1)
    rows_ref = np.linalg.norm(ref.reshape(*lead, -1), axis=-1)
    n_rows = max(rows_ref.size, 1)
    typical = float(np.linalg.norm(rows_ref)) / math.sqrt(n_rows)
    denominator = np.maximum(rows_ref, max(typical, floor / math.sqrt(n_rows), TINY))
    rows_rel = np.asarray(rows_diff / denominator)
    worst = np.unravel_index(int(np.nanargmax(rows_rel)), rows_rel.shape) if rows_rel.size else ()
    value = float(rows_rel[worst]) if rows_rel.size else 0.0
    return value, tuple(int(i) for i in worst)


def gradient_floors(ref: Mapping[str, ArrayLike]) -> dict[str, float]:
    """The denominator floor of each reference gradient: the op's gradient scale.

    The size the gradient would have if its entries were as large as the op's typical gradient
    entry (the median RMS over the differentiable inputs), i.e. the median RMS times the square
    root of the array's size. A gradient far below the others (1e-22 of them in ``fpa/huge/1``)
    is then held to an absolute error of the tolerance times that scale: what rounding at the
    tested precision of an op of that scale allows, so a correct half-precision kernel that
    flushes it to zero passes, and so does a correct float64 kernel that skips keys of weight
    below e^-40 (the tile skipping the spec allows), while a gradient that matters, left wrong,
    still fails. (The floor was once the tolerance times this scale, which allowed only
    tolerance^2 times the op's scale: far below float64 rounding of the op.)
    """
    rms = [
        float(np.linalg.norm(g)) / math.sqrt(g.size)
        for g in (np.asarray(v, np.float64) for v in ref.values())
        if g.size
    ]
    scale = float(np.median(rms)) if rms else 0.0
    return {name: scale * math.sqrt(np.size(g)) for name, g in ref.items()}


def row_ndim(name: str) -> int:
    """Trailing axes of one row of the named quantity (0 for per-token scalars)."""
    return 0 if name in PER_TOKEN else 1


def compare_count(got: ArrayLike, ref: float, total: int, tolerance: float) -> Comparison:
    """A fraction of ``total`` items (the kept fraction of decoding) compared as a count."""
    got = np.asarray(got, dtype=np.float64)
    if got.size != 1:
        return _problem(f"expected a scalar, got shape {got.shape}", tolerance)
    if not np.isfinite(got).all():
        return _problem(f"non-finite value {got.item()}", tolerance)
    got_count = float(np.rint(got.item() * total))
    ref_count = float(np.rint(ref * total))
    error = abs(got_count - ref_count) / max(ref_count, 1.0)
    comparison = Comparison(error, tolerance, abs(got_count - ref_count), ())
    if error > tolerance:
        return comparison.failed_with(
            f"{got_count:.0f} kept keys (fraction {got.item():.6g}), expected {ref_count:.0f} "
            f"(fraction {ref:.6g}) out of {total}"
        )
    return comparison

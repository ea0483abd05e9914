"""Input validation at the public boundary of the reference.

Every public function of the reference converts its inputs with :func:`real_array` and checks
their agreement with :func:`check_shape`. Errors are ``ValueError`` naming the argument, what was
expected and what arrived; nothing is broadcast silently and NaN/Inf never enters a computation.
"""

from __future__ import annotations

import numpy as np


def real_array(name: str, x, *, min_ndim: int = 0, allow_inf: bool = False) -> np.ndarray:
    """Return ``x`` as a float64 array after checking dtype, rank and finiteness.

    Accepted dtypes are real floating types (float16/32/64); integers, booleans and complex
    numbers are rejected because they usually mean a wrong argument was passed.
    """
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name}: expected a real floating-point array, got dtype {arr.dtype}")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {arr.shape}")
    arr = arr.astype(np.float64)
    bad = np.isnan(arr) if allow_inf else ~np.isfinite(arr)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        what = "NaN" if allow_inf else "NaN or Inf"
        raise ValueError(f"{name}: contains {what} (first at index {index})")
    return arr


def complex_array(name: str, x, *, min_ndim: int = 0) -> np.ndarray:
    """Return ``x`` as a complex128 array; real floating input is accepted and promoted."""
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.complexfloating)):
        raise ValueError(f"{name}: expected a floating or complex array, got dtype {arr.dtype}")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {arr.shape}")
    arr = arr.astype(np.complex128)
    if not np.isfinite(arr).all():
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"{name}: contains NaN or Inf (first at index {index})")
    return arr


def check_shape(name: str, arr: np.ndarray, expected: tuple[int, ...], meaning: str) -> None:
    """Require ``arr.shape == expected``; ``meaning`` spells the expected layout for the message."""
    if arr.shape != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({meaning}), got {arr.shape}")


def check_length(name: str, T: int) -> None:
    """Require a non-empty sequence axis."""
    if T < 1:
        raise ValueError(f"{name}: expected a sequence of length T >= 1, got T = {T}")


def scalar(name: str, x, *, positive: bool = False, allow_inf: bool = False) -> float:
    """Return ``x`` as a Python float, rejecting NaN, Inf (unless allowed) and non-numbers."""
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a real number, got {x!r}") from None
    if np.isnan(value) or (np.isinf(value) and not allow_inf):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name}: expected a positive number, got {value}")
    return value


def positive_int(name: str, x) -> int:
    """Return ``x`` as an int >= 1."""
    if isinstance(x, bool) or not isinstance(x, int | np.integer) or int(x) < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {x!r}")
    return int(x)

"""Input validation at the public boundary of the reference.

Every public function of the reference converts its inputs with :func:`real_array` and checks
their agreement with :func:`check_shape`. Errors are ``ValueError`` naming the argument, what was
expected and what arrived; nothing is broadcast silently, no axis is empty, and NaN/Inf never
enters a computation. Overflow inside a computation is caught by :func:`finite_result` and
reported against the arguments that caused it, so NaN never leaves one either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

ScalarT = TypeVar("ScalarT", bound=np.generic)


def _check_rank_and_size(name: str, arr: NDArray[Any], min_ndim: int) -> None:
    if arr.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got shape {arr.shape}")
    if arr.size == 0:
        # An empty axis (T = 0, dk = 0, M = 0, ...) has no meaning in the spec; 1/sqrt(dk) and
        # empty softmax rows would turn it into NaN.
        raise ValueError(f"{name}: expected every axis to have length >= 1, got shape {arr.shape}")


def real_array(
    name: str, x: ArrayLike, *, min_ndim: int = 0, allow_inf: bool = False
) -> NDArray[np.float64]:
    """Return ``x`` as a float64 array after checking dtype, rank, size and finiteness.

    Accepted dtypes are real floating types (float16/32/64); integers, booleans and complex
    numbers are rejected because they usually mean a wrong argument was passed. Arrays with an
    axis of length 0 are rejected.
    """
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{name}: expected a real floating-point array, got dtype {arr.dtype}")
    _check_rank_and_size(name, arr, min_ndim)
    arr = arr.astype(np.float64)
    bad = np.isnan(arr) if allow_inf else ~np.isfinite(arr)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        what = "NaN" if allow_inf else "NaN or Inf"
        raise ValueError(f"{name}: contains {what} (first at index {index})")
    return arr


def complex_array(name: str, x: ArrayLike, *, min_ndim: int = 0) -> NDArray[np.complex128]:
    """Return ``x`` as a complex128 array; real floating input is accepted and promoted."""
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.complexfloating)):
        raise ValueError(f"{name}: expected a floating or complex array, got dtype {arr.dtype}")
    _check_rank_and_size(name, arr, min_ndim)
    arr = arr.astype(np.complex128)
    if not np.isfinite(arr).all():
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"{name}: contains NaN or Inf (first at index {index})")
    return arr


def check_shape(name: str, arr: NDArray[Any], expected: tuple[int, ...], meaning: str) -> None:
    """Require ``arr.shape == expected``; ``meaning`` spells the expected layout for the message."""
    if arr.shape != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({meaning}), got {arr.shape}")


def scalar(name: str, x: object, *, positive: bool = False, allow_inf: bool = False) -> float:
    """Return ``x`` as a Python float, rejecting NaN, Inf (unless allowed) and non-numbers.

    Strings, booleans and arrays of any rank but 0 are rejected although ``float`` would take
    them: ``scale="0.5"`` or ``scale=np.array([0.5])`` is a wrong argument, not a number.
    """
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iuf":
        x = x.item()
    if isinstance(x, bool | np.bool_) or not isinstance(x, int | float | np.integer | np.floating):
        raise ValueError(f"{name}: expected a real number, got {x!r}")
    value = float(x)
    if np.isnan(value) or (np.isinf(value) and not allow_inf):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name}: expected a positive number, got {value}")
    return value


def threshold(name: str, x: object) -> float:
    """Return the eviction threshold ``theta`` of (F7) as a float: a real number > 0, ``inf``
    allowed (no key is evicted)."""
    return scalar(name, x, positive=True, allow_inf=True)


def positive_int(name: str, x: object) -> int:
    """Return ``x`` as an int >= 1 (a size: heads, a basis size, a window)."""
    return integer_at_least(name, x, 1)


def nonnegative_int(name: str, x: object) -> int:
    """Return ``x`` as an int >= 0 (a position, a count)."""
    return integer_at_least(name, x, 0)


def integer_at_least(name: str, x: object, minimum: int) -> int:
    """Return ``x``, a Python or NumPy integer >= ``minimum`` (bools refused), as int."""
    if isinstance(x, bool) or not isinstance(x, int | np.integer) or int(x) < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {x!r}")
    return int(x)


def finite_result(arr: NDArray[ScalarT], cause: str) -> NDArray[ScalarT]:
    """Return ``arr`` if every entry is finite; otherwise raise a ValueError naming ``cause``.

    ``cause`` says which arguments overflowed float64 and how (for example ``"q, k: the
    logits s <q_i, k_j> overflow float64"``); the first offending index is appended.
    """
    bad = ~np.isfinite(arr)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{cause} (first non-finite value at index {index})")
    return arr


ResultT = TypeVar("ResultT")


def empty_batch_call(
    fn: Callable[..., ResultT],
    batched: Mapping[str, ArrayLike],
    trailing: Mapping[str, int],
    *,
    unbatched: tuple[str, ...] = (),
    fill: Mapping[str, float] | None = None,
    **rest: Any,
) -> ResultT | None:
    """An empty batch (B = 0) [decision: as SDPA, empty outputs of the right shape].

    When a leading (batch) dim of ``batched`` is 0, the call ``fn(**batched, **rest)`` is
    validated on a batch of one (ones as values, each array's dtype) and its results are
    returned as zeros with the empty leading dims; otherwise None and the caller computes.

    Args:
        batched: the arrays with leading batch dims, which must agree exactly.
        trailing: for each of them the number of its non-batch axes (2 for q (..., T, dk)).
        unbatched: fields of a NamedTuple result that carry no batch dims (parameter
            gradients, sums over the batch): returned as zeros of their shape.
        fill: the stand-in value of an array where 1 is not valid (log_f = 0: gates f = 1).
    """
    shapes = {name: np.shape(x) for name, x in batched.items()}
    lead = {name: s[: max(len(s) - trailing[name], 0)] for name, s in shapes.items()}
    first = next(iter(lead))
    if 0 not in lead[first]:
        return None
    for name, dims in lead.items():
        if dims != lead[first]:
            raise ValueError(
                f"{name}: expected the leading dims {lead[first]} of {first}, got shape "
                f"{shapes[name]}"
            )
    ones = (1,) * len(lead[first])
    stand_in = {
        name: np.full(
            ones + shapes[name][len(ones) :], (fill or {}).get(name, 1.0), np.asarray(x).dtype
        )
        for name, x in batched.items()
    }
    result = fn(**stand_in, **rest)

    def empty(r: NDArray[Any]) -> NDArray[Any]:
        return np.zeros(lead[first] + r.shape[len(ones) :], dtype=r.dtype)

    if isinstance(result, tuple) and hasattr(result, "_fields"):
        fields = {f: getattr(result, f) for f in result._fields}
        kept = {f: np.zeros_like(r) if f in unbatched else empty(r) for f, r in fields.items()}
        return type(result)(**kept)
    if isinstance(result, tuple):
        return tuple(empty(r) for r in result)  # type: ignore[return-value]
    return empty(result)  # type: ignore[arg-type,return-value]

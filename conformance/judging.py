"""The kit's ground floor: what every check judges with.

A check (an output, a gradient, a call order, a finite difference, a decode session) ends in a
:class:`CaseResult`; its comparisons (:class:`~.metrics.Comparison`) are summarised into the
verdict by :func:`summarise`. The reference's results are computed once per (case, seed, dtype)
and kept in :data:`REFERENCE_CACHE`. A backend must not write into what it is given:
:func:`snapshot` before the call and :func:`mutated` after it name the arrays it changed. The
returned dtype is judged in the kit's dtype names (:func:`returned_dtype`, :func:`dtype_problem`).

The runner (:mod:`.runner`), the session driver (:mod:`.sessions`) and the skip files
(:mod:`.skips`) import this module; it imports none of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import numpy as np

from .metrics import Comparison
from .protocol import Backend

Result = TypeVar("Result")


@dataclass
class CaseResult:
    """The verdict of one (case, dtype, kind)."""

    case_id: str
    op: str
    dtype: str
    kind: str
    verdict: str  # passed | failed | not implemented | skipped
    error: float = float("nan")  # normwise relative error of the worst-placed quantity
    tolerance: float = float("nan")
    ratio: float = float("nan")  # worst error / tolerance over the compared quantities
    message: str = ""
    raised: str = ""  # "<type>: <message>" when the backend raised
    repro: str = ""
    seed: int = 0
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # the case's note: its conventions (ties of spec/fpa.md section 6), limits
    backend: str = ""  # the name the backend was run under (the repro line's --backend)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReferenceCache:
    """The reference's outputs and gradients per (case, seed, dtype), reused across backends run
    in one process (the mutant self-test runs the same cases many times). Bounded; the arrays
    handed out are never given to a backend (the runner gives it copies)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def get(self, key: tuple[Any, ...], compute: Callable[[], Result]) -> Result:
        """The value under ``key``, computed by ``compute()`` the first time."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        value = compute()
        self.entries[key] = value
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


REFERENCE_CACHE = ReferenceCache()


def summarise(result: CaseResult, comparisons: dict[str, Comparison]) -> CaseResult:
    """Fill ``result`` from its comparisons: the worst ratio's error and tolerance, every
    comparison in ``details``, and "failed" with each failing one in the message, else
    "passed"."""
    failed = {n: c for n, c in comparisons.items() if not c.passed}
    worst = max(comparisons.values(), key=lambda c: c.ratio)
    result.error = worst.rel
    result.tolerance = worst.tolerance
    result.ratio = worst.ratio
    result.details = {n: c.describe() for n, c in comparisons.items()}
    if failed:
        result.verdict = "failed"
        result.message = "; ".join(f"{n}: {c.describe()}" for n, c in failed.items())
    else:
        result.verdict = "passed"
    return result


def storage_dtype(dtype: str) -> str:
    """The dtype an array of the tested ``dtype`` is stored in (tf32 is float32 storage)."""
    return "float32" if dtype == "tf32" else dtype


def returned_dtype(backend: Backend, x: Any) -> str:
    """The dtype of a returned array in the kit's names: ``backend.dtype_name`` if it has one."""
    namer = getattr(backend, "dtype_name", None)
    if namer is not None:
        return str(namer(x))
    return np.asarray(backend.to_numpy(x)).dtype.name


def dtype_problem(backend: Backend, x: Any, allowed: tuple[str, ...]) -> str:
    """ "" when the returned ``x`` has one of the ``allowed`` dtypes, else what is wrong."""
    got = returned_dtype(backend, x)
    if got in allowed:
        return ""
    if got == "float32" and "bfloat16" in allowed and not hasattr(backend, "dtype_name"):
        return ""  # widened by to_numpy; without dtype_name the kit cannot tell
    return f"wrong dtype {got}, expected {' or '.join(allowed)}"


def snapshot(backend: Backend, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    """Copies of the values of the backend's ``arrays``, to compare with after a call."""
    return {n: np.array(backend.to_numpy(x), copy=True) for n, x in arrays.items()}


def mutated(backend: Backend, arrays: dict[str, Any], before: dict[str, np.ndarray]) -> list[str]:
    """Names of the arrays whose values changed since the snapshot ``before``."""
    changed = []
    for name, x in arrays.items():
        after = np.asarray(backend.to_numpy(x))
        if after.shape != before[name].shape or not np.array_equal(
            after, before[name], equal_nan=True
        ):
            changed.append(name)
    return changed


def mutation_comparison(what: str, names: list[str]) -> Comparison:
    """The failed comparison of arrays the backend wrote into (``what``: "inputs", ...)."""
    return Comparison(
        np.inf, 0.0, np.inf, (), f"the backend modified its {what} {', '.join(names)} in place"
    )

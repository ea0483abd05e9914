"""One table of numerical checks: each returns a :class:`CheckResult` with its verdict.

A check is a function with keyword-only arguments naming the implementation pieces it tests
(defaulting to the reference), so a test can feed it a deliberately wrong implementation and see
it fail. The witness of every check is computed independently of the statement it tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

# the one definition of the witness metric, re-exported for the checks
from attnspec.reference.metrics import relative_error as relative_error


@dataclass(frozen=True)
class CheckResult:
    """One row of the theory report.

    ``measured`` is compared with ``tolerance``: it must be <= tolerance (an error or a count of
    violations) unless ``at_least`` is set (a measured quantity that must reach the tolerance).
    """

    id: str
    statement: str
    witness: str
    measured: float
    tolerance: float
    passed: bool
    at_least: bool = False
    table: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def verdict(
    id: str,
    statement: str,
    witness: str,
    measured: float,
    tolerance: float,
    *,
    at_least: bool = False,
    table: list[str] | None = None,
) -> CheckResult:
    """Build a result; NaN never passes."""
    measured = float(measured)
    ok = measured >= tolerance if at_least else measured <= tolerance
    ok = ok and not math.isnan(measured)
    return CheckResult(id, statement, witness, measured, tolerance, ok, at_least, table or [])


CHECKS: dict[str, Callable[..., CheckResult]] = {}


def check(id: str) -> Callable[[Callable[..., CheckResult]], Callable[..., CheckResult]]:
    """Register a check function under its spec label (T1, H3, ...)."""

    def register(fn: Callable[..., CheckResult]) -> Callable[..., CheckResult]:
        if id in CHECKS:
            raise ValueError(f"check {id!r} registered twice")
        CHECKS[id] = fn
        return fn

    return register


def run_checks(ids: list[str] | None = None) -> list[CheckResult]:
    """Run the named checks (all by default) with the reference implementation.

    An exception inside a check becomes a failed row carrying the message. The check modules
    registered themselves on import of the package (theory/__init__.py).
    """
    unknown = sorted(set(ids or []) - set(CHECKS))
    if unknown:
        raise ValueError(f"ids: unknown checks {unknown}; known: {sorted(CHECKS)}")
    results = []
    for id_ in ids or list(CHECKS):
        try:
            results.append(CHECKS[id_]())
        except Exception as exc:  # reported as a failed row, never a crash of the report
            results.append(
                CheckResult(
                    id_,
                    "(check raised)",
                    f"{type(exc).__name__}: {exc}",
                    math.nan,
                    0.0,
                    passed=False,
                )
            )
    return results

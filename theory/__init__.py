"""attnspec.theory: numerical verification of the theorems and identities of the spec.

Each statement (T1-T6 of spec/fpa.md section 4, H1-H11 of spec/interdomain.md section 3, and
the FoX reduction (F6), the decode sessions (F8), (F9), (F3w), (I15)) is a registered check
returning a statement, a witness, a measured value,
a tolerance and a verdict. ``python -m attnspec.theory`` prints the table.
"""

# Every check module, imported with the package so that its checks register (Python imports
# this file before any module of the package, so ``registry.run_checks`` always sees them all).
from . import (  # noqa: F401
    context_parallel,
    eviction,
    expressivity,
    fox_reduction,
    hippo_identities,
    sessions,
    stack,
)
from .registry import CHECKS, CheckResult, run_checks


def load_all() -> None:
    """Every check module is registered on import of the package; kept for callers that ask."""


__all__ = ["CHECKS", "CheckResult", "load_all", "run_checks"]

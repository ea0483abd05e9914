"""attnspec.theory: numerical verification of the theorems and identities of the spec.

Each statement (T1-T6 of spec/fpa.md section 4, H1-H11 of spec/interdomain.md section 3, and
the FoX reduction (F6), the decode sessions (F8), (F9), (F3w), (I15)) is a registered check
returning a statement, a witness, a measured value,
a tolerance and a verdict. ``python -m attnspec.theory`` prints the table.
"""

from .registry import CHECKS, CheckResult, run_checks


def load_all() -> None:
    """Import every check module so that its checks register."""
    from . import (  # noqa: F401
        context_parallel,
        eviction,
        expressivity,
        fox_reduction,
        hippo_identities,
        sessions,
        stack,
    )


__all__ = ["CHECKS", "CheckResult", "load_all", "run_checks"]

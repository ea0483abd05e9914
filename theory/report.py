"""Printing and saving the theory table."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from .registry import CheckResult


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if x != int(x) or abs(x) >= 1e6 else str(int(x))


def format_table(results: Sequence[CheckResult]) -> str:
    """One row per statement: id, verdict, measured vs tolerance, statement; then the witness."""
    lines = [f"{'check':<12} {'verdict':<7} {'measured':>10}    {'tolerance':<11} statement"]
    lines.append("-" * 100)
    for r in results:
        op = ">=" if r.at_least else "<="
        mark = "PASS" if r.passed else "FAIL"
        lines.append(
            f"{r.id:<12} {mark:<7} {_fmt(r.measured):>10} {op} {_fmt(r.tolerance):<11} "
            f"{r.statement}"
        )
        lines.append(f"{'':<12} witness: {r.witness}")
        lines.extend(f"{'':<14}{row}" for row in r.table)
    failed = [r.id for r in results if not r.passed]
    lines.append("-" * 100)
    lines.append(
        f"{len(results) - len(failed)} passed, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return "\n".join(lines)


def write_json(results: Sequence[CheckResult], path: str) -> None:
    with open(path, "w") as fh:
        json.dump([r.as_dict() for r in results], fh, indent=2)

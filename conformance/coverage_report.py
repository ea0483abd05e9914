"""The menu's pair coverage, the report the kit prints after a run: per op, the pairs of its
feature axes (conformance/covering_cases.py's designs) that the menu's cases cover
(:func:`.covering_cases.case_axes` reads any case's values), those it misses, and those a
backend without some capability cannot run.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import session_covering
from .cases import build_case, case_ids
from .covering import Pair, coverage, unavailable
from .covering_cases import DESIGNS, case_axes
from .drawers import Case
from .sessions import is_session


def menu_coverage(
    with_covering: bool = True,
    capabilities: set[str] | None = None,
    menu: Sequence[Case] | None = None,
) -> dict[str, tuple[int, int, set[Pair], set[Pair]]]:
    """Per op: (covered, required, missing pairs, covered pairs unavailable to
    ``capabilities``) over ``menu`` (default: the kit's whole menu, with or without the
    covering families); a given menu reports the ops it holds."""
    if menu is None:
        menu = [
            build_case(i) for i in case_ids(list(DESIGNS)) if with_covering or "/covering/" not in i
        ]
    held = {c.op for c in menu}
    out = {}
    for op, design in DESIGNS.items():
        if op not in held:
            continue
        rows_ = [case_axes(c) for c in menu if c.op == op and "session" not in c.params]
        covered, missing = coverage(design, rows_)
        lacking = set() if capabilities is None else unavailable(design, covered, capabilities)
        out[op] = (len(covered), len(design.required()), missing, lacking)
    return out


def coverage_lines(
    capabilities: set[str] | None = None, menu: Sequence[Case] | None = None
) -> list[str]:
    """The report the kit prints: per op the pairs its menu covers, those it misses, and those
    a backend with ``capabilities`` cannot run ("strided": it has asarray_strided)."""
    lines = []
    for op, (covered, required, missing, lacking) in menu_coverage(
        with_covering=True, capabilities=capabilities, menu=menu
    ).items():
        line = f"pair coverage, {op}: {covered}/{required} pairs of its axes"
        if lacking:
            design = DESIGNS[op]
            needed = {design.needs(a, x) for a, x, _, _ in lacking}
            needed |= {design.needs(b, y) for _, _, b, y in lacking}
            kinds = sorted(needed - {""} - (capabilities or set()))
            line += f"; {len(lacking)} not run here (the backend lacks {', '.join(kinds)})"
        lines.append(line)
        for a, x, b, y in sorted(missing, key=repr)[:10]:
            lines.append(f"  not covered: {a}={x!r} with {b}={y!r}")
    return lines


def session_coverage(with_covering: bool = True) -> dict[str, tuple[int, int, set[Pair]]]:
    """Per session op: (covered, required, missing pairs) over the kit's session programs
    (with or without the covering family)."""
    out = {}
    for op in session_covering.OPS:
        required = session_covering.DESIGNS[op].required()
        got: set[Pair] = set()
        for case_id in case_ids([op]):
            if "/session_" not in case_id or (
                not with_covering and "/session_covering/" in case_id
            ):
                continue
            case = build_case(case_id)
            if is_session(case):
                got |= session_covering.covered_pairs(
                    op, session_covering.program_axes(op, case.params["session"])
                )
        out[op] = (len(required & got), len(required), required - got)
    return out


def session_coverage_lines() -> list[str]:
    """The report: per op the pairs covered without and with the covering family."""
    before = session_coverage(with_covering=False)
    after = session_coverage(with_covering=True)
    lines = []
    for op in session_covering.OPS:
        b, required, _ = before[op]
        a, _, missing = after[op]
        lines.append(
            f"session pair coverage, {op}: {a}/{required} (without the covering family {b})"
        )
        for x in sorted(missing, key=repr)[:10]:
            lines.append(f"  not covered: {x[0]}={x[1]!r} with {x[2]}={x[3]!r}")
    return lines

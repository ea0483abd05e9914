"""The menu's pair coverage, the report the kit prints after a run: per op, the pairs of its
feature axes (conformance/covering_cases.py's designs) that the menu's cases cover
(:func:`.covering_cases.case_axes` reads any case's values), those it misses, and those a
backend without some capability cannot run.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cases import build_case, case_ids
from .covering import Pair, coverage, unavailable
from .covering_cases import DESIGNS, case_axes
from .drawers import Case


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

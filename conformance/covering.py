"""Covering designs over the feature axes: per op a family whose cases cover every pair of
values of any two axes at least once (all-pairs, a strength-2 covering array).

A bug that needs two features at once (GQA with a strided layout, a packing with a head dim
that is not a power of two, a large scale on a multi-tile row) passes families that vary one
or two axes at a time. :func:`all_pairs` builds the rows greedily (the AETG scheme: each new
row starts from an uncovered pair and takes, axis by axis, the value that covers the most
uncovered pairs; ties broken by a generator seeded from the family), deterministic from
(axes, seed) and cut at a case budget. Constraints are pairwise (``forbid``): a forbidden pair
is one the op cannot take (packed sequences need B = 1), never counted as missing.

The kit's whole menu is judged by the same axes: :func:`axis_values` reads a case's value on
each axis from its shapes and params, so :func:`.coverage_report.menu_coverage` counts the pairs
the menu covers, with and without these families, and :func:`.coverage_report.coverage_lines`
prints them with the pairs that need a capability a backend lacks (docs/conformance.md,
"Covering designs").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np

Row = dict[str, Any]
Pair = tuple[str, Any, str, Any]
Forbid = Callable[[str, Any, str, Any], bool]


def _never(a: str, x: Any, b: str, y: Any) -> bool:
    return False


def _pair(a: str, x: Any, b: str, y: Any, order: Mapping[str, int]) -> Pair:
    return (a, x, b, y) if order[a] < order[b] else (b, y, a, x)


def required_pairs(axes: Sequence[tuple[str, Sequence[Any]]], forbid: Forbid = _never) -> set[Pair]:
    """Every pair of values of two distinct axes that ``forbid`` allows."""
    out = set()
    for (a, xs), (b, ys) in combinations(axes, 2):
        for x in xs:
            for y in ys:
                if not (forbid(a, x, b, y) or forbid(b, y, a, x)):
                    out.add((a, x, b, y))
    return out


def row_pairs(row: Mapping[str, Any], order: Mapping[str, int]) -> set[Pair]:
    """The pairs one row covers (over the axes in ``order``)."""
    names = [a for a in order if a in row]
    return {_pair(a, row[a], b, row[b], order) for a, b in combinations(names, 2)}


def all_pairs(
    axes: Sequence[tuple[str, Sequence[Any]]],
    seed: int,
    budget: int,
    forbid: Forbid = _never,
    candidates: int = 40,
) -> list[Row]:
    """Rows (one value per axis) covering every allowed pair, greedily, at most ``budget`` rows;
    each row respects ``forbid``. The same (axes, seed, budget) give the same rows."""
    order = {a: i for i, (a, _) in enumerate(axes)}
    values = dict(axes)
    uncovered = required_pairs(axes, forbid)
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    while uncovered and len(rows) < budget:
        pool = sorted(uncovered, key=repr)
        best: tuple[int, Row] | None = None
        for _ in range(candidates):
            a, x, b, y = pool[int(rng.integers(len(pool)))]
            row: Row = {a: x, b: y}
            rest = [n for n, _ in axes if n not in row]
            for name in [rest[i] for i in rng.permutation(len(rest))]:
                choices = [
                    v
                    for v in values[name]
                    if not any(
                        forbid(name, v, o, row[o]) or forbid(o, row[o], name, v) for o in row
                    )
                ]
                if not choices:
                    break
                gains = [
                    sum(_pair(name, v, o, row[o], order) in uncovered for o in row) for v in choices
                ]
                top = max(gains)
                tied = [v for v, g in zip(choices, gains, strict=True) if g == top]
                row[name] = tied[int(rng.integers(len(tied)))]
            if len(row) < len(axes):
                continue
            gain = len(row_pairs(row, order) & uncovered)
            if best is None or gain > best[0]:
                best = (gain, row)
        if best is None or best[0] == 0:
            break
        rows.append({n: best[1][n] for n, _ in axes})
        uncovered -= row_pairs(best[1], order)
    return rows


@dataclass(frozen=True)
class Design:
    """The axes of one op with their pairwise constraints and the capability each value needs
    (``needs(axis, value)`` -> capability or ""), and the case budget of its family."""

    op: str
    axes: tuple[tuple[str, tuple[Any, ...]], ...]
    budget: int
    forbid: Forbid = _never
    needs: Callable[[str, Any], str] = lambda a, x: ""

    @property
    def order(self) -> dict[str, int]:
        return {a: i for i, (a, _) in enumerate(self.axes)}

    def required(self) -> set[Pair]:
        return required_pairs(self.axes, self.forbid)


@functools.cache
def design_rows(design: Design, seed: int) -> tuple[Row, ...]:
    """The covering rows of ``design`` (cached: every case of a family reads its own row)."""
    return tuple(all_pairs(design.axes, seed, design.budget, design.forbid))


def coverage(design: Design, rows: Iterable[Mapping[str, Any]]) -> tuple[set[Pair], set[Pair]]:
    """(covered, missing) required pairs of ``design`` over ``rows`` (rows may lack axes or hold
    values off the axes: the pairs they do hold count)."""
    required = design.required()
    got: set[Pair] = set()
    for row in rows:
        got |= row_pairs(row, design.order)
    return required & got, required - got


def unavailable(design: Design, pairs: Iterable[Pair], capabilities: set[str]) -> set[Pair]:
    """The pairs whose values need a capability not in ``capabilities``."""
    return {
        p
        for p in pairs
        if any(
            (need := design.needs(axis, value)) and need not in capabilities
            for axis, value in ((p[0], p[1]), (p[2], p[3]))
        )
    }


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def classify_length(T: int, tile: int = 64) -> str:
    """T against the tile borders: 'one' (T = 1), 'below' a tile, 'on' a tile multiple,
    'across' (one past a border, within two tiles) or 'long' (more than two tiles)."""
    if T == 1:
        return "one"
    if T < tile:
        return "below"
    if T > 2 * tile + 1:
        return "long"
    return "on" if T % tile == 0 else "across"


def classify_packing(offsets: Sequence[int] | None, tile: int = 64) -> str:
    """'none', 'empty_or_one' (a length 0 or 1 sequence), 'equal' lengths, 'tile_borders'
    (every inner border on a multiple of 16) or 'unequal'."""
    if offsets is None:
        return "none"
    lengths = np.diff(np.asarray(offsets))
    if (lengths <= 1).any():
        return "empty_or_one"
    if len(set(lengths.tolist())) == 1:
        return "equal"
    inner = np.asarray(offsets)[1:-1]
    return "tile_borders" if len(inner) and (inner % 16 == 0).all() else "unequal"


def draw_offsets(rng: np.random.Generator, kind: str, T: int) -> tuple[int, ...] | None:
    """cu_seqlens of the packing class ``kind`` over T tokens (T >= 4 unless 'none')."""
    if kind == "none":
        return None
    if kind == "equal":
        parts = 2 if T % 2 == 0 else (3 if T % 3 == 0 else 1)
        if parts == 1:
            return (0, T)
        return tuple(range(0, T + 1, T // parts))
    if kind == "unequal":
        a = max(1, T // 3) + 1
        return (0, a, T) if T - a > 1 and a != T - a else (0, T)
    if kind == "empty_or_one":
        cut = int(rng.integers(2, T - 1)) if T > 3 else 1
        return (0, 1, 1, cut, T) if cut > 1 else (0, 1, 1, T)
    if kind == "tile_borders":
        inner = [b for b in (16, 64, 128) if b < T - 1]
        return (0, *inner, T) if inner else (0, T)
    raise ValueError(f"kind: unknown packing {kind!r}")

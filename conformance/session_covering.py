"""Session programs from covering designs: every pair of session-feature values in some program.

The session families judge one serving feature at a time; a serving bug lives where two meet
(a rollback after a select, a window with a rollback budget that is not full, padding with GQA).
Per session op a :class:`~.covering.Design` over the session's feature axes gives all-pairs
rows (:func:`~.covering.all_pairs`), and :func:`program` writes each row as a program
(``<prefix>/session_covering/<n>``). :func:`program_axes` reads the axis values any program
shows (a program may show several values of one axis: a chunk of one token and a whole prompt),
so :func:`.coverage_report.session_coverage` counts the pairs the session menu covers, with
and without the covering families.

Axes: theta (finite, inf), window (none, small: 4, larger than the session), max_rollback
(0, small: 3, large: 6), rollback depth (none: n = 0, partial, whole: the row's budget) and when
it happens (before a select, after one, after the window freed entries, at a budget that is not
full), select (identity, permutation, repetition, dropping rows), chunking (one token, uneven
chunks, a whole prompt), GQA group (1, 2), padding (none, left, right, ragged) and the S4D and
Interdomain layer readout (linear, ratio). The dtype is not an axis: every program runs in every
dtype the backend declares, so every pair with a dtype is covered by every program.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from itertools import combinations, product
from typing import Any

import numpy as np

from .covering import Design, Pair, Row, all_pairs
from .session_programs import Program, Script, script

NOTE = (
    "all-pairs covering design over the session features (theta, window, max_rollback, rollback "
    "depth and moment, select, chunking, padding, GQA, readout; conformance/session_covering.py)"
)
SMALL_WINDOW, LARGE_WINDOW = 4, 64  # a session here has at most about 40 tokens a row
ROLLBACKS = {"0": 0, "small": 3, "large": 6}
SELECTS = {"identity": [0, 1, 2], "permutation": [2, 0, 1], "repetition": [0, 0, 2]}
SELECTS["dropping"] = [0, 2]

DEPTH = ("rollback", ("none", "partial", "whole"))
SELECT = ("select", tuple(SELECTS))
CHUNKING = ("chunking", ("one", "uneven", "whole"))
PADDING = ("padding", ("none", "left", "right", "ragged"))
MAX_ROLLBACK = ("max_rollback", tuple(ROLLBACKS))


def _forbid(a: str, x: Any, b: str, y: Any) -> bool:
    """No rollback with max_rollback 0 (depth, or a budget below a maximum of 0); entries are
    freed only by a window shorter than the session."""
    if a == "max_rollback" and x == "0":
        return (b == "rollback" and y != "none") or (b == "when" and y == "budget_not_full")
    if a == "when" and x == "after_freed":
        return b == "window" and y != "small"
    return False


def _design(op: str) -> Design:
    fpa = op in ("fpa_decode", "fpa_layer", "fox_attention")
    when = ("before_select", "after_select", "after_freed", "budget_not_full")
    axes: list[tuple[str, tuple[Any, ...]]] = []
    if op in ("fpa_decode", "fpa_layer"):
        axes.append(("theta", ("finite", "inf")))
    if fpa:
        axes.append(("window", ("none", "small", "larger")))
    axes += [MAX_ROLLBACK, DEPTH, ("when", when if fpa else when[:2] + when[3:])]
    axes += [SELECT, CHUNKING, PADDING]
    if op in ("fpa_decode", "fox_attention"):
        axes.append(("group", (1, 2)))
    if op in ("interdomain_s4d", "interdomain_layer"):
        axes.append(("readout", ("linear", "ratio")))
    return Design(op, tuple(axes), 40, _forbid)


OPS = (
    "fpa_decode",
    "fox_attention",
    "interdomain_s4d",
    "interdomain_legs",
    "fpa_layer",
    "interdomain_layer",
)
DESIGNS = {op: _design(op) for op in OPS}


@functools.cache
def rows(op: str) -> tuple[Row, ...]:
    """The covering rows of ``op``'s session design (deterministic)."""
    design = DESIGNS[op]
    return tuple(all_pairs(design.axes, seed=53, budget=design.budget, forbid=design.forbid))


# writing a row as a program


class _Budgets:
    """Each row's rollback budget as the program goes (F9): advance adds the row's tokens up to
    max_rollback, select copies, rollback subtracts."""

    def __init__(self, s: Script, maximum: int) -> None:
        self.s, self.maximum, self.b = s, maximum, [0] * s.rows

    def advance(self, present: np.ndarray, note: str = "") -> None:
        self.s.advance(present, note)
        self.b = [min(self.maximum, b + int(p.sum())) for b, p in zip(self.b, present, strict=True)]

    def select(self, chosen: list[int], note: str) -> None:
        self.s.select(chosen, note)
        self.b = [self.b[i] for i in chosen]

    def rollback(self, row: int, n: int, note: str) -> None:
        self.s.rollback(row, n, note=note)
        self.b[row] -= n


def _mask(rows: int, n: int, padding: str) -> np.ndarray:
    """The present mask of the padded chunk (n >= 3): left padding on row 0, right padding on
    row 1, or row 2 out of the whole chunk (ragged rows)."""
    mask = np.ones((rows, n), dtype=bool)
    if padding == "left":
        mask[0, : n // 3] = False
    elif padding == "right" and rows > 1:
        mask[1, n - n // 3 :] = False
    elif padding == "ragged" and rows > 2:
        mask[2] = False
    return mask


def _chunks(chunking: str, tokens: int) -> list[int]:
    if chunking == "one":
        return [1] * tokens
    if chunking == "whole":
        return [tokens]
    plan, left = [], tokens
    for size in (5, 2, 7, 3, 1, 4):
        if left <= 0:
            break
        plan.append(min(size, left))
        left -= plan[-1]
    return plan + ([left] if left > 0 else [])


def program(op: str, rng: np.random.Generator, n: int) -> Program:
    """Row n of ``op``'s design as a program: a prompt (chunked as the row says, padded as it
    says), a select, more tokens, and a rollback at the row's moment and depth (of the row with
    the largest budget)."""
    row = rows(op)[n]
    maximum = ROLLBACKS[row["max_rollback"]]
    window = {"none": None, "small": SMALL_WINDOW, "larger": LARGE_WINDOW}[
        row.get("window", "none")
    ]
    theta = np.inf if row.get("theta") == "inf" else 2.0 + 1 / 16
    heads = (4, 2) if row.get("group") == 2 else (2, 2)
    s = script(op, rng, n, 3, theta=theta, window=window, max_rollback=maximum, heads=heads)
    if "readout" in row:
        _set_readout(op, s.config, row["readout"])
    budgets = _Budgets(s, maximum)

    def rollback(note: str, row_: int | None = None) -> None:
        r = int(np.argmax(budgets.b)) if row_ is None else row_  # the row with most to undo
        b = budgets.b[r]
        depth = {"none": 0, "partial": b // 2, "whole": b}[row["rollback"]]
        budgets.rollback(r, depth, note=f"{row['rollback']} rollback ({note})")

    prompt = _chunks(row["chunking"], 12)
    if row["chunking"] == "one" and row["padding"] != "none":
        prompt.append(4)  # one-token chunks show no left or right: a padded chunk of 4
    padded = next(i for i, size in enumerate(prompt) if size >= 3 or i == len(prompt) - 1)
    for i, size in enumerate(prompt):
        present = _mask(s.rows, size, row["padding"] if i == padded else "none")
        budgets.advance(present, f"prompt: {row['chunking']} chunks, {row['padding']} padding")
    if row["when"] == "before_select":
        rollback("before a select")
    budgets.select(SELECTS[row["select"]], f"select: {row['select']}")
    budgets.advance(np.ones((s.rows, 1), dtype=bool), "a step after the select")
    if row["when"] == "after_select":
        rollback("after the select")
    for size in _chunks(row["chunking"], 8):
        budgets.advance(np.ones((s.rows, size), dtype=bool), "more tokens")
    if row["when"] == "after_freed":
        rollback("after the window freed entries")
    if row["when"] == "budget_not_full":
        r = int(np.argmax(budgets.b))
        budgets.rollback(r, 1, note="a rollback of 1: the budget is no longer full")
        rollback("at a budget that is not full", r)
    budgets.advance(np.ones((s.rows, 1), dtype=bool), "a step after the rollback")
    budgets.advance(np.ones((s.rows, 2), dtype=bool), "two more")
    return s.program()


def _set_readout(op: str, config: dict[str, Any], readout: str) -> None:
    """The readout of an S4D session (config "readout") or of the Interdomain layer's session,
    with what keeps a ratio's denominators away from 0: real positive Lambda and b (S4D; the
    features are positive), the layer's positive k~ and C + I as in its session families."""
    if op == "interdomain_s4d":
        config["readout"] = readout
        if readout == "ratio":
            config["lam_re"] = np.hypot(config["lam_re"], config["lam_im"])
            config["lam_im"] = np.zeros_like(config["lam_im"])
            config["b_re"] = np.abs(config["b_re"]) + 0.5
            config["b_im"] = np.zeros_like(config["b_im"])
            M = config["c_re"].shape[-1]
            config["c_re"] = np.abs(config["c_re"]) + 2 * np.eye(M)
            config["c_im"] = np.zeros_like(config["c_im"])
        return
    config["readout"] = readout
    if readout == "ratio":
        params = dict(config["params"])
        params["norm_k_b"] = params["norm_k_b"] + 3.0
        params["c_re"] = params["c_re"] + np.eye(params["c_re"].shape[-1])
        config["params"] = params


# reading a program's axis values


def _select_kind(chosen: list[int], before: int) -> str:
    if len(set(chosen)) < len(chosen):
        return "repetition"
    if len(chosen) < before:
        return "dropping"
    return "identity" if chosen == list(range(before)) else "permutation"


def _padding_kind(mask: np.ndarray) -> set[str]:
    kinds = set()
    for row in np.asarray(mask, dtype=bool):
        if row.all() or not row.size:
            continue
        on = np.flatnonzero(row)
        if not on.size:
            kinds.add("ragged")
        elif on[-1] - on[0] + 1 < on.size or not row[on[0] : on[-1] + 1].all():
            kinds.add("ragged")
        elif on[0] > 0 and on[-1] == row.size - 1:
            kinds.add("left")
        elif on[0] == 0:
            kinds.add("right")
        else:
            kinds.add("ragged")
    return kinds or {"none"}


def program_axes(op: str, prog: Program) -> dict[str, set[Any]]:
    """The values of ``op``'s session axes that ``prog`` shows (each axis a set)."""
    cfg = prog.config
    seen: dict[str, set[Any]] = {}
    tokens = [0] * prog.rows
    budgets = [0] * prog.rows  # as the program goes: rows follow select
    maximum = int(cfg.get("max_rollback", 0))
    window = cfg.get("window")
    selected, chunks = False, 0
    timeline: list[tuple[str, Any]] = []  # selects and rollbacks, in order
    for call in prog.calls:
        if call.error:
            continue
        if call.method == "advance":
            mask = np.asarray(call.args["present"], dtype=bool)
            size = mask.shape[1]
            if size:
                kind = "one" if size == 1 else ("whole" if chunks == 0 and size >= 8 else "uneven")
                seen.setdefault("chunking", set()).add(kind)
                seen.setdefault("padding", set()).update(_padding_kind(mask))
                chunks += 1
            for r in range(len(tokens)):
                tokens[r] += int(mask[r].sum())
                budgets[r] = min(maximum, budgets[r] + int(mask[r].sum()))
        elif call.method == "select":
            chosen = list(call.args["rows"])
            seen.setdefault("select", set()).add(_select_kind(chosen, len(tokens)))
            tokens = [tokens[i] for i in chosen]
            budgets = [budgets[i] for i in chosen]
            selected = True
            timeline.append(("select", None))
        else:
            r, n = int(call.args["row"]), int(call.args["n"])
            depth = "none" if n == 0 else ("whole" if n == budgets[r] else "partial")
            when = {"after_select"} if selected else set()
            if window is not None and tokens[r] > window:
                when.add("after_freed")
            if budgets[r] < maximum:
                when.add("budget_not_full")
            timeline.append(("rollback", (depth, when)))
            budgets[r] -= n
            tokens[r] -= n
    for i, (what, info) in enumerate(timeline):
        if what == "rollback":
            depth, when = info
            if any(w == "select" for w, _ in timeline[i + 1 :]):
                when = when | {"before_select"}
            seen.setdefault("rollback", set()).add(depth)
            seen.setdefault("when", set()).update(when)
    if "theta" in cfg:
        seen["theta"] = {"inf" if np.isinf(cfg["theta"]) else "finite"}
    if op in ("fpa_decode", "fpa_layer", "fox_attention"):
        longest = max(tokens) if tokens else 0
        seen["window"] = {"none" if window is None else ("small" if window < longest else "larger")}
    seen["max_rollback"] = {"0" if maximum == 0 else ("small" if maximum <= 3 else "large")}
    if "heads" in cfg and op in ("fpa_decode", "fox_attention"):
        seen["group"] = {cfg["heads"] // cfg["kv_heads"]}
    if op in ("interdomain_s4d", "interdomain_layer"):
        seen["readout"] = {cfg.get("readout", "linear")}
    return seen


def covered_pairs(op: str, shown: Mapping[str, set[Any]]) -> set[Pair]:
    """The pairs of the design's axes a program showing ``shown`` covers."""
    order = DESIGNS[op].order
    names = [a for a in order if a in shown]
    out = set()
    for a, b in combinations(names, 2):
        out |= {(a, x, b, y) for x, y in product(shown[a], shown[b])}
    return out

"""(T1) the stack theorem, lexical scoping of brackets, and (T2) monotonicity."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from numpy.typing import NDArray

from attnspec.reference import fpa

from .registry import CheckResult, check, verdict


def bracket_tokens(rng: np.random.Generator, T: int) -> list[str]:
    """A random token string over '(', ')', 'x' whose prefixes never close more than they open."""
    tokens, depth = [], 0
    for _ in range(T):
        kind = rng.choice(["(", ")", "x"], p=[0.35, 0.3, 0.35])
        if kind == ")" and depth == 0:
            kind = "x"
        depth += {"(": 1, ")": -1}.get(kind, 0)
        tokens.append(str(kind))
    return tokens


def bracket_field(tokens: list[str]) -> NDArray[np.float64]:
    """delta = +1 on '(', -1 on ')', 0 otherwise; the field is the running depth."""
    return np.cumsum([{"(": 1.0, ")": -1.0}.get(t, 0.0) for t in tokens])


def open_scope_live(tokens: list[str]) -> NDArray[np.bool_]:
    """Lexical scoping, by a parser: token j is visible at i iff the block holding j is still open.

    The block of j is the innermost '(' still open after j is read ('(' belongs to its own block,
    ')' to the outer one); it closes at its matching ')'.
    """
    T = len(tokens)
    closer = np.full(T, T)  # position of the ')' that closes the block of j (T: never)
    open_stack: list[int] = []
    members: dict[int, list[int]] = {-1: []}
    for t, tok in enumerate(tokens):
        if tok == "(":
            open_stack.append(t)
            members[t] = []
        elif tok == ")":
            start = open_stack.pop()
            for member in members.pop(start):
                closer[member] = t
        members[open_stack[-1] if open_stack else -1].append(t)
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    return (j <= i) & (i < closer[None, :])


def _walks(rng: np.random.Generator) -> Iterator[NDArray[np.float64]]:
    for T in (1, 2, 7, 30, 64):
        yield np.cumsum(rng.standard_normal(T))
        yield np.cumsum(rng.integers(-1, 2, size=T)).astype(float)  # integer walks: ties
        yield bracket_field(bracket_tokens(rng, T))


@check("T1")
def stack_theorem(
    *,
    live_keys: Callable[..., NDArray[np.bool_]] = fpa.live_keys,
    stack_live_keys: Callable[..., NDArray[np.bool_]] = fpa.stack_live_keys,
) -> CheckResult:
    rng = np.random.default_rng(10)
    violations = 0
    cases = 0
    for field in _walks(rng):
        live = live_keys(field, field)
        violations += int((live != stack_live_keys(field)).sum())
        T = field.shape[0]
        for i in range(T):
            keys = np.flatnonzero(live[i])
            violations += int((np.diff(field[keys]) < 0).sum())  # levels non-decreasing
            if i + 1 < T:  # L_{i+1} = {j in L_i : phi_j <= phi_{i+1}} + {i+1}
                want = [j for j in keys if field[j] <= field[i + 1]] + [i + 1]
                violations += int(list(np.flatnonzero(live[i + 1])) != want)
        cases += 1
    return verdict(
        "T1",
        "with level = field the live keys are a monotonic stack: weak suffix minima, levels "
        "non-decreasing, each step pops a top segment and pushes the new key",
        f"monotonic-stack algorithm vs definition pi = 0 on {cases} walks (Gaussian, integer, "
        "bracket); violations counted",
        violations,
        0,
    )


@check("T1-brackets")
def brackets_are_lexical_scopes(
    *, live_keys: Callable[..., NDArray[np.bool_]] = fpa.live_keys
) -> CheckResult:
    rng = np.random.default_rng(11)
    violations = 0
    for T in (5, 20, 60, 120):
        for _ in range(5):
            tokens = bracket_tokens(rng, T)
            field = bracket_field(tokens)
            violations += int((live_keys(field, field) != open_scope_live(tokens)).sum())
    return verdict(
        "T1-brackets",
        "on bracket fields the live keys are exactly the tokens whose scopes are still open",
        "a bracket parser (matching ')' closes the block of its members), 20 random strings",
        violations,
        0,
    )


@check("T2")
def monotonicity(
    *,
    descent_depth: Callable[..., NDArray[np.float64]] = fpa.descent_depth,
    live_keys: Callable[..., NDArray[np.bool_]] = fpa.live_keys,
) -> CheckResult:
    rng = np.random.default_rng(12)
    violations = 0
    for T in (3, 17, 50):
        for _ in range(4):
            field = np.cumsum(rng.standard_normal(T))
            level = field + 2 * rng.standard_normal(T)  # general levels: not one walk
            pi = descent_depth(field, level)
            lower = np.tril(np.ones((T, T), dtype=bool), k=-1)
            # pi_ij non-decreasing in i (for i > j): a dead key never revives.
            violations += int(((np.diff(pi, axis=0) < 0) & lower[1:]).sum())
            live = live_keys(field, level)
            for i in range(1, T):
                died = live[i - 1, :i] & ~live[i, :i]
                threshold = live[i - 1, :i] & (level[:i] > field[i])
                violations += int((died != threshold).sum())
    return verdict(
        "T2",
        "pi_ij is non-decreasing in i for any levels; deaths at step i are {j : l_j > phi_i}",
        "row differences of pi and a threshold on levels, 12 random (field, level) pairs",
        violations,
        0,
    )

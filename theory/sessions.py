"""(F8 rows), (F8 gqa), (F9 rollback), (F3w) and (I15): decode sessions against whole streams.

Each check drives a reference session (:mod:`attnspec.reference.sessions`) through a program of
chunks with ragged rows and padding, select with repetitions and rollbacks, follows the token
history of every row (copied by select, cut by rollback), and compares every output with the
whole-stream op on that row's history: the parallel op for theta = inf, :func:`fpa_decode` for a
finite theta, a literal masked loop for the window. A rollback is thereby checked against
replaying the first t - n tokens (the outputs after it depend only on the history).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.special import logsumexp

from attnspec.reference import fpa, sessions
from attnspec.reference import interdomain as idm

from .registry import CheckResult, check, relative_error, verdict

Token = dict[str, NDArray[np.float64]]


@dataclass
class _Tracked:
    """A session and, per row, its tokens' inputs and the outputs it gave for them."""

    session: sessions.Session
    draw: Callable[[int, int], dict[str, NDArray[np.float64]]]  # (rows, n) -> chunk
    history: list[list[Token]] = field(default_factory=list)
    outputs: list[list[NDArray[np.float64]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        R = len(self.session.rows)
        self.history, self.outputs = [[] for _ in range(R)], [[] for _ in range(R)]

    def advance(self, present: NDArray[np.bool_]) -> None:
        axis = self.session.TOKEN_AXIS
        inputs = self.draw(*present.shape)
        out = self.session.advance(inputs, present)[self.session.OUTPUT]
        for r, p in zip(*np.nonzero(present), strict=True):
            where: tuple[Any, ...] = (r, *[slice(None)] * (axis - 1), p)
            self.history[r].append({k: x[where] for k, x in inputs.items()})
            self.outputs[r].append(out[where])

    def select(self, rows: list[int]) -> None:
        self.session.select(rows)
        self.history = [list(self.history[i]) for i in rows]
        self.outputs = [list(self.outputs[i]) for i in rows]

    def rollback(self, row: int, n: int) -> None:
        self.session.rollback(row, n)
        if n:
            del self.history[row][-n:], self.outputs[row][-n:]


def _program(tracked: _Tracked, rng: np.random.Generator) -> _Tracked:
    """Chunks of uneven sizes with ragged rows and padding, a select with repetitions, and
    rollbacks within the budget (the session must have max_rollback >= 2 and 3 rows)."""
    for size in (5, 0, 3, 1, 6, 1, 2):
        present = rng.random((len(tracked.session.rows), size)) < 0.75
        present[0] = False if size == 3 else present[0]  # row 0 skips a chunk
        tracked.advance(present)
        if size == 6:
            tracked.select([2, 0, 0])  # beam search: row 0 twice
        if size == 1:
            for r, row in enumerate(tracked.session.rows):
                tracked.rollback(r, min(row.budget, 2 - r % 2))
    return tracked


def _stream(tokens: list[Token], name: str, axis: int) -> NDArray[np.float64]:
    """One row's tokens of input ``name`` stacked along the op's token axis, with batch 1."""
    return np.stack([t[name] for t in tokens], axis=axis - 1)[None]


def _worst(tracked: _Tracked, whole: Callable[[list[Token]], NDArray[np.float64]]) -> float:
    axis = tracked.session.TOKEN_AXIS
    errors = [0.0]
    for tokens, outs in zip(tracked.history, tracked.outputs, strict=True):
        if tokens:
            got = np.stack(outs, axis=axis - 1)[None]
            errors.append(relative_error(got, whole(tokens)))
    return max(errors)


def _fpa_draw(rng: np.random.Generator, HQ: int, H: int, d: int) -> Callable[..., Token]:
    def draw(R: int, n: int) -> Token:
        f = np.cumsum(rng.standard_normal((R, HQ, n)), axis=-1) + rng.standard_normal((R, HQ, 1))
        return {
            "q": rng.standard_normal((R, HQ, n, d)),
            "k": rng.standard_normal((R, H, n, d)),
            "v": rng.standard_normal((R, H, n, d)),
            "field": f,
            "level": f + rng.standard_normal((R, HQ, n)),
        }

    return draw


FPAFactory = Callable[..., sessions.Session]


def _fpa_session(
    rng: np.random.Generator,
    theta: float,
    window: int | None = None,
    factory: FPAFactory = sessions.FPASession,
) -> tuple[_Tracked, Callable[[list[Token]], Any]]:
    HQ, H, d = 4, 2, 8
    session = factory(
        3,
        heads=HQ,
        kv_heads=H,
        dk=d,
        dv=d,
        scale=1 / math.sqrt(d),
        theta=theta,
        window=window,
        max_rollback=2,
    )

    def inputs(tokens: list[Token]) -> dict[str, NDArray[np.float64]]:
        s = {name: _stream(tokens, name, 2) for name in ("q", "k", "v", "field", "level")}
        s["k"], s["v"] = (np.repeat(s[n], HQ // H, axis=1) for n in ("k", "v"))  # (F8 gqa)
        return s

    return _Tracked(session, _fpa_draw(rng, HQ, H, d)), inputs


@check("F8")
def sessions_equal_whole_streams(*, factory: FPAFactory = sessions.FPASession) -> CheckResult:
    rng = np.random.default_rng(81)
    table, worst = [], 0.0
    tracked, inputs = _fpa_session(rng, math.inf, factory=factory)
    error = _worst(_program(tracked, rng), lambda t: fpa.fpa_attention(**inputs(t)))
    table.append(f"theta = inf vs fpa_attention:      rel {error:.1e}")
    worst = max(worst, error)
    tracked, inputs = _fpa_session(rng, 1.5, factory=factory)
    _program(tracked, rng)
    error = _worst(tracked, lambda t: fpa.fpa_decode(**inputs(t), theta=1.5).o)
    mismatches = 0
    for r, tokens in enumerate(tracked.history):  # live keys: the (F7) cache size per head
        sizes = fpa.fpa_decode(**inputs(tokens), theta=1.5).cache_sizes[0, :, -1] if tokens else 0
        mismatches += int(np.sum(tracked.session.counts()["live"][r] != sizes))
    table.append(
        f"theta = 1.5 vs fpa_decode per row: rel {error:.1e}, live mismatches {mismatches}"
    )
    worst = max(worst, error, float(mismatches))
    return verdict(
        "F8",
        "a session (chunks, ragged rows, padding, GQA, select, rollback) gives each row the "
        "outputs of its whole stream: the parallel op for theta = inf, (F7) decode otherwise",
        "reference session vs fpa_attention / fpa_decode on each row's token history, HQ = 4, "
        "H = 2; measured = worst relative error (and live-count mismatches)",
        worst,
        1e-12,
        table=table,
    )


def _windowed_attention(inputs: dict[str, NDArray[np.float64]], W: int) -> NDArray[np.float64]:
    """(F3w) literally: a_ij = s <q_i, k_j> - pi_ij for i - W < j <= i, -inf elsewhere."""
    q, k, v, field_, level = (inputs[n][0] for n in ("q", "k", "v", "field", "level"))
    H, T, dk = q.shape
    o = np.zeros(v.shape)
    for h in range(H):
        for i in range(T):
            keys = range(max(0, i - W + 1), i + 1)
            logits = []
            for j in keys:
                m = min(field_[h, j + 1 : i + 1], default=math.inf)  # (F1) over (j, i]
                logits.append(q[h, i] @ k[h, j] / math.sqrt(dk) - max(0.0, level[h, j] - m))
            a = np.array(logits)
            o[h, i] = np.exp(a - logsumexp(a)) @ v[h, list(keys)]
    return o[None]


@check("F3w")
def window_session_equals_masked_parallel(
    *, factory: FPAFactory = sessions.FPASession
) -> CheckResult:
    rng = np.random.default_rng(83)
    tracked, inputs = _fpa_session(rng, math.inf, window=3, factory=factory)
    error = _worst(_program(tracked, rng), lambda t: _windowed_attention(inputs(t), 3))
    return verdict(
        "F3w",
        "a session with window W = 3 (theta = inf) equals the parallel op masked to i - W < j <= i",
        "reference session vs a literal loop over the window on each row's token history",
        error,
        1e-12,
    )


@check("F9")
def rollback_equals_replay(*, factory: FPAFactory = sessions.FPASession) -> CheckResult:
    rng = np.random.default_rng(89)
    worst, table = 0.0, []
    for theta in (1.0, math.inf):
        tracked, _ = _fpa_session(rng, theta, factory=factory)
        tracked.advance(np.ones((3, 9), dtype=bool))
        tracked.rollback(0, 2)
        tracked.rollback(1, 1)
        after = tracked.draw(3, 4)
        replay = sessions.FPASession(
            3, heads=4, kv_heads=2, dk=8, dv=8, scale=1 / math.sqrt(8), theta=theta
        )
        replay.advance(  # each row's history as one right-padded chunk
            {k: _padded(tracked.history, k, 9) for k in after}, _lengths_mask(tracked.history, 9)
        )
        got = tracked.session.advance(after, np.ones((3, 4), dtype=bool))["o"]
        expected = replay.advance(after, np.ones((3, 4), dtype=bool))["o"]
        counts = tracked.session.counts(), replay.counts()
        live_mismatch = int(np.sum(counts[0]["live"] != counts[1]["live"]))
        error = relative_error(got, expected)
        table.append(f"theta = {theta}: rel {error:.1e}, live mismatches {live_mismatch}")
        worst = max(worst, error, float(live_mismatch))
    return verdict(
        "F9",
        "rollback(r, n) leaves row r as if it had seen only its first t - n tokens",
        "a session of 9 tokens rolled back by 2 and 1 tokens, then 4 more, vs a fresh session "
        "fed 7, 8 and 9 tokens then the same 4; measured = worst relative error of the 4 outputs "
        "(and live-count mismatches)",
        worst,
        1e-12,
        table=table,
    )


def _padded(history: list[list[Token]], name: str, n: int) -> NDArray[np.float64]:
    """Each row's history of input ``name`` as one chunk of n positions (right padding)."""
    rows = []
    for tokens in history:
        x = np.stack([t[name] for t in tokens], axis=1)  # (heads, t, ...)
        pad = np.zeros((x.shape[0], n - x.shape[1], *x.shape[2:]))
        rows.append(np.concatenate([x, pad], axis=1))
    return np.stack(rows)


def _lengths_mask(history: list[list[Token]], n: int) -> NDArray[np.bool_]:
    return np.arange(n)[None, :] < np.array([len(t) for t in history])[:, None]


@check("I15")
def interdomain_sessions_equal_whole_streams(
    *, legs_factory: Callable[..., sessions.Session] = sessions.LegsSession
) -> CheckResult:
    rng = np.random.default_rng(115)
    H, M, R, dv = 2, 4, 3, 4
    lam = rng.uniform(0.6, 0.95, (H, M)) * np.exp(1j * rng.uniform(-0.5, 0.5, (H, M)))
    b = rng.standard_normal((H, M)) + 1j * rng.standard_normal((H, M))
    c = rng.standard_normal((H, M, M)) + 1j * rng.standard_normal((H, M, M))

    def features(names: tuple[str, str, str]) -> Callable[[int, int], Token]:
        def draw(rows: int, n: int) -> Token:
            return {
                names[0]: rng.uniform(0.1, 1, (rows, H, n, R)),
                names[1]: rng.uniform(0.1, 1, (rows, H, n, R)),
                names[2]: rng.standard_normal((rows, H, n, dv)),
            }

        return draw

    def layer_draw(rows: int, n: int) -> Token:
        return {"x": rng.standard_normal((rows, n, 16))}

    fpa_params = fpa.init_fpa_params(16, 2, 4, 4, 3)
    options: dict[str, Any] = {
        "readout": "ratio",
        "gate": True,
        "use_rope": True,
        "output_norm": True,
    }
    id_params = idm.init_interdomain_params(16, 2, 4, 4, 8, 5, gate=True)
    id_params["norm_k_b"] += 3.0  # positive k~: ratio denominators away from 0
    id_params["c_re"] += np.eye(8)
    s4d_names, legs_names = ("fq", "kt", "vt"), ("fq", "fk", "v")
    runs: list[tuple[str, sessions.Session, Callable[..., Token], Callable[..., Any]]] = [
        (
            "interdomain_s4d (ratio)",
            sessions.S4DSession(3, lam=lam, b=b, c=c, readout="ratio", max_rollback=2),
            features(s4d_names),
            lambda t: idm.interdomain_s4d(
                **{n: _stream(t, n, 2) for n in s4d_names}, lam=lam, b=b, c=c, readout="ratio"
            ),
        ),
        (
            "interdomain_legs",
            legs_factory(3, M=6, max_rollback=2),
            features(legs_names),
            lambda t: idm.interdomain_legs(**{n: _stream(t, n, 2) for n in legs_names}, M=6),
        ),
        (
            "fpa_layer (logsigmoid)",
            sessions.FPALayerSession(3, params=fpa_params, increments="logsigmoid", max_rollback=2),
            layer_draw,
            lambda t: fpa.fpa_layer(_stream(t, "x", 1), fpa_params, increments="logsigmoid"),
        ),
        (
            "interdomain_layer (ratio, gate, RoPE)",
            sessions.InterdomainLayerSession(3, params=id_params, **options, max_rollback=2),
            layer_draw,
            lambda t: idm.interdomain_layer(_stream(t, "x", 1), id_params, **options),
        ),
    ]
    table, worst = [], 0.0
    for name, session, draw, whole in runs:
        error = _worst(_program(_Tracked(session, draw), rng), whole)
        table.append(f"{name:<38} rel {error:.1e}")
        worst = max(worst, error)
    return verdict(
        "I15",
        "Interdomain and layer sessions (chunks, padding, select, rollback, the conv tail and "
        "RoPE positions of each row) give each row the outputs of the parallel op on its stream",
        "reference sessions vs interdomain_s4d, interdomain_legs, fpa_layer, interdomain_layer "
        "on each row's token history; measured = worst relative error",
        worst,
        1e-10,
        table=table,
    )

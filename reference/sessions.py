"""Decode sessions: what a batched server computes, by bookkeeping on the decode steps.

The executable statement of (F8 rows), (F8 gqa), (F9 rollback) and the decoding rule of (F3w) of
``docs/spec/fpa.md``, and of (I15 sessions) of ``docs/spec/interdomain.md``. The interface is
the session protocol of the conformance kit (docs/conformance.md, "Decode sessions"):

- ``advance(inputs, present)``: a chunk of n positions for every row; ``present[r, p]`` False
  marks a position that is not a token of row r (padding): it changes nothing and outputs 0.
- ``select(rows)``: keep the listed rows, in order, repetitions allowed (exact copies).
- ``rollback(row, n)``: row returns to its state after its first t - n tokens (F9).
- ``counts()``: tokens per row; for FPA also the keys live per (row, query head) and the
  entries stored per (row, kv head) under the union rule with the delay of (F9).

Every row holds an immutable per-row state (each step builds a new one), the states before its
last b tokens (b = the rollback budget, at most ``max_rollback``) and its token count. Rollback
restores one of those states: the snapshot form of (F9) and (I15) [decision: the reference keeps
W whole states; an implementation keeps the W last field values and the delayed minima instead,
which restore the same state]. FPA rows keep every entry with the step at which it was evicted
for each query head, so the stored count follows the rule below exactly; memory is not the
reference's concern.

Stored entries [decision, the kit compares them exactly]: an entry evicted at step t_e is stored
while t_e >= tokens - b (a rollback may still need it); live entries are always stored; per kv
head an entry is stored while it is stored for one of the G query heads of the group (union rule).

A call that raises (ValueError, naming the argument) leaves the session as it was.
Everything is float64 (complex128 for the S4D states).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import expit, logsumexp

from . import fpa
from . import interdomain as idm
from .hippo import legs_step
from .ops import OPS, session_contract, session_inputs
from .validation import (
    check_shape,
    nonnegative_int,
    positive_int,
    real_array,
    scalar,
    threshold,
)

Arrays = dict[str, NDArray[np.float64]]


@dataclass
class _Row:
    """One row (sequence): its state, its token count and the states before its last tokens."""

    state: Any
    tokens: int = 0
    past: list[Any] = field(default_factory=list)  # states before each of the last b tokens

    @property
    def budget(self) -> int:
        """b_r: how many tokens rollback may undo (F9)."""
        return len(self.past)

    def copy(self) -> _Row:
        # States are never modified in place, so sharing them is an exact copy.
        return _Row(self.state, self.tokens, list(self.past))


def _present_mask(present: ArrayLike, rows: int, n: int) -> NDArray[np.bool_]:
    mask = np.asarray(present)
    if mask.dtype != np.bool_:
        raise ValueError(f"present: expected a bool array (rows, n), got dtype {mask.dtype}")
    check_shape("present", mask, (rows, n), "rows of the session, positions of the chunk")
    return mask


def _chunk_arrays(inputs: Mapping[str, ArrayLike], names: tuple[str, ...]) -> Arrays:
    """The named float arrays of a chunk (n = 0 allowed, unlike the parallel ops)."""
    if not isinstance(inputs, Mapping) or set(inputs) != set(names):
        got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise ValueError(f"inputs: expected the arrays {list(names)}, got {got}")
    arrays = {}
    for name in names:
        x = np.asarray(inputs[name])
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"{name}: expected a real floating-point array, got dtype {x.dtype}")
        x = x.astype(np.float64)
        if not np.isfinite(x).all():
            raise ValueError(f"{name}: contains NaN or Inf")
        arrays[name] = x
    return arrays


class Session:
    """The bookkeeping common to every session: rows, present masks, select, rollback.

    Subclasses define the chunk layout (``NAMES``, ``TOKEN_AXIS``: the axis of the chunk's
    positions), ``_check_chunk`` and the per-token ``_step``.
    """

    NAMES: tuple[str, ...] = ()
    TOKEN_AXIS = 2  # (R, H, n, ...) for the ops; the layers' x is (R, n, d)

    def __init__(self, rows: int, max_rollback: int) -> None:
        self.max_rollback = nonnegative_int("max_rollback", max_rollback)
        self.rows = [_Row(None) for _ in range(positive_int("rows", rows))]

    # subclass interface

    def _check_chunk(self, arrays: Arrays) -> int:
        """Check the chunk's shapes against the session; return n."""
        raise NotImplementedError

    def _output_shape(self, arrays: Arrays, n: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, NDArray[np.float64]]:
        """One token of one row: (new state, output). Must not modify ``state``."""
        raise NotImplementedError

    def _commit_chunk(self, arrays: Arrays) -> None:
        """Remember what the first chunk fixed (dims read from the first advance)."""

    # protocol

    def advance(self, inputs: Mapping[str, ArrayLike], present: ArrayLike) -> Arrays:
        """(F8 rows) n consecutive steps of each row over its present positions.

        Returns the outputs (``"o"`` for the ops, ``"y"`` for the layers) in the chunk's layout;
        0 at absent positions.
        """
        arrays = _chunk_arrays(inputs, self.NAMES)
        n = self._check_chunk(arrays)
        mask = _present_mask(present, len(self.rows), n)
        out = np.zeros(self._output_shape(arrays, n))
        rows = [row.copy() for row in self.rows]  # committed only if every step succeeds
        for r, row in enumerate(rows):
            for p in np.flatnonzero(mask[r]):
                where: tuple[Any, ...] = (r, *[slice(None)] * (self.TOKEN_AXIS - 1), int(p))
                token = {name: x[where] for name, x in arrays.items()}
                row.past.append(row.state)
                row.state, out[where] = self._step(row.state, token, row.tokens)
                row.tokens += 1
            # (F9) the budget grows by the row's new tokens, capped at W
            del row.past[: max(0, row.budget - self.max_rollback)]
        self._commit_chunk(arrays)
        self.rows = rows
        return {self.OUTPUT: out}

    OUTPUT = "o"

    def select(self, rows: Sequence[int]) -> None:
        """(F9) keep the listed rows, in order; repetitions are exact copies (beam search)."""
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence | np.ndarray):
            raise ValueError(f"rows: expected a sequence of row indices, got {rows!r}")
        chosen = list(rows)
        if not chosen:
            raise ValueError("rows: expected at least one row index, got an empty sequence")
        R = len(self.rows)
        for i in chosen:
            if isinstance(i, bool) or not isinstance(i, int | np.integer) or not 0 <= i < R:
                raise ValueError(f"rows: expected indices in [0, {R}), got {rows!r}")
        self.rows = [self.rows[int(i)].copy() for i in chosen]

    def rollback(self, row: int, n: int) -> None:
        """(F9) row ``row`` returns to its state after its first t - n tokens.

        n > max_rollback (the W of F9) and n > the row's budget are ValueErrors.
        """
        R = len(self.rows)
        if isinstance(row, bool) or not isinstance(row, int | np.integer) or not 0 <= row < R:
            raise ValueError(f"row: expected a row index in [0, {R}), got {row!r}")
        n = nonnegative_int("n", n)
        if n > self.max_rollback:
            raise ValueError(
                f"max_rollback: rollback of n = {n} tokens exceeds the session's "
                f"max_rollback W = {self.max_rollback} (F9)"
            )
        target = self.rows[int(row)]
        if n > target.budget:
            raise ValueError(
                f"n: row {row} can undo only {target.budget} tokens now (its tokens since the "
                f"start or since the last rollback, at most W = {self.max_rollback}), got n = {n}"
            )
        if n == 0:
            return
        restored = _Row(target.past[-n], target.tokens - n, target.past[:-n])
        self.rows[int(row)] = restored

    def counts(self) -> dict[str, NDArray[np.int64]]:
        """``"tokens"`` (R,): the tokens of each row (t - n after a rollback)."""
        return {"tokens": np.array([row.tokens for row in self.rows], dtype=np.int64)}


# FPA


class FPACache(NamedTuple):
    """(F7) one row's cache, every entry since the row began (entry j = its token j).

    keys (n, H, dk), values (n, H, dv) per kv head; levels, mins (n, HQ) per query head;
    evicted (n, HQ) int64: the step at which the entry was evicted for that head, -1 while live.
    """

    keys: NDArray[np.float64]
    values: NDArray[np.float64]
    levels: NDArray[np.float64]
    mins: NDArray[np.float64]
    evicted: NDArray[np.int64]

    @classmethod
    def empty(cls, H: int, HQ: int, dk: int, dv: int) -> FPACache:
        return cls(
            np.zeros((0, H, dk)),
            np.zeros((0, H, dv)),
            np.zeros((0, HQ)),
            np.zeros((0, HQ)),
            np.zeros((0, HQ), dtype=np.int64),
        )


def fpa_cache_step(
    cache: FPACache,
    q: NDArray[np.float64],
    k: NDArray[np.float64],
    v: NDArray[np.float64],
    field: NDArray[np.float64],
    level: NDArray[np.float64],
    *,
    t: int,
    scale: float,
    theta: float,
    window: int | None,
) -> tuple[FPACache, NDArray[np.float64]]:
    """(F7) token t of one row, every query head at once; (F8 gqa) head h reads kv head h // G.

    Args:
        cache: the row's :class:`FPACache` after its first t tokens (not modified).
        q (HQ, dk), k (H, dk), v (H, dv): this token; field, level (HQ,): phi_t, l_t per head.
        window: (F3w) W >= 1 or None.

    Returns:
        (the cache after token t, o_t (HQ, dv)).
    """
    HQ, H = q.shape[0], k.shape[0]
    live = cache.evicted < 0  # (n, HQ)
    mins = np.where(live, np.minimum(cache.mins, field), cache.mins)  # (F7) m_j <- min(m_j, phi_t)
    depth = np.maximum(0.0, cache.levels - mins)  # (F2)
    age = t - np.arange(len(mins))[:, None]  # t - j
    too_old = age >= window if window is not None else np.zeros_like(live)
    drop = live & ((depth >= theta) | too_old)  # (F7) evict when pi_j >= theta; (F3w) window
    evicted = np.where(drop, t, cache.evicted)
    cache = FPACache(
        np.concatenate([cache.keys, k[None]]),
        np.concatenate([cache.values, v[None]]),
        np.concatenate([cache.levels, level[None]]),
        np.concatenate([mins, np.full((1, HQ), np.inf)]),  # empty segment: pi_tt = 0
        np.concatenate([evicted, np.full((1, HQ), -1)]),
    )
    depth = np.concatenate([depth, np.zeros((1, HQ))])
    o = np.zeros((HQ, v.shape[-1]))
    for h in range(HQ):
        g = h // (HQ // H)  # (F8 gqa) the kv head of query head h
        attended = cache.evicted[:, h] < 0
        logits = scale * (cache.keys[attended, g] @ q[h]) - depth[attended, h]  # (F3)
        weights = np.exp(logits - logsumexp(logits))  # (F4)
        o[h] = weights @ cache.values[attended, g]  # (F5)
    return cache, o


def fpa_live_and_stored(
    cache: FPACache | None, tokens: int, budget: int, kv_heads: int, heads: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Live keys per query head (HQ,) and stored entries per kv head (H,) of one row.

    (F8 gqa) union rule with the delay of (F9): an entry evicted at step t_e is stored for its
    query head while t_e >= tokens - budget; per kv head, while stored for one of its heads.
    """
    if cache is None:
        return np.zeros(heads, dtype=np.int64), np.zeros(kv_heads, dtype=np.int64)
    live = cache.evicted < 0  # (n, HQ)
    kept = live | (cache.evicted >= tokens - budget)
    by_group = kept.reshape(len(kept), kv_heads, heads // kv_heads).any(axis=-1)  # (n, H)
    return live.sum(axis=0).astype(np.int64), by_group.sum(axis=0).astype(np.int64)


def _theta_window(theta: float, window: int | None) -> tuple[float, int | None]:
    theta = threshold("theta", theta)
    return theta, None if window is None else positive_int("window", window)


class FPASession(Session):
    """(F8 rows), (F8 gqa), (F9 rollback), (F3w) sessions of :func:`attnspec.reference.fpa`'s
    (F7) decode.

    Args:
        rows: R >= 1. heads: HQ query heads; kv_heads: H, dividing HQ. dk, dv: widths.
        scale: the softmax scale s. theta: eviction threshold > 0 (inf keeps every key).
        window: (F3w) W >= 1 or None. max_rollback: the delay W of (F9), >= 0.

    advance takes q (R, HQ, n, dk), k (R, H, n, dk), v (R, H, n, dv), field, level (R, HQ, n)
    and returns {"o": (R, HQ, n, dv)}. Cost per token: O(HQ C (dk + dv)) for C entries so far.
    """

    NAMES = session_inputs("fpa_decode")

    def __init__(
        self,
        rows: int,
        *,
        heads: int,
        kv_heads: int,
        dk: int,
        dv: int,
        scale: float,
        theta: float = math.inf,
        window: int | None = None,
        max_rollback: int = 0,
    ) -> None:
        super().__init__(rows, max_rollback)
        self.heads = positive_int("heads", heads)
        self.kv_heads = positive_int("kv_heads", kv_heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {kv_heads} does not divide heads = {heads}")
        self.dk, self.dv = positive_int("dk", dk), positive_int("dv", dv)
        self.scale = scalar("scale", scale)
        self.theta, self.window = _theta_window(theta, window)

    def _check_chunk(self, arrays: Arrays) -> int:
        R, HQ, H = len(self.rows), self.heads, self.kv_heads
        n = arrays["q"].shape[2] if arrays["q"].ndim == 4 else -1
        expected = {
            "q": (R, HQ, n, self.dk),
            "k": (R, H, n, self.dk),
            "v": (R, H, n, self.dv),
            **{name: (R, HQ, n) for name in self.NAMES[3:]},  # field, level (FoX: log_f)
        }
        for name, shape in expected.items():
            check_shape(name, arrays[name], shape, "(rows, heads, n, ...) of the session")
        return n

    def _output_shape(self, arrays: Arrays, n: int) -> tuple[int, ...]:
        return (len(self.rows), self.heads, n, self.dv)

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, NDArray[np.float64]]:
        if state is None:
            state = FPACache.empty(self.kv_heads, self.heads, self.dk, self.dv)
        return fpa_cache_step(
            state,
            token["q"],
            token["k"],
            token["v"],
            token["field"],
            token["level"],
            t=t,
            scale=self.scale,
            theta=self.theta,
            window=self.window,
        )

    def counts(self) -> dict[str, NDArray[np.int64]]:
        """tokens (R,), live (R, HQ), stored (R, H)."""
        pairs = [
            fpa_live_and_stored(row.state, row.tokens, row.budget, self.kv_heads, self.heads)
            for row in self.rows
        ]
        return {
            **super().counts(),
            "live": np.stack([live for live, _ in pairs]),
            "stored": np.stack([stored for _, stored in pairs]),
        }


class FoxState(NamedTuple):
    """One row of a FoX session: c_t = sum of the row's log f so far (HQ,), and the (F7) cache
    with field = level = c."""

    c: NDArray[np.float64]
    cache: FPACache


class FoxSession(FPASession):
    """Sessions of :func:`attnspec.reference.fpa.fox_attention`: (F6) FoX as FPA with
    field = level = c = cumsum(log f), c summed over the row's own tokens (padding adds nothing).

    Args: as :class:`FPASession` without theta (a FoX key is never evicted by depth: theta = inf).

    advance takes q (R, HQ, n, dk), k (R, H, n, dk), v (R, H, n, dv), log_f (R, HQ, n) (all
    <= 0) and returns {"o": (R, HQ, n, dv)}; counts as :class:`FPASession`'s.
    """

    NAMES = session_inputs("fox_attention")

    def __init__(
        self,
        rows: int,
        *,
        heads: int,
        kv_heads: int,
        dk: int,
        dv: int,
        scale: float,
        window: int | None = None,
        max_rollback: int = 0,
    ) -> None:
        super().__init__(
            rows,
            heads=heads,
            kv_heads=kv_heads,
            dk=dk,
            dv=dv,
            scale=scale,
            window=window,
            max_rollback=max_rollback,
        )

    def _check_chunk(self, arrays: Arrays) -> int:
        n = super()._check_chunk(arrays)
        if (arrays["log_f"] > 0).any():
            raise ValueError("log_f: expected log forget gates <= 0")
        return n

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, NDArray[np.float64]]:
        if state is None:
            state = FoxState(
                np.zeros(self.heads), FPACache.empty(self.kv_heads, self.heads, self.dk, self.dv)
            )
        c = state.c + token["log_f"]  # (F6) c_t = c_{t-1} + log f_t
        cache, o = super()._step(state.cache, {**token, "field": c, "level": c}, t)
        return FoxState(c, cache), o

    def counts(self) -> dict[str, NDArray[np.int64]]:
        """tokens (R,), live (R, HQ), stored (R, H)."""
        pairs = [
            fpa_live_and_stored(
                None if row.state is None else row.state.cache,
                row.tokens,
                row.budget,
                self.kv_heads,
                self.heads,
            )
            for row in self.rows
        ]
        return {
            **Session.counts(self),
            "live": np.stack([live for live, _ in pairs]),
            "stored": np.stack([stored for _, stored in pairs]),
        }


class FPALayerState(NamedTuple):
    """One row of the FPA layer: the field so far phi_{t-1} (H,) and the (F7) cache."""

    field: NDArray[np.float64]
    cache: FPACache


class FPALayerSession(Session):
    """Sessions of :func:`attnspec.reference.fpa.fpa_layer` (F8 rows on the layer).

    Args:
        rows: R. params: the layer's weights (FPA_PARAMETER_SCHEMA). increments: "signed" or
        "logsigmoid". theta, window, max_rollback: as for :class:`FPASession`.

    advance takes x (R, n, d), returns {"y": (R, n, d)}; the field is the running sum of the
    row's increments (sec. 3), levels phi_t + lam_t; H heads, no GQA; scale 1/sqrt(dk).
    """

    NAMES = session_inputs("fpa_layer")
    TOKEN_AXIS = session_contract("fpa_layer").token_axis
    OUTPUT = session_contract("fpa_layer").output

    def __init__(
        self,
        rows: int,
        *,
        params: Mapping[str, ArrayLike],
        increments: str = "signed",
        theta: float = math.inf,
        window: int | None = None,
        max_rollback: int = 0,
    ) -> None:
        super().__init__(rows, max_rollback)
        missing = sorted(set(fpa.FPA_PARAMETER_SCHEMA) - set(params))
        if missing:
            raise ValueError(f"params: missing {missing}; see FPA_PARAMETER_SCHEMA")
        P = {name: real_array(f"params[{name!r}]", params[name]) for name in params}
        if increments not in ("signed", "logsigmoid"):
            raise ValueError(f"increments: expected 'signed' or 'logsigmoid', got {increments!r}")
        self.d = P["wq"].shape[0]
        self.H = P["b_delta"].shape[0]
        self.dk, self.dv = P["wq"].shape[1] // self.H, P["wv"].shape[1] // self.H
        for name, shape in fpa.fpa_parameter_shapes(self.d, self.H, self.dk, self.dv).items():
            check_shape(f"params[{name!r}]", P[name], shape, fpa.FPA_PARAMETER_SCHEMA[name])
        self.P, self.increments = P, increments
        self.theta, self.window = _theta_window(theta, window)

    def _check_chunk(self, arrays: Arrays) -> int:
        x = arrays["x"]
        n = x.shape[1] if x.ndim == 3 else -1
        check_shape("x", x, (len(self.rows), n, self.d), "(rows, n, d) of the session")
        return n

    def _output_shape(self, arrays: Arrays, n: int) -> tuple[int, ...]:
        return (len(self.rows), n, self.d)

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, NDArray[np.float64]]:
        P, H, x = self.P, self.H, token["x"]  # x (d,)
        if state is None:
            state = FPALayerState(np.zeros(H), FPACache.empty(H, H, self.dk, self.dv))
        delta = x @ P["w_delta"] + P["b_delta"]  # (H,)
        if self.increments == "logsigmoid":
            delta = -np.logaddexp(0.0, -delta)
        field = state.field + delta  # phi = cumsum(delta), one term at a time
        level = field + x @ P["w_lam"] + P["b_lam"]  # l_j = phi_j + lam_j
        cache, o = fpa_cache_step(
            state.cache,
            (x @ P["wq"]).reshape(H, self.dk),
            (x @ P["wk"]).reshape(H, self.dk),
            (x @ P["wv"]).reshape(H, self.dv),
            field,
            level,
            t=t,
            scale=1.0 / np.sqrt(self.dk),
            theta=self.theta,
            window=self.window,
        )
        return FPALayerState(field, cache), o.reshape(H * self.dv) @ P["wo"]

    def counts(self) -> dict[str, NDArray[np.int64]]:
        """tokens (R,), live (R, H), stored (R, H)."""
        pairs = [
            fpa_live_and_stored(
                None if row.state is None else row.state.cache,
                row.tokens,
                row.budget,
                self.H,
                self.H,
            )
            for row in self.rows
        ]
        return {
            **super().counts(),
            "live": np.stack([live for live, _ in pairs]),
            "stored": np.stack([stored for _, stored in pairs]),
        }


# Interdomain


class S4DSession(Session):
    """(I15) sessions of :func:`attnspec.reference.interdomain.interdomain_s4d`: each row its own
    :class:`~attnspec.reference.interdomain.InterdomainDecoder` state x (H, M, C).

    Args:
        rows: R. lam, b (H, M) complex, |lam| <= 1; c (H, M, M) complex. readout: "linear" or
        "ratio". max_rollback: W.

    advance takes fq, kt (R, H, n, R_f), vt (R, H, n, dv) (widths fixed by the first advance)
    and returns {"o": (R, H, n, dv)}. Cost per token: O(H M^2 (R_f + dv)).
    """

    NAMES = session_inputs("interdomain_s4d")

    def __init__(
        self,
        rows: int,
        *,
        lam: ArrayLike,
        b: ArrayLike,
        c: ArrayLike,
        readout: str = "linear",
        max_rollback: int = 0,
    ) -> None:
        super().__init__(rows, max_rollback)
        self.prototype = idm.InterdomainDecoder(lam, b, c, readout=readout)  # validates
        self.H = self.prototype.lam.shape[0]
        self.widths: tuple[int, int] | None = None  # (R_f, dv), from the first advance

    def _check_chunk(self, arrays: Arrays) -> int:
        fq = arrays["fq"]
        if fq.ndim != 4 or fq.shape[:2] != (len(self.rows), self.H):
            raise ValueError(
                f"fq: expected shape ({len(self.rows)}, {self.H}, n, R), got {fq.shape}"
            )
        n = fq.shape[2]
        dv = arrays["vt"].shape[-1] if arrays["vt"].ndim == 4 else -1
        if self.widths is not None:
            check_shape("fq", fq, (*fq.shape[:3], self.widths[0]), "R of the first advance")
            dv = self.widths[1]
        check_shape("kt", arrays["kt"], fq.shape, "same as fq")
        check_shape("vt", arrays["vt"], (*fq.shape[:3], dv), "(rows, heads, n, dv)")
        return int(n)

    def _commit_chunk(self, arrays: Arrays) -> None:
        self.widths = (arrays["fq"].shape[-1], arrays["vt"].shape[-1])

    def _output_shape(self, arrays: Arrays, n: int) -> tuple[int, ...]:
        return (len(self.rows), self.H, n, arrays["vt"].shape[-1])

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, NDArray[np.float64]]:
        decoder = copy.copy(self.prototype if state is None else state)  # step replaces x
        o = decoder.step(token["fq"], token["kt"], token["vt"])  # (I11)-(I13), (H, dv)
        return decoder, o


class LegsSession(Session):
    """(I15) sessions of :func:`attnspec.reference.interdomain.interdomain_legs`: each row its
    LegS coefficients c_t (H, M, R_f + dv + 1) of [xi(k), v, 1] (I2)/(I5) and its step counter t.

    Args:
        rows: R. M: modes. max_rollback: W. Heads and widths are fixed by the first advance.

    advance takes fq, fk (R, H, n, R_f), v (R, H, n, dv) and returns {"o": (R, H, n, dv)}, the
    ratio readout (I3) after each token. Cost per token: O(H M^2 (R_f + dv)) (steps cached).
    """

    NAMES = session_inputs("interdomain_legs")

    def __init__(self, rows: int, *, M: int, max_rollback: int = 0) -> None:
        super().__init__(rows, max_rollback)
        self.M = positive_int("M", M)
        self.widths: tuple[int, int, int] | None = None  # (H, R_f, dv), from the first advance

    def _check_chunk(self, arrays: Arrays) -> int:
        fq, v = arrays["fq"], arrays["v"]
        if fq.ndim != 4 or fq.shape[0] != len(self.rows):
            raise ValueError(f"fq: expected shape ({len(self.rows)}, H, n, R), got {fq.shape}")
        if self.widths is not None:
            H, Rf, dv = self.widths
            check_shape("fq", fq, (len(self.rows), H, fq.shape[2], Rf), "H, R of the first advance")
        else:
            dv = v.shape[-1] if v.ndim == 4 else -1
        check_shape("fk", arrays["fk"], fq.shape, "same as fq")
        check_shape("v", v, (*fq.shape[:3], dv), "(rows, heads, n, dv)")
        return int(fq.shape[2])

    def _commit_chunk(self, arrays: Arrays) -> None:
        self.widths = (*arrays["fq"].shape[1:2], arrays["fq"].shape[3], arrays["v"].shape[3])

    def _output_shape(self, arrays: Arrays, n: int) -> tuple[int, ...]:
        return arrays["v"].shape

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, NDArray[np.float64]]:
        fq, fk, v = token["fq"], token["fk"], token["v"]  # (H, R_f), (H, R_f), (H, dv)
        H, Rf = fk.shape
        z = np.concatenate([fk, v, np.ones((H, 1))], axis=-1)  # (I2) [xi(k), v, 1]
        if state is None:
            state = np.zeros((H, self.M, z.shape[-1]))
        E, F = legs_step(t + 1, self.M)  # token t is the (t+1)-th of the row
        c = E @ state + F[:, None] * z[:, None, :]  # (I5) c_n = E_n c_{n-1} + F_n f_n
        coeffs = idm.Coefficients(c[:, None, :, :Rf], c[:, None, :, Rf:-1], c[:, None, :, -1])
        o = idm.ratio_readout(fq[:, None], coeffs)[:, 0]  # (I3) (H, dv)
        return c, o


class InterdomainLayerState(NamedTuple):
    """One row of the Interdomain layer: the short-convolution tails (the last K - 1 = 3
    projections of q and k, (<= 3, H R) each, (I15)) and the S4D decoder."""

    tail_q: NDArray[np.float64]
    tail_k: NDArray[np.float64]
    decoder: idm.InterdomainDecoder


class InterdomainLayerSession(Session):
    """(I15) sessions of :func:`attnspec.reference.interdomain.interdomain_layer`.

    Args:
        rows: R. params: the layer's weights (PARAMETER_SCHEMA). readout, gate, use_rope,
        output_norm: the layer's options. max_rollback: W.

    advance takes x (R, n, d), returns {"y": (R, n, d)}. The row's state is the conv tail, its
    position t (for RoPE) and the S4D state. Cost per token: O(d H (R + dv) + H M^2 (R + dv)),
    plus O(t H R) for RoPE at position t.
    """

    NAMES = session_inputs("interdomain_layer")
    TOKEN_AXIS = session_contract("interdomain_layer").token_axis
    OUTPUT = session_contract("interdomain_layer").output
    TAIL = 3  # K - 1 for the layer's convolutions of width K = 4 (I8)

    def __init__(
        self,
        rows: int,
        *,
        params: Mapping[str, ArrayLike],
        readout: str = "linear",
        gate: bool = False,
        use_rope: bool = False,
        output_norm: bool = True,
        max_rollback: int = 0,
    ) -> None:
        super().__init__(rows, max_rollback)
        P = {name: real_array(f"params[{name!r}]", params[name]) for name in params}
        flags = {"gate": gate, "output_norm": output_norm}
        optional = {name for name, flag in idm.OPTIONAL_PARAMETERS.items() if not flags[flag]}
        missing = sorted(set(idm.PARAMETER_SCHEMA) - optional - set(P))
        if missing:
            raise ValueError(f"params: missing {missing}; see PARAMETER_SCHEMA")
        self.H, self.R = P["norm_k_g"].shape
        self.dv, self.M, self.d = P["norm_v_g"].shape[1], P["a_log"].shape[1], P["wq"].shape[0]
        shapes = idm.interdomain_parameter_shapes(
            self.d, self.H, self.R, self.dv, self.M, output_norm=output_norm, gate=gate
        )
        for name, shape in shapes.items():
            check_shape(f"params[{name!r}]", P[name], shape, idm.PARAMETER_SCHEMA[name])
        lam = idm.s4d_lambda(P["log_dt"], P["a_log"], P["a_im"])
        b_bar = idm.s4d_b_bar(P["log_dt"], P["a_log"], P["a_im"], P["b_re"] + 1j * P["b_im"])
        c = P["c_re"] + 1j * P["c_im"]
        self.prototype = idm.InterdomainDecoder(lam, b_bar, c, readout=readout)  # (I11)
        self.P, self.gate, self.use_rope, self.output_norm = P, gate, use_rope, output_norm

    def _check_chunk(self, arrays: Arrays) -> int:
        x = arrays["x"]
        n = x.shape[1] if x.ndim == 3 else -1
        check_shape("x", x, (len(self.rows), n, self.d), "(rows, n, d) of the session")
        return n

    def _output_shape(self, arrays: Arrays, n: int) -> tuple[int, ...]:
        return (len(self.rows), n, self.d)

    def _rope_at(self, x: NDArray[np.float64], t: int) -> NDArray[np.float64]:
        """RoPE of one position t: x (H, R) placed at row t of an otherwise zero sequence."""
        sequence = np.zeros((self.H, t + 1, self.R))
        sequence[:, t] = x
        return idm.rope(sequence)[:, t]

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, NDArray[np.float64]]:
        P, H, R, dv, x = self.P, self.H, self.R, self.dv, token["x"]  # x (d,)
        if state is None:
            empty = np.zeros((0, H * R))
            state = InterdomainLayerState(empty, empty, copy.copy(self.prototype))
        window_q = np.concatenate([state.tail_q, (x @ P["wq"])[None]])  # (<= 4, H R)
        window_k = np.concatenate([state.tail_k, (x @ P["wk"])[None]])
        q = idm.short_conv(window_q, P["conv_q"])[-1].reshape(H, R)  # (I8) at position t
        k = idm.short_conv(window_k, P["conv_k"])[-1].reshape(H, R)
        v = (x @ P["wv"]).reshape(H, dv)
        if self.use_rope:
            q, k = self._rope_at(q, t), self._rope_at(k, t)
        fq, fk = idm.feature_map(q), idm.feature_map(k)  # (I9)
        kt = idm.rms_norm(fk, np.ones(R)) * P["norm_k_g"] + P["norm_k_b"]  # (I10)
        vt = idm.rms_norm(v, np.ones(dv)) * P["norm_v_g"] + P["norm_v_b"]
        decoder = copy.copy(state.decoder)  # step replaces its state, never modifies it
        o = decoder.step(fq, kt, vt)  # (I11)-(I13) (H, dv)
        if self.output_norm:
            o = idm.rms_norm(o, np.ones(dv)) * P["norm_o_g"]  # (I14)
        o = o.reshape(H * dv)
        if self.gate:
            g = x @ P["wg"]
            o = g * expit(g) * o  # SiLU(W_g x) * o
        tails = window_q[-self.TAIL :], window_k[-self.TAIL :]
        return InterdomainLayerState(*tails, decoder), o @ P["wo"]


SESSION_OPS = tuple(op for op, spec in OPS.items() if spec.session is not None)


def open_session(op: str, *, rows: int, config: Mapping[str, Any]) -> Session:
    """The reference session of ``op`` with the protocol's config (float64 arrays inside).

    config keys per op (``session_contract(op)`` of reference/ops.py; docs/conformance.md,
    "Decode sessions"):
      fpa_decode: heads, kv_heads, dk, dv, scale, theta, window, max_rollback.
      fox_attention: heads, kv_heads, dk, dv, scale, window, max_rollback (FoX decode: inputs
        q, k, v, log_f).
      interdomain_s4d: lam_re, lam_im, b_re, b_im (H, M), c_re, c_im (H, M, M), max_rollback;
        optionally readout (default "linear").
      interdomain_legs: M, max_rollback.
      fpa_layer: params, increments, theta, window, max_rollback.
      interdomain_layer: params, readout, gate, use_rope, output_norm, max_rollback (the options
        may also come as one dict under "options").
    """
    config = dict(config)
    if isinstance(config.get("options"), Mapping):
        config.update(config.pop("options"))
    allowed = {op: set(session_contract(op).keys) - {"max_rollback"} for op in SESSION_OPS}
    if op not in allowed:
        raise ValueError(f"op: expected one of {list(SESSION_OPS)}, got {op!r}")
    unknown = sorted(set(config) - allowed[op] - {"max_rollback"})
    if unknown:
        raise ValueError(f"config: unknown keys {unknown} for {op}; expected {sorted(allowed[op])}")
    max_rollback = config.pop("max_rollback", 0)
    if op == "fpa_decode":
        return FPASession(rows, max_rollback=max_rollback, **config)
    if op == "fox_attention":
        return FoxSession(rows, max_rollback=max_rollback, **config)
    if op == "interdomain_s4d":
        for name in ("lam", "b", "c"):
            config[name] = np.asarray(config.pop(f"{name}_re")) + 1j * np.asarray(
                config.pop(f"{name}_im")
            )
        return S4DSession(rows, max_rollback=max_rollback, **config)
    if op == "interdomain_legs":
        return LegsSession(rows, max_rollback=max_rollback, **config)
    if op == "fpa_layer":
        return FPALayerSession(rows, max_rollback=max_rollback, **config)
    return InterdomainLayerSession(rows, max_rollback=max_rollback, **config)

"""Deliberately wrong decode sessions: the kit's self-test for the session families.

Each mutant is the numpy adapter with one session error, written the way a serving
implementation goes wrong, and names the session family written to catch it (``family``) and
the other families that catch it too (``also``, where the error cannot help showing there).
``tests/test_sessions.py`` asserts that the first case of ``family`` fails, and that every other
family of the op but those in ``also`` passes. Select one with
``attnspec conformance --backend attnspec.conformance.session_mutants:PaddingUpdatesMinima``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from attnspec.reference import sessions as ref

from . import session_programs
from .numpy_backend import NumpyBackend, NumpySession

Arrays = dict[str, NDArray[np.float64]]


class _Loop:
    """The reference's advance loop with hooks for the mutants (a copy, so the reference stays
    plain): ``_absent`` for a padding position, ``_step_at`` with the chunk position p."""

    rows: list[ref._Row]
    max_rollback: int
    _start = 0  # the row's tokens before the chunk

    def _absent(self, state: Any, token: Arrays, t: int) -> Any:
        return state

    def _step_at(self, state: Any, token: Arrays, t: int, p: int) -> tuple[Any, Any]:
        return self._step(state, token, t)  # type: ignore[attr-defined]  # the Session's

    def advance(self, inputs: Mapping[str, ArrayLike], present: ArrayLike) -> Arrays:
        session: Any = self
        arrays = ref._chunk_arrays(inputs, session.NAMES)
        n = session._check_chunk(arrays)
        mask = ref._present_mask(present, len(self.rows), n)
        out = np.zeros(session._output_shape(arrays, n))
        rows = [row.copy() for row in self.rows]
        for r, row in enumerate(rows):
            self._start = row.tokens
            for p in range(n):
                where: tuple[Any, ...] = (r, *[slice(None)] * (session.TOKEN_AXIS - 1), p)
                token = {name: x[where] for name, x in arrays.items()}
                if not mask[r, p]:
                    row.state = self._absent(row.state, token, row.tokens)
                    continue
                row.past.append(row.state)
                row.state, out[where] = self._step_at(row.state, token, row.tokens, p)
                row.tokens += 1
            del row.past[: max(0, row.budget - self.max_rollback)]
        session._commit_chunk(arrays)
        self.rows = rows
        return {session.OUTPUT: out}


class SessionMutant(NumpyBackend):
    """The numpy adapter with one wrong session class; claims that op (and its session) only."""

    op: ClassVar[str] = "fpa_decode"
    family: ClassVar[str] = ""
    also: ClassVar[tuple[str, ...]] = ()
    wrong: ClassVar[type[ref.Session]] = ref.FPASession
    OPS: ClassVar[tuple[str, ...]] = ()
    FEATURES: ClassVar[tuple[str, ...]] = ()

    def capabilities(self) -> set[str]:
        return {self.op, f"{self.op}.session"}

    def open_session(
        self, op: str, *, rows: int, dtype: str, config: Mapping[str, Any]
    ) -> NumpySession:
        if op != self.op:
            raise ValueError(f"op: this mutant has a session for {self.op!r} only")
        session = ref.open_session(op, rows=rows, config=config)
        session.__class__ = self.wrong  # the same state, the wrong methods
        return NumpySession(session, np.dtype(dtype))


# wrong sessions


class _PaddingUpdatesMinima(_Loop, ref.FPASession):
    """A padding position's field enters the running minima of the live keys."""

    def _absent(self, state: Any, token: Arrays, t: int) -> Any:
        if state is None:
            return state
        live = state.evicted < 0
        return state._replace(
            mins=np.where(live, np.minimum(state.mins, token["field"]), state.mins)
        )


class _IdleRowReset(ref.FPASession):
    """A row with no token in a chunk is taken as finished and its state freed."""

    def advance(self, inputs: Mapping[str, ArrayLike], present: ArrayLike) -> Arrays:
        out = super().advance(inputs, present)
        mask = np.asarray(present)
        for r in range(len(self.rows)):
            if mask.shape[1] and not mask[r].any():
                self.rows[r] = ref._Row(None)  # "no token: the sequence is finished", freed
        return out


class _FreedByFirstHead(ref.FPASession):
    """A GQA entry freed once any query head of its group evicts it, not all."""

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, Any]:
        cache, o = super()._step(state, token, t)
        G = self.heads // self.kv_heads
        groups = cache.evicted.reshape(len(cache.evicted), self.kv_heads, G)
        gone = np.where(groups >= 0, groups, np.iinfo(np.int64).max).min(axis=-1, keepdims=True)
        freed = np.where((groups >= 0).any(axis=-1, keepdims=True), gone, -1)
        evicted = np.broadcast_to(freed, groups.shape).reshape(cache.evicted.shape)
        return cache._replace(evicted=evicted.copy()), o  # freed once one head of G evicts it


class _StrictAtTheta(ref.FPASession):
    """Evicts only when the depth exceeds theta, not when it reaches it."""

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, Any]:
        theta, self.theta = self.theta, float(np.nextafter(self.theta, math.inf))
        try:
            return super()._step(state, token, t)  # evicts only when pi > theta
        finally:
            self.theta = theta


class _CurrentFieldDepth(ref.FPASession):
    """At theta = inf the depth is taken against the current field, not the minimum."""

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, Any]:
        if state is not None and math.isinf(self.theta):
            # "nothing is evicted, so the running minimum is not needed": pi = l_j - phi_t
            state = state._replace(mins=np.where(state.evicted < 0, np.inf, state.mins))
        return super()._step(state, token, t)


class _WindowOffByOne(ref.FPASession):
    """The window keeps W + 1 keys."""

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, Any]:
        window, self.window = self.window, None if self.window is None else self.window + 1
        try:
            return super()._step(state, token, t)  # keeps W + 1 keys: t - j > W evicts
        finally:
            self.window = window


class _AliasingSelect(ref.FPASession):
    """select's copies of a row share its storage."""

    aliases: list[int]

    def select(self, rows: Sequence[int]) -> None:
        super().select(rows)
        self.aliases = [int(i) for i in rows]  # copies share their storage

    def advance(self, inputs: Mapping[str, ArrayLike], present: ArrayLike) -> Arrays:
        out = super().advance(inputs, present)
        aliases = getattr(self, "aliases", list(range(len(self.rows))))
        for r, source in enumerate(aliases):
            last = max(i for i, s in enumerate(aliases) if s == source)
            self.rows[r] = self.rows[last].copy()  # the last write to the shared row wins
        return out


class _MinimaNotRestored(ref.FPASession):
    """A rollback restores the keys but not their running minima."""

    def rollback(self, row: int, n: int) -> None:
        current = self.rows[row].state if 0 <= row < len(self.rows) else None
        super().rollback(row, n)
        restored = self.rows[row]
        if current is not None and restored.state is not None and n:
            kept = len(restored.state.mins)
            restored.state = restored.state._replace(mins=current.mins[:kept])


class _PartialRollback(ref.FPASession):
    """A rollback past the budget goes as far as it can instead of raising."""

    def rollback(self, row: int, n: int) -> None:
        if isinstance(n, int) and 0 <= row < len(self.rows) and n <= self.max_rollback:
            n = min(n, self.rows[row].budget)  # as far as it can, silently
        super().rollback(row, n)


class _ChangedByFailedCall(_Loop, ref.FPASession):
    """A call with a bad mask advances the session before raising."""

    def advance(self, inputs: Mapping[str, ArrayLike], present: ArrayLike) -> Arrays:
        mask = np.asarray(present)
        n = np.asarray(inputs["q"]).shape[2] if "q" in inputs else 0
        if mask.dtype == np.bool_ and mask.shape[0] == len(self.rows) and mask.shape[1] > n:
            super().advance(inputs, mask[:, :n])  # steps first, checks the mask after
            raise ValueError(f"present: expected shape ({len(self.rows)}, {n}), got {mask.shape}")
        return super().advance(inputs, present)


class _Capacity128(ref.FPASession):
    """A ring buffer of 128 entries per head: the oldest live key is dropped."""

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, Any]:
        if state is not None:
            live = state.evicted < 0
            over = np.cumsum(live[::-1], axis=0)[::-1] > 127  # all but the newest 127 live
            state = state._replace(evicted=np.where(live & over, t, state.evicted))
        return super()._step(state, token, t)  # a ring buffer of 128 entries per head


class _PrefillBlockBorder(_Loop, ref.FPASession):
    """A prefill in blocks of 8 whose first block misses later tokens' fields."""

    BLOCK = 8

    def _step_at(self, state: Any, token: Arrays, t: int, p: int) -> tuple[Any, Any]:
        if state is None or p < self.BLOCK:
            return self._step(state, token, t)
        first = t - p  # the chunk's first token: its first block misses this token's field
        block = slice(first, first + self.BLOCK)
        new, o = self._step(state, token, t)
        mins = new.mins.copy()
        mins[block] = state.mins[block]
        return new._replace(mins=mins), o


class _EmptyChunkRejected(ref.FPASession):
    """A chunk of zero tokens is rejected."""

    def advance(self, inputs: Mapping[str, ArrayLike], present: ArrayLike) -> Arrays:
        if "q" in inputs and np.asarray(inputs["q"]).shape[2:3] == (0,):
            raise ValueError("q: expected every axis to have length >= 1")  # the op's check
        return super().advance(inputs, present)


class _LegsChunkCounter(_Loop, ref.LegsSession):
    """The LegS step counts chunk positions, padding included, not the row's tokens."""

    def _step_at(self, state: Any, token: Arrays, t: int, p: int) -> tuple[Any, Any]:
        return self._step(state, token, self._start + p)  # the chunk position, not the token's


class _S4DPaddingAdvances(_Loop, ref.S4DSession):
    """A padding position advances the S4D state (it decays)."""

    def _absent(self, state: Any, token: Arrays, t: int) -> Any:
        zero = {k: np.zeros_like(v) for k, v in token.items()}
        decoder, _ = self._step(state, zero, t)  # x <- Lambda x (+ b 0): the state decays
        return decoder


class _LayerFieldCountsPadding(_Loop, ref.FPALayerSession):
    """The layer's field takes the increment of padding positions too."""

    def _absent(self, state: Any, token: Arrays, t: int) -> Any:
        if state is None:
            return state
        delta = token["x"] @ self.P["w_delta"] + self.P["b_delta"]  # the padding's increment
        if self.increments == "logsigmoid":
            delta = -np.logaddexp(0.0, -delta)
        return state._replace(field=state.field + delta)  # phi = cumsum over chunk positions


class _LayerTailWithPadding(_Loop, ref.InterdomainLayerSession):
    """The layer's short-conv tail takes padding positions in."""

    def _absent(self, state: Any, token: Arrays, t: int) -> Any:
        if state is None:
            return state
        tail_q = np.concatenate([state.tail_q, (token["x"] @ self.P["wq"])[None]])[-self.TAIL :]
        tail_k = np.concatenate([state.tail_k, (token["x"] @ self.P["wk"])[None]])[-self.TAIL :]
        return state._replace(tail_q=tail_q, tail_k=tail_k)  # the conv window over positions


class _OffsetNotShifted(ref.FPASession):
    """Fields kept relative to an offset (a multiple of 4096 near the field, for float32
    precision) that moves with the field; a move shifts the minima, not the stored levels."""

    REBASE = 4096.0

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, Any]:
        cache, offset = (None, None) if state is None else state
        moved = self.REBASE * np.round(token["field"] / self.REBASE)  # (HQ,) the new offset
        if cache is not None and offset is not None and np.any(moved != offset):
            # relative levels l - offset kept as they were: read back as l + (moved - offset)
            cache = cache._replace(levels=cache.levels + (moved - offset))
        cache, o = super()._step(cache, token, t)
        return (cache, moved), o

    def counts(self) -> dict[str, NDArray[np.int64]]:
        rows = self.rows
        self.rows = [
            ref._Row(None if r.state is None else r.state[0], r.tokens, r.past) for r in rows
        ]
        try:
            return super().counts()
        finally:
            self.rows = rows


class _S4DUnrescaled(ref.S4DSession):
    """The state kept as u_t = Lambda^-t x_t (one multiply-add a token; x_t = Lambda^t u_t when
    read): it overflows once |Lambda|^-t does."""

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, Any]:
        if state is not None and state.state is not None:
            state = copy.copy(state)
            power = self.prototype.lam[:, :, None] ** t  # (H, M, 1) Lambda^t
            with np.errstate(all="ignore"):  # the overflow is the error
                state.state = (state.state / power) * power
        with np.errstate(all="ignore"):
            return super()._step(state, token, t)


class _FoxGateAtOwnKey(ref.FoxSession):
    """The gate counted at its own key: key j's level c_{j-1}, so f_j decays key j too."""

    def _step(self, state: Any, token: Arrays, t: int) -> tuple[Any, Any]:
        if state is None:
            empty = ref.FPACache.empty(self.kv_heads, self.heads, self.dk, self.dv)
            state = ref.FoxState(np.zeros(self.heads), empty)
        c = state.c + token["log_f"]
        step = {**token, "field": c, "level": state.c}  # the level before this token's gate
        cache, o = ref.FPASession._step(self, state.cache, step, t)
        return ref.FoxState(c, cache), o


class _FoxNoCausalMaskInChunk(ref.FoxSession):
    """No causal mask inside a multi-token chunk: a query sees the later tokens of its chunk."""

    def advance(self, inputs: Mapping[str, ArrayLike], present: ArrayLike) -> Arrays:
        before = [row.tokens for row in self.rows]
        out = super().advance(inputs, present)
        o, q = out["o"].copy(), np.asarray(inputs["q"], dtype=np.float64)
        group = self.heads // self.kv_heads
        for r, row in enumerate(self.rows):
            positions = np.flatnonzero(np.asarray(present)[r])
            if row.state is None or len(positions) < 2:
                continue
            cache = row.state.cache  # every token up to the chunk's last, levels = c
            for i, p in enumerate(positions):
                t = before[r] + i
                for h in range(self.heads):
                    c = cache.levels[:, h]
                    logits = self.scale * cache.keys[:, h // group] @ q[r, h, p] + c[t] - c
                    weights = np.exp(logits - logits.max())
                    o[r, h, p] = weights @ cache.values[:, h // group] / weights.sum()
        return {"o": o}


# the backends


def _mutant(name: str, wrong: type[ref.Session], op: str, family: str, *also: str) -> type:
    return type(
        name,
        (SessionMutant,),
        {"op": op, "family": family, "also": also, "wrong": wrong, "name": f"mutant-{name}"},
    )


# the FoX errors show in every program with a chunk of several tokens: every family
_FOX_OTHERS = tuple(f for f in session_programs.FAMILIES["fox_attention"] if f != "prefill")
SESSION_MUTANTS: dict[str, type[SessionMutant]] = {
    cls.__name__: cls
    for cls in [
        _mutant("PrefillBlockBorder", _PrefillBlockBorder, "fpa_decode", "prefill"),
        _mutant("EmptyChunkRejected", _EmptyChunkRejected, "fpa_decode", "chunked"),
        _mutant("IdleRowReset", _IdleRowReset, "fpa_decode", "ragged"),
        _mutant("PaddingUpdatesMinima", _PaddingUpdatesMinima, "fpa_decode", "padding"),
        _mutant("FreedByFirstHead", _FreedByFirstHead, "fpa_decode", "gqa"),
        _mutant("StrictAtTheta", _StrictAtTheta, "fpa_decode", "theta_exact"),
        _mutant("CurrentFieldDepth", _CurrentFieldDepth, "fpa_decode", "dense"),
        _mutant("WindowOffByOne", _WindowOffByOne, "fpa_decode", "window"),
        _mutant("AliasingSelect", _AliasingSelect, "fpa_decode", "select"),
        _mutant("MinimaNotRestored", _MinimaNotRestored, "fpa_decode", "rollback", "rollback_past"),
        _mutant("PartialRollback", _PartialRollback, "fpa_decode", "rollback_past"),
        _mutant("ChangedByFailedCall", _ChangedByFailedCall, "fpa_decode", "bad"),
        _mutant("Capacity128", _Capacity128, "fpa_decode", "long"),
        _mutant("LegsChunkCounter", _LegsChunkCounter, "interdomain_legs", "padding"),
        _mutant("S4DPaddingAdvances", _S4DPaddingAdvances, "interdomain_s4d", "padding"),
        _mutant("LayerFieldCountsPadding", _LayerFieldCountsPadding, "fpa_layer", "padding"),
        _mutant("LayerTailWithPadding", _LayerTailWithPadding, "interdomain_layer", "padding"),
        _mutant("OffsetNotShifted", _OffsetNotShifted, "fpa_decode", "drift"),
        _mutant("S4DUnrescaled", _S4DUnrescaled, "interdomain_s4d", "horizon"),
        _mutant("FoxGateAtOwnKey", _FoxGateAtOwnKey, "fox_attention", "prefill", *_FOX_OTHERS),
        _mutant(
            "FoxNoCausalMaskInChunk",
            _FoxNoCausalMaskInChunk,
            "fox_attention",
            "prefill",
            *_FOX_OTHERS,
        ),
    ]
}
globals().update(SESSION_MUTANTS)  # attnspec.conformance.session_mutants:<Name> loads each

"""Decode sessions as pure functions of state pytrees (spec/fpa.md F7, F8 rows, F8 gqa, F9, F3w;
spec/interdomain.md I15), jit-able: every shape is fixed by the session's rows, heads and
capacity, and a chunk's absent positions are a mask, so a server's step compiles once.

For each op X in fpa_decode, interdomain_s4d, interdomain_legs, fpa_layer, interdomain_layer:
``X_session(...)`` the empty state; ``X_advance(state, chunk..., present, ...)`` ->
(outputs, next state); ``X_rollback(state, n, ...)`` with n (R,) tokens to undo per row; and for
every state :func:`session_select` and :func:`session_counts`. Chunks use the parallel ops'
canonical layout (R rows, heads, n positions, dims); present (R, n) bool.

FPA (F7 with the F9 delay): slots per (row, kv head) hold k, v and the token's position; per
query head of the group its level, running minimum m_j, the minimum as of the kept fields
(``mins_back``) and the step it was evicted at. A slot is freed when no query head of its
group may still need it (the union rule of F8 gqa): live, or evicted at a step a rollback
within the row's budget can return before. The fields of the last W + 1 tokens are kept, so a
rollback restores m_j = min(mins_back, the kept fields after j) exactly.

Interdomain states (I15): each row's state, a snapshot before its last b <= W tokens and those
b inputs; a rollback recomputes forward from the snapshot.

Fixed capacity: a key that finds every slot of its kv head taken (FPA), or a LegS token past
the step table, sets ``overflowed`` for its row; its outputs are then not the spec's. Under jit
the flag is the only report: read it (``session_counts(state)["overflowed"]``); the kit's
eager wrapper (:mod:`.kit`) raises a ValueError naming the capacity instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from attnspec.reference import hippo

from .interdomain import S4DState, _s4d_step
from .layers import (
    InterdomainLayerState,
    _interdomain_step,
    fpa_token_inputs,
    fpa_token_output,
)

LIVE = np.iinfo(np.int32).max  # the eviction step of an entry not evicted
NO_WINDOW = np.iinfo(np.int32).max


def _rows(mask: jax.Array, x: jax.Array) -> jax.Array:
    """A (R,) mask broadcast against x (R, ...)."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - 1))


def _where_rows(mask: jax.Array, new: Any, old: Any) -> Any:
    """The pytree ``new`` on the rows of ``mask``, ``old`` elsewhere."""
    return jax.tree.map(lambda a, b: jnp.where(_rows(mask, a), a, b), new, old)


def session_select(state: Any, rows: jax.Array) -> Any:
    """(F9) select: new row i is an exact copy of old row rows[i] (repetitions allowed); every
    leaf of a session state has the rows first. rows (R',) int."""
    return jax.tree.map(lambda x: x[rows], state)


# FPA


class FPASession(NamedTuple):
    """The (F7) caches of R rows with the (F9) delay W; a pytree. S slots per kv head,
    H kv heads, G query heads per kv head, L = W + 1 kept fields.

    keys (R, H, S, dk), values (R, H, S, dv) in the inputs' dtype; position (R, H, S) int32,
    -1 for a free slot; levels, mins, mins_back (R, H, G, S) float32 or wider; evicted
    (R, H, G, S) int32, :data:`LIVE` when attended; fields (R, H, G, L) and field_position
    (R, L) (-1: none) the last L tokens' fields by position mod L; tokens, budget (R,) int32
    (the contract's rollback budget); overflowed (R,) bool.
    """

    keys: jax.Array
    values: jax.Array
    position: jax.Array
    levels: jax.Array
    mins: jax.Array
    mins_back: jax.Array
    evicted: jax.Array
    fields: jax.Array
    field_position: jax.Array
    tokens: jax.Array
    budget: jax.Array
    overflowed: jax.Array


def fpa_session(
    rows: int,
    heads: int,
    kv_heads: int,
    dk: int,
    dv: int,
    *,
    capacity: int,
    max_rollback: int = 0,
    dtype: DTypeLike = jnp.float32,
) -> FPASession:
    """An empty FPA session: ``capacity`` slots per (row, kv head), keys and values in
    ``dtype``, the penalty arithmetic in float32 (float64 for float64). Memory
    O(R H S (dk + dv + 4 G)) for S = capacity."""
    G = heads // kv_heads
    dtype = jnp.dtype(dtype)
    ct = jnp.result_type(jnp.float32, dtype)
    L = max_rollback + 1
    slots, per_query = (rows, kv_heads, capacity), (rows, kv_heads, G, capacity)
    return FPASession(
        keys=jnp.zeros((*slots, dk), dtype),
        values=jnp.zeros((*slots, dv), dtype),
        position=jnp.full(slots, -1, jnp.int32),
        levels=jnp.zeros(per_query, ct),
        mins=jnp.full(per_query, jnp.inf, ct),
        mins_back=jnp.full(per_query, jnp.inf, ct),
        evicted=jnp.full(per_query, LIVE, jnp.int32),
        fields=jnp.zeros((rows, kv_heads, G, L), ct),
        field_position=jnp.full((rows, L), -1, jnp.int32),
        tokens=jnp.zeros(rows, jnp.int32),
        budget=jnp.zeros(rows, jnp.int32),
        overflowed=jnp.zeros(rows, bool),
    )


def _fpa_token(
    s: FPASession,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    here: jax.Array,
    scale: jax.Array,
    theta: jax.Array,
    window: jax.Array,
) -> tuple[jax.Array, FPASession]:
    """One chunk position: q (R, HQ, dk), k (R, H, dk), v (R, H, dv), field, level (R, HQ),
    here (R,) whether the row has a token there. Returns (o (R, HQ, dv), next state)."""
    R, H, S = s.position.shape
    G, L = s.levels.shape[2], s.fields.shape[-1]
    ct = s.levels.dtype
    f, lv = field.astype(ct).reshape(R, H, G), level.astype(ct).reshape(R, H, G)
    t = s.tokens
    occupied = s.position >= 0
    at = lambda x: x[:, None, None, None]  # noqa: E731  (R,) against (R, H, G, S)

    # the field leaving the kept ones joins mins_back of the entries before it
    slot = t % L
    ring = jnp.arange(L) == slot[:, None]  # (R, L)
    old_position = jnp.sum(jnp.where(ring, s.field_position, 0), axis=1)
    leaving = (old_position == t - L) & (old_position >= 0)
    old_field = jnp.sum(jnp.where(ring[:, None, None], s.fields, 0), axis=-1)  # (R, H, G)
    before = (s.position < old_position[:, None, None])[:, :, None] & occupied[:, :, None]
    merge = at(leaving) & before
    mins_back = jnp.where(merge, jnp.minimum(s.mins_back, old_field[..., None]), s.mins_back)

    # (F7) m_j <- min(m_j, phi_t); evict at depth >= theta or outside the window (F3w)
    mins = jnp.where(occupied[:, :, None], jnp.minimum(s.mins, f[..., None]), s.mins)
    depth = jnp.maximum(0.0, s.levels - mins)  # (F2)
    age = at(t) - s.position[:, :, None]
    drop = occupied[:, :, None] & (s.evicted == LIVE) & ((depth >= theta) | (age >= window))
    evicted = jnp.where(drop, at(t), s.evicted)

    # (F9) an entry stays stored while a rollback within the budget may need it (union rule)
    tokens, budget = t + 1, jnp.minimum(s.budget + 1, L - 1)
    needed = (evicted == LIVE) | (evicted >= at(tokens - budget))
    position = jnp.where(occupied & jnp.any(needed, axis=2), s.position, -1)

    # append k_t, v_t at the first free slot of its kv head (m = +inf: pi_tt = 0)
    free = position < 0
    has_free = jnp.any(free, axis=-1)  # (R, H)
    put = (jnp.arange(S) == jnp.argmax(free, axis=-1)[..., None]) & has_free[..., None]
    put_q = put[:, :, None]
    state = FPASession(
        keys=jnp.where(put[..., None], k[:, :, None], s.keys),
        values=jnp.where(put[..., None], v[:, :, None], s.values),
        position=jnp.where(put, t[:, None, None], position),
        levels=jnp.where(put_q, lv[..., None], s.levels),
        mins=jnp.where(put_q, jnp.inf, mins),
        mins_back=jnp.where(put_q, jnp.inf, mins_back),
        evicted=jnp.where(put_q, LIVE, evicted),
        fields=jnp.where(ring[:, None, None], f[..., None], s.fields),
        field_position=jnp.where(ring, t[:, None], s.field_position),
        tokens=tokens,
        budget=budget,
        overflowed=s.overflowed | ~jnp.all(has_free, axis=1),
    )

    # attend over the entries live for each query head: (F3)-(F5)
    live = (state.position >= 0)[:, :, None] & (state.evicted == LIVE)
    depth = jnp.maximum(0.0, state.levels - state.mins)
    qg = q.astype(ct).reshape(R, H, G, -1)
    content = jnp.einsum("rhgd,rhsd->rhgs", qg, state.keys.astype(ct), precision="highest")
    logits = jnp.where(live, scale * content - depth, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(total > 0, total, 1.0)  # no live key (overflow only): 0
    o = jnp.einsum("rhgs,rhsd->rhgd", weights, state.values.astype(ct), precision="highest")
    o = jnp.where(_rows(here, o), o, 0.0).reshape(R, H * G, -1)
    return o, _where_rows(here, state, s)


def _scan_positions(
    token: Callable[..., tuple[jax.Array, Any]], state: Any, chunk: tuple[jax.Array, ...], axis: int
) -> tuple[jax.Array, Any]:
    """Run ``token(state, *inputs at position p)`` over the positions of ``chunk`` (each array
    with positions on ``axis``; present (R, n) last); outputs stacked on ``axis``."""

    def body(s: Any, xs: tuple[jax.Array, ...]) -> tuple[Any, jax.Array]:
        o, s = token(s, *xs)
        return s, o

    moved = tuple(jnp.moveaxis(x, axis if x.ndim > 2 else 1, 0) for x in chunk)
    state, outs = lax.scan(body, state, moved)
    return jnp.moveaxis(outs, 0, axis), state


@jax.jit
def fpa_advance(
    state: FPASession,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    present: jax.Array,
    scale: jax.Array,
    theta: jax.Array,
    window: jax.Array,
) -> tuple[jax.Array, FPASession]:
    """(F8 rows) a chunk: q (R, HQ, n, dk), k (R, H, n, dk), v (R, H, n, dv), field, level
    (R, HQ, n), present (R, n) -> (o (R, HQ, n, dv) in q's dtype, next state). The present
    positions of a row are its next tokens, in order; absent ones change nothing and output
    0. scale, theta (> 0, inf: no eviction) and window (>= 1; :data:`NO_WINDOW`: none) may be
    traced. Time O(n R HQ S (dk + dv)) for S slots."""

    def token(
        s: FPASession,
        qt: jax.Array,
        kt: jax.Array,
        vt: jax.Array,
        ft: jax.Array,
        lt: jax.Array,
        here: jax.Array,
    ) -> tuple[jax.Array, FPASession]:
        return _fpa_token(s, qt, kt, vt, ft, lt, here, scale, theta, window)

    o, state = _scan_positions(token, state, (q, k, v, field, level, present), 2)
    return o.astype(q.dtype), state


def _fpa_rollback(state: FPASession, n: jax.Array) -> FPASession:
    """(F9) row r returns to its state after its first t - n[r] tokens; n (R,) int, each at
    most the row's budget (the caller checks). Entries of the undone tokens are freed, the
    minima restored from mins_back and the kept fields, evictions after t - n undone."""
    back = state.tokens - n  # (R,)
    undo = n > 0
    at = lambda x: x[:, None, None, None]  # noqa: E731
    position = jnp.where(state.position >= back[:, None, None], -1, state.position)
    field_position = jnp.where(state.field_position >= back[:, None], -1, state.field_position)
    # m_j = min over (j, back - 1] of phi: mins_back, then the kept fields after j
    kept = (field_position >= 0)[:, None, None, None, :]
    after = field_position[:, None, None, None, :] > state.position[:, :, None, :, None]
    fields = jnp.where(kept & after, state.fields[:, :, :, None, :], jnp.inf)
    mins = jnp.minimum(state.mins_back, jnp.min(fields, axis=-1))
    evicted = jnp.where(state.evicted >= at(back), LIVE, state.evicted)
    rolled = state._replace(
        position=position,
        mins=mins,
        evicted=evicted,
        field_position=field_position,
        tokens=back,
        budget=state.budget - n,
    )
    return _where_rows(undo, rolled, state)


fpa_rollback = jax.jit(_fpa_rollback)


def _fpa_counts(state: FPASession) -> dict[str, jax.Array]:
    R, H, G, _ = state.levels.shape
    live = (state.position >= 0)[:, :, None] & (state.evicted == LIVE)
    return {
        "tokens": state.tokens,
        "live": jnp.sum(live, axis=-1, dtype=jnp.int32).reshape(R, H * G),
        "stored": jnp.sum(state.position >= 0, axis=-1, dtype=jnp.int32),
        "overflowed": state.overflowed,
    }


def _last_field(state: FPASession) -> jax.Array:
    """The field of each row's last token (R, HQ), 0 before the first (kept with L >= 1)."""
    L = state.fields.shape[-1]
    R, H, G, _ = state.levels.shape
    ring = jnp.arange(L) == ((state.tokens - 1) % L)[:, None]
    last = jnp.sum(jnp.where(ring[:, None, None], state.fields, 0.0), axis=-1)
    return jnp.where(state.tokens[:, None] > 0, last.reshape(R, H * G), 0.0)


# FPA layer


class FPALayerSession(NamedTuple):
    """The FPA layer's session: the attention session (heads = kv heads); the field of each
    row's last token is the last kept field."""

    attention: FPASession


def fpa_layer_session(
    params: dict[str, Any],
    rows: int,
    *,
    capacity: int,
    max_rollback: int = 0,
    dtype: DTypeLike = jnp.float32,
) -> FPALayerSession:
    """An empty session of the FPA layer of ``params`` (FPA_PARAMETER_SCHEMA)."""
    H = jnp.shape(params["b_delta"])[0]
    dk, dv = jnp.shape(params["wq"])[1] // H, jnp.shape(params["wv"])[1] // H
    return FPALayerSession(
        fpa_session(rows, H, H, dk, dv, capacity=capacity, max_rollback=max_rollback, dtype=dtype)
    )


@functools.partial(jax.jit, static_argnums=(3,))
def fpa_layer_advance(
    state: FPALayerSession,
    x: jax.Array,
    present: jax.Array,
    increments: str,
    params: dict[str, jax.Array],
    scale: jax.Array,
    theta: jax.Array,
    window: jax.Array,
) -> tuple[jax.Array, FPALayerSession]:
    """A chunk x (R, n, d) of the FPA layer, present (R, n) -> (y (R, n, d) in x's dtype, next
    state): per token phi_t = phi_{t-1} + delta_t and the (F7) step of :func:`fpa_advance`."""
    ct = state.attention.levels.dtype

    def token(s: FPALayerSession, xt: jax.Array, here: jax.Array) -> tuple[jax.Array, Any]:
        q, k, v, field, level = fpa_token_inputs(
            xt, params, _last_field(s.attention), increments, ct
        )
        o, attention = _fpa_token(s.attention, q, k, v, field, level, here, scale, theta, window)
        y = fpa_token_output(o.astype(xt.dtype), params, ct)
        return jnp.where(here[:, None], y, 0.0).astype(xt.dtype), FPALayerSession(attention)

    return _scan_positions(token, state, (x, present), 1)


@jax.jit
def fpa_layer_rollback(state: FPALayerSession, n: jax.Array) -> FPALayerSession:
    """(F9) as :func:`fpa_rollback`; the field of the last token is the last kept one."""
    return FPALayerSession(_fpa_rollback(state.attention, n))


# Interdomain states


class RecurrentSession(NamedTuple):
    """A fixed-size state per row with the (I15) rollback: ``state`` now, ``snapshot`` before
    the row's last ``budget`` tokens, ``kept`` those tokens' inputs by position mod W (each leaf
    (R, W, ...)); tokens, budget (R,) int32; overflowed (R,) bool."""

    state: Any
    snapshot: Any
    kept: Any
    tokens: jax.Array
    budget: jax.Array
    overflowed: jax.Array


def _recurrent(state: Any, token_inputs: Any, rows: int, max_rollback: int) -> RecurrentSession:
    kept = jax.tree.map(lambda x: jnp.zeros((rows, max_rollback, *x.shape), x.dtype), token_inputs)
    zeros = jnp.zeros(rows, jnp.int32)
    return RecurrentSession(state, state, kept, zeros, zeros, jnp.zeros(rows, bool))


Step = Callable[[Any, Any, jax.Array], tuple[jax.Array, Any, jax.Array]]


def _recurrent_token(
    step: Step, s: RecurrentSession, inputs: Any, here: jax.Array
) -> tuple[jax.Array, RecurrentSession]:
    """One position: ``step(state, inputs, t)`` -> (out, next state, overflowed (R,)) on the
    rows that have a token; the snapshot follows W tokens behind."""
    out, state, over = step(s.state, inputs, s.tokens)
    W = jax.tree.leaves(s.kept)[0].shape[1]
    snapshot, kept = s.snapshot, s.kept
    if W:
        slot = s.tokens % W
        full = s.budget == W
        oldest = jax.tree.map(lambda k: k[jnp.arange(k.shape[0]), slot], s.kept)
        _, later, _ = step(s.snapshot, oldest, s.tokens - W)
        snapshot = _where_rows(here & full, later, s.snapshot)
        kept = jax.tree.map(
            lambda k, x: k.at[jnp.arange(k.shape[0]), slot].set(
                jnp.where(_rows(here, x), x, k[jnp.arange(k.shape[0]), slot])
            ),
            s.kept,
            inputs,
        )
    new = RecurrentSession(
        _where_rows(here, state, s.state),
        snapshot,
        kept,
        s.tokens + here,
        jnp.where(here, jnp.minimum(s.budget + 1, W), s.budget),
        s.overflowed | (here & over),
    )
    return jnp.where(_rows(here, out), out, 0).astype(out.dtype), new


def _recurrent_rollback(step: Step, s: RecurrentSession, n: jax.Array) -> RecurrentSession:
    """(I15) rows with n > 0 recomputed from their snapshot over their kept inputs but the
    last n."""
    W = jax.tree.leaves(s.kept)[0].shape[1]
    undo = n > 0
    state = _where_rows(undo, s.snapshot, s.state)
    start = s.tokens - s.budget
    for i in range(W):
        t = start + i
        inputs = jax.tree.map(lambda k, slot=t % W: k[jnp.arange(k.shape[0]), slot], s.kept)
        _, later, _ = step(state, inputs, t)
        state = _where_rows(undo & (i < s.budget - n), later, state)
    return s._replace(state=state, tokens=s.tokens - n, budget=s.budget - n)


def _recurrent_counts(s: RecurrentSession) -> dict[str, jax.Array]:
    return {"tokens": s.tokens, "overflowed": s.overflowed}


def s4d_session(
    rows: int,
    heads: int,
    M: int,
    R: int,
    dv: int,
    *,
    readout: str = "linear",
    max_rollback: int = 0,
    dtype: DTypeLike = jnp.float32,
) -> RecurrentSession:
    """An empty S4D session: x (rows, H, M, R + dv (+1 for ratio)) complex of the width of
    float32 (complex128 for float64)."""
    ct = jnp.result_type(jnp.float32, dtype)
    cc = jnp.result_type(ct, jnp.complex64)
    C = R + dv + (readout == "ratio")
    x = S4DState(jnp.zeros((rows, heads, M, C), cc))
    token = {
        "fq": jnp.zeros((heads, R), dtype),
        "kt": jnp.zeros((heads, R), dtype),
        "vt": jnp.zeros((heads, dv), dtype),
    }
    return _recurrent(x, token, rows, max_rollback)


def _s4d_step_fn(lam: jax.Array, b: jax.Array, c: jax.Array, readout: str) -> Step:
    def step(x: Any, inputs: Any, t: jax.Array) -> tuple[jax.Array, Any, jax.Array]:
        o, x = _s4d_step(x, inputs["fq"], inputs["kt"], inputs["vt"], lam, b, c, readout)
        return o, x, jnp.zeros(t.shape, bool)

    return step


@functools.partial(jax.jit, static_argnums=(8,))
def s4d_advance(
    state: RecurrentSession,
    fq: jax.Array,
    kt: jax.Array,
    vt: jax.Array,
    present: jax.Array,
    lam: jax.Array,
    b: jax.Array,
    c: jax.Array,
    readout: str,
) -> tuple[jax.Array, RecurrentSession]:
    """(I15) a chunk fq, kt (R, H, n, R), vt (R, H, n, dv), present (R, n) -> (o (R, H, n, dv),
    next state), by the step of :func:`attnspec.backends.jax.interdomain_s4d_step`; lam, b
    (H, M), c (H, M, M) complex."""
    step = _s4d_step_fn(lam, b, c, readout)

    def token(
        s: RecurrentSession, q: jax.Array, k: jax.Array, v: jax.Array, here: jax.Array
    ) -> Any:
        return _recurrent_token(step, s, {"fq": q, "kt": k, "vt": v}, here)

    return _scan_positions(token, state, (fq, kt, vt, present), 2)


@functools.partial(jax.jit, static_argnums=(5,))
def s4d_rollback(
    state: RecurrentSession, n: jax.Array, lam: jax.Array, b: jax.Array, c: jax.Array, readout: str
) -> RecurrentSession:
    """(I15) rollback of n (R,) tokens per row."""
    return _recurrent_rollback(_s4d_step_fn(lam, b, c, readout), state, n)


def legs_table(
    M: int, capacity: int, dtype: DTypeLike = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """(I5) the LegS steps of tokens 1..capacity: E (capacity, M, M), F (capacity, M), from
    ``hippo.legs_step`` in float64, cast to float32 or wider. Time O(capacity M^3) once."""
    steps = [hippo.legs_step(n, M) for n in range(1, capacity + 1)]
    ct = jnp.result_type(jnp.float32, dtype)
    return jnp.asarray(np.stack([e for e, _ in steps]), ct), jnp.asarray(
        np.stack([f for _, f in steps]), ct
    )


def legs_session(
    rows: int,
    heads: int,
    M: int,
    R: int,
    dv: int,
    *,
    max_rollback: int = 0,
    dtype: DTypeLike = jnp.float32,
) -> RecurrentSession:
    """An empty LegS session: c (rows, H, M, R + dv) float32 or wider."""
    ct = jnp.result_type(jnp.float32, dtype)
    token = {
        "fq": jnp.zeros((heads, R), dtype),
        "fk": jnp.zeros((heads, R), dtype),
        "v": jnp.zeros((heads, dv), dtype),
    }
    return _recurrent(jnp.zeros((rows, heads, M, R + dv), ct), token, rows, max_rollback)


def _legs_step_fn(E: jax.Array, F: jax.Array) -> Step:
    def step(c: jax.Array, inputs: Any, t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        fq, fk, v = inputs["fq"], inputs["fk"], inputs["v"]
        R = fq.shape[-1]
        over = t >= E.shape[0]
        n = jnp.minimum(t, E.shape[0] - 1)
        f = jnp.concatenate([fk, v], axis=-1).astype(c.dtype)  # (rows, H, R + dv)
        c = (
            jnp.einsum("rmk,rhkc->rhmc", E[n], c, precision="highest")
            + F[n][:, None, :, None] * f[:, :, None]
        )  # (I5)
        a = jnp.einsum("rhmk,rhk->rhm", c[..., :R], fq.astype(c.dtype), precision="highest")
        num = jnp.einsum("rhm,rhmd->rhd", a, c[..., R:], precision="highest")
        return (num / a[..., :1]).astype(fq.dtype), c, over  # (I3), eta = e_0 (I6)

    return step


@jax.jit
def legs_advance(
    state: RecurrentSession,
    fq: jax.Array,
    fk: jax.Array,
    v: jax.Array,
    present: jax.Array,
    E: jax.Array,
    F: jax.Array,
) -> tuple[jax.Array, RecurrentSession]:
    """(I15) a chunk fq, fk (R, H, n, R), v (R, H, n, dv), present (R, n) -> (o, next state);
    token t (0-based) of a row steps by E[t], F[t] of :func:`legs_table`; past the table the
    row is ``overflowed``."""
    step = _legs_step_fn(E, F)

    def token(
        s: RecurrentSession, q: jax.Array, k: jax.Array, x: jax.Array, here: jax.Array
    ) -> Any:
        return _recurrent_token(step, s, {"fq": q, "fk": k, "v": x}, here)

    return _scan_positions(token, state, (fq, fk, v, present), 2)


@jax.jit
def legs_rollback(
    state: RecurrentSession, n: jax.Array, E: jax.Array, F: jax.Array
) -> RecurrentSession:
    """(I15) rollback of n (R,) tokens per row."""
    return _recurrent_rollback(_legs_step_fn(E, F), state, n)


# Interdomain layer


def interdomain_layer_session(
    params: dict[str, Any],
    rows: int,
    *,
    readout: str = "linear",
    max_rollback: int = 0,
    dtype: DTypeLike = jnp.float32,
) -> RecurrentSession:
    """An empty session of the Interdomain layer: per row the conv windows, the S4D state and
    the position (RoPE), as :class:`.layers.InterdomainLayerState` with the rows first."""
    H, R = jnp.shape(params["norm_k_g"])
    dv, M = jnp.shape(params["norm_v_g"])[1], jnp.shape(params["a_log"])[1]
    ct = jnp.result_type(jnp.float32, dtype)
    cc = jnp.result_type(ct, jnp.complex64)
    window = jnp.zeros((rows, jnp.shape(params["conv_q"])[0] - 1, H * R), ct)
    C = R + dv + (readout == "ratio")
    state = InterdomainLayerState(
        window, window, S4DState(jnp.zeros((rows, H, M, C), cc)), jnp.zeros(rows, jnp.int32)
    )
    d = jnp.shape(params["wq"])[0]
    return _recurrent(state, jnp.zeros((d,), dtype), rows, max_rollback)


def _interdomain_step_fn(
    params: dict[str, jax.Array], options: tuple[str, bool, bool, bool]
) -> Step:
    def one(x: jax.Array, s: InterdomainLayerState) -> tuple[jax.Array, InterdomainLayerState]:
        """One row (a batch of 1 for the layer's step), at its own position."""
        batch = InterdomainLayerState(
            s.conv_q[None], s.conv_k[None], S4DState(s.ssm.x[None]), s.position
        )
        y, new = _interdomain_step(x[None], params, batch, *options)
        return y[0], InterdomainLayerState(
            new.conv_q[0], new.conv_k[0], S4DState(new.ssm.x[0]), new.position
        )

    def step(
        s: InterdomainLayerState, x: jax.Array, t: jax.Array
    ) -> tuple[jax.Array, Any, jax.Array]:
        y, new = jax.vmap(one)(x, s)
        return y, new, jnp.zeros(t.shape, bool)

    return step


@functools.partial(jax.jit, static_argnums=(4,))
def interdomain_layer_advance(
    state: RecurrentSession,
    x: jax.Array,
    present: jax.Array,
    params: dict[str, jax.Array],
    options: tuple[str, bool, bool, bool],
) -> tuple[jax.Array, RecurrentSession]:
    """(I15) a chunk x (R, n, d), present (R, n) -> (y (R, n, d), next state) by
    :func:`.layers.interdomain_layer_step` per row; options (readout, use_rope, gate,
    output_norm)."""
    step = _interdomain_step_fn(params, options)

    def token(s: RecurrentSession, xt: jax.Array, here: jax.Array) -> Any:
        return _recurrent_token(step, s, xt, here)

    return _scan_positions(token, state, (x, present), 1)


@functools.partial(jax.jit, static_argnums=(3,))
def interdomain_layer_rollback(
    state: RecurrentSession,
    n: jax.Array,
    params: dict[str, jax.Array],
    options: tuple[str, bool, bool, bool],
) -> RecurrentSession:
    """(I15) rollback of n (R,) tokens per row."""
    return _recurrent_rollback(_interdomain_step_fn(params, options), state, n)


def session_counts(state: Any) -> dict[str, jax.Array]:
    """The contract's counts: "tokens" (R,), "overflowed" (R,); FPA sessions also "live"
    (R, HQ) and "stored" (R, H) (F8 gqa, the union rule with the F9 delay)."""
    if isinstance(state, FPALayerSession):
        return _fpa_counts(state.attention)
    if isinstance(state, FPASession):
        return _fpa_counts(state)
    return _recurrent_counts(state)

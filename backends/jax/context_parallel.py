"""Context parallelism in JAX: FPA, FoX and the S4D core with the sequence sharded over a mesh
axis under ``shard_map``; composes with ``jit`` and ``grad`` and with batch or head sharding on
other mesh axes.

Two levels. The ``*_shard`` functions run INSIDE ``shard_map`` on one device's shard (public
layout [B, T/P, N, H]) and name the sequence axis; they all-gather the keys, values, field and
levels (``lax.all_gather``) and compute their own queries against them with the identities
(CP1)-(CP5) of docs/context_parallel.md. The wrappers :func:`fpa_attention`,
:func:`fox_attention` and :func:`interdomain_s4d` take whole arrays and a mesh and do the
``shard_map`` (and, for the zigzag layout, the permutation of the sequence) themselves.

Gradients come from JAX's autodiff: the transpose of the all-gather sums every device's
cotangent onto the owner of each position. The FPA penalty is written so that autodiff follows
spec/fpa.md section 6 exactly: the latest argmin t*_ij of every segment is found without
gradient by (CP1), the segment minimum is read back as field[t*_ij] (a gather, whose transpose
sends dL/dm_ij to the owner of t*_ij), and max(0, x) is a ``where`` that is active at x = 0.

Memory per device [decision: correctness and simplicity first]: the gathered keys and values
O(T (K + V)) and the logits of its queries against every key, O(B N T^2 / P) (dense per shard;
the torch implementation tiles them). The S4D core holds its shard's states, O(B N T/P M C).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from attnspec.reference.packing import packing

LAYOUTS = ("contiguous", "zigzag")


# Layout


def chunk_count(world: int, layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return world if layout == "contiguous" else 2 * world


def rank_chunks(rank: Any, world: int, layout: str) -> list[Any]:
    """The global chunk indices device ``rank`` holds (rank may be traced)."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def layout_order(T: int, world: int, layout: str) -> np.ndarray:
    """The permutation of positions that makes the layout contiguous: device r's chunks first
    (in rank order), so a plain split of the permuted sequence gives each device its chunks."""
    n = chunk_count(world, layout)
    if T % n:
        raise ValueError(
            f"T: the sequence length {T} must be divisible by the {n} chunks of the {layout!r} "
            f"layout on {world} devices"
        )
    L = T // n
    chunks = [c for r in range(world) for c in rank_chunks(r, world, layout)]
    return np.concatenate([np.arange(c * L, (c + 1) * L) for c in chunks])


def _owner(world: int, layout: str) -> list[tuple[int, int]]:
    owner = [(0, 0)] * chunk_count(world, layout)
    for r in range(world):
        for i, c in enumerate(rank_chunks(r, world, layout)):
            owner[c] = (r, i)
    return owner


def _gather(x: jax.Array, axis: str, world: int, layout: str) -> jax.Array:
    """[B, T/P, ...] shards -> [B, T, ...] in global order (all-gather, then chunk order)."""
    g = lax.all_gather(x, axis)  # [P, B, T/P, ...]
    n = chunk_count(world, layout)
    per = n // world
    L = x.shape[1] // per
    parts = [g[r][:, i * L : (i + 1) * L] for r, i in _owner(world, layout)]
    return jnp.concatenate(parts, axis=1)


def _check_offsets(cu_seqlens: Sequence[int] | None, T: int) -> tuple[int, ...] | None:
    """Global offsets checked by the one rule of :mod:`attnspec.reference.packing`, without
    zero-length sequences (they contribute nothing): strictly increasing."""
    plan = packing(cu_seqlens, T, what="global offsets")
    return None if plan is None else plan.nonempty_offsets


def _segment_ids(offsets: tuple[int, ...] | None, T: int) -> np.ndarray | None:
    if offsets is None:
        return None
    return np.searchsorted(np.asarray(offsets), np.arange(T), side="right") - 1


# The strategy: (CP1) gap, (CP3) scan, (CP4) carry


class Sharding:
    """The identities a sharded implementation can get wrong, as overridable methods."""

    def gap(self, mu: jax.Array, argmu: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(CP1) mid[..., b, a] = min of mu over the chunks strictly between b and a, and its
        latest argmin; mu, argmu [..., n]."""
        n = mu.shape[-1]
        c = np.arange(n)
        between = (c[None, None, :] > c[:, None, None]) & (c[None, None, :] < c[None, :, None])
        vals = jnp.where(between, mu[..., None, None, :], jnp.inf)  # [..., b, a, c]
        mid = vals.min(axis=-1)
        latest = jnp.where(between & (vals == mid[..., None]), c, -1).max(axis=-1)
        argmid = jnp.take_along_axis(argmu[..., None, :], jnp.maximum(latest, 0), axis=-1)
        return mid, argmid

    def scan(self, totals: jax.Array) -> jax.Array:
        """(CP3) exclusive scan along the last axis."""
        return jnp.cumsum(totals, axis=-1) - totals

    def carry(self, decays: jax.Array, finals: jax.Array) -> jax.Array:
        """(CP4) S_0 = 0, S_{r+1} = decays_r S_r + finals_r over the leading axis (ranks)."""
        states = [jnp.zeros_like(finals[0])]
        for r in range(finals.shape[0] - 1):
            states.append(decays[r] * states[-1] + finals[r])
        return jnp.stack(states)


DEFAULT = Sharding()


# FPA and FoX on one shard


def _latest_where(eq: Any, t: Any, axis: int) -> jax.Array:
    return jnp.where(eq, t, -1).max(axis=axis)


def _chunk_structures(f: jax.Array, L: int) -> dict[str, jax.Array]:
    """Per chunk of the gathered field f [B, N, T]: exclusive suffix minima A and their latest
    argmins (global), chunk minima mu and latest argmins."""
    B, N, T = f.shape
    n = T // L
    fc = f.reshape(B, N, n, L)
    t = np.arange(L)
    after = t[None, :] > t[:, None]  # [j, t]: t in (j, L)
    vals = jnp.where(after, fc[..., None, :], jnp.inf)  # [B, N, n, j, t]
    A = vals.min(axis=-1)
    argA = _latest_where(after & (vals == A[..., None]), t, -1)
    base = (np.arange(n) * L)[:, None]
    mu = fc.min(axis=-1)
    argmu = _latest_where(fc == mu[..., None], t, -1) + np.arange(n) * L
    return {
        "A": A.reshape(B, N, T),
        "argA": (jnp.maximum(argA, 0) + base).reshape(B, N, T),
        "mu": mu,
        "argmu": argmu,
    }


def _segment_argmin_local(f: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inside one chunk f [B, N, L]: m[i, j] = min over (j, i] and its latest argmin (local),
    +inf / -1 for j >= i."""
    L = f.shape[-1]
    t = np.arange(L)
    X = jnp.where(t[None, :] < t[:, None], f[..., :, None], jnp.inf)  # X[i, j] = f_i if j < i
    m = lax.cummin(X, axis=X.ndim - 2)
    new = (f[..., :, None] == m) & (t[:, None] > t[None, :])
    tstar = lax.cummax(jnp.where(new, t[:, None], -1), axis=m.ndim - 2)
    return m, tstar


def _prefix_min(f: jax.Array) -> tuple[jax.Array, jax.Array]:
    t = np.arange(f.shape[-1])
    Bm = lax.cummin(f, axis=f.ndim - 1)
    return Bm, lax.cummax(jnp.where(f == Bm, t, -1), axis=f.ndim - 1)


def _positions(rank: jax.Array, world: int, layout: str, L: int) -> list[jax.Array]:
    return [c * L + jnp.arange(L) for c in rank_chunks(rank, world, layout)]


def fpa_shard(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    *,
    axis: str,
    world: int,
    layout: str = "contiguous",
    scale: float | None = None,
    cu_seqlens: tuple[int, ...] | None = None,
    sharding: Sharding = DEFAULT,
) -> tuple[jax.Array, jax.Array]:
    """FPA of this device's queries (inside ``shard_map`` over ``axis`` of size ``world``).

    Args: this device's shard q [B, T/P, N, H], k [B, T/P, K, H], v [B, T/P, K, Hv], field and
    level [B, T/P, N]; cu_seqlens: static offsets of the whole sequence.

    Returns:
        (o [B, T/P, N, Hv] in q's dtype, lse [B, T/P, N]).
    """
    _, Tl, N, H = q.shape
    n = chunk_count(world, layout)
    L = Tl * world // n
    T = L * n
    s = 1.0 / np.sqrt(H) if scale is None else float(scale)
    ct = jnp.result_type(jnp.float32, q.dtype, field.dtype)
    groups = N // k.shape[2]
    kg = jnp.repeat(_gather(k, axis, world, layout), groups, axis=2).astype(ct)
    vg = jnp.repeat(_gather(v, axis, world, layout), groups, axis=2).astype(ct)
    fg = _gather(field, axis, world, layout).astype(ct).transpose(0, 2, 1)  # [B, N, T]
    lg = _gather(level, axis, world, layout).astype(ct).transpose(0, 2, 1)
    st = _chunk_structures(lax.stop_gradient(fg), L)
    mid, argmid = sharding.gap(st["mu"], st["argmu"])  # [B, N, n(b), n(a)]
    chunk_of = np.arange(T) // L
    seg = _segment_ids(cu_seqlens, T)
    rank = lax.axis_index(axis)
    outs, lses = [], []
    for slot, (a, pos) in enumerate(
        zip(rank_chunks(rank, world, layout), _positions(rank, world, layout, L), strict=True)
    ):
        ql = q[:, slot * L : (slot + 1) * L].astype(ct).transpose(0, 2, 1, 3)  # [B, N, L, H]
        fl = lax.stop_gradient(fg)
        fa = lax.dynamic_slice_in_dim(fl, a * L, L, axis=2)  # the query chunk [B, N, L]
        Bm, argB = _prefix_min(fa)
        argB = argB + a * L
        # (CP1) across chunks: min(A_j, mid(b, a), B_i), latest argmin first from B
        mid_a = jnp.take_along_axis(mid, jnp.broadcast_to(a, mid.shape[:-1])[..., None], -1)[
            ..., 0
        ][..., chunk_of]  # [B, N, T]
        argmid_a = jnp.take_along_axis(
            argmid, jnp.broadcast_to(a, argmid.shape[:-1])[..., None], -1
        )[..., 0][..., chunk_of]
        Am = jnp.minimum(st["A"], mid_a)
        in_B = Bm[..., :, None] <= Am[..., None, :]
        in_mid = (mid_a <= st["A"])[..., None, :]
        t_cross = jnp.where(
            in_B,
            argB[..., :, None],
            jnp.where(in_mid, argmid_a[..., None, :], st["argA"][..., None, :]),
        )
        # inside the query chunk: the direct segment minimum
        _, t_in = _segment_argmin_local(fa)  # [B, N, L, L]
        col = jnp.clip(jnp.arange(T) - a * L, 0, L - 1)
        t_in = jnp.take_along_axis(t_in, jnp.broadcast_to(col, (*t_in.shape[:-1], T)), -1) + a * L
        same = (chunk_of == a)[None, None, None, :]
        tstar = jnp.where(same, t_in, t_cross)
        i_pos = pos[:, None]
        j_pos = jnp.arange(T)[None, :]
        below = j_pos < i_pos
        tstar = jnp.where(below, tstar, 0)
        m = jnp.take_along_axis(fg[..., None, :].repeat(L, axis=2), tstar, axis=-1)  # fg[t*]
        active = below & (lg[..., None, :] >= m)
        pen = jnp.where(active, lg[..., None, :] - m, 0.0)  # (F2), active at 0
        logits = s * jnp.einsum("bnih,bjnh->bnij", ql, kg) - pen  # (F3)
        mask = j_pos <= i_pos
        if seg is not None:
            mask = mask & (jnp.asarray(seg)[j_pos] == jnp.asarray(seg)[i_pos])
        logits = jnp.where(mask, logits, -jnp.inf)
        lse = jax.nn.logsumexp(logits, axis=-1)  # (F4)
        p = jnp.exp(logits - lse[..., None])
        outs.append(jnp.einsum("bnij,bjnd->bind", p, vg))  # (F5)
        lses.append(lse.transpose(0, 2, 1))
    o = jnp.concatenate(outs, axis=1).astype(q.dtype)
    return o, jnp.concatenate(lses, axis=1).astype(jnp.result_type(jnp.float32, field.dtype))


def fox_shard(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_f: jax.Array,
    *,
    axis: str,
    world: int,
    layout: str = "contiguous",
    scale: float | None = None,
    cu_seqlens: tuple[int, ...] | None = None,
    sharding: Sharding = DEFAULT,
) -> jax.Array:
    """FoX of this device's queries (inside ``shard_map``), the walk by (CP3)."""
    B, Tl, N, H = q.shape
    n = chunk_count(world, layout)
    L = Tl * world // n
    T = L * n
    s = 1.0 / np.sqrt(H) if scale is None else float(scale)
    ct = jnp.result_type(jnp.float32, q.dtype, log_f.dtype)
    groups = N // k.shape[2]
    kg = jnp.repeat(_gather(k, axis, world, layout), groups, axis=2).astype(ct)
    vg = jnp.repeat(_gather(v, axis, world, layout), groups, axis=2).astype(ct)
    g = _gather(log_f, axis, world, layout).astype(ct).transpose(0, 2, 1)  # [B, N, T]
    local = jnp.cumsum(g.reshape(B, N, n, L), axis=-1)
    walk = (local + sharding.scan(local[..., -1])[..., None]).reshape(B, N, T)  # (CP3)
    seg = _segment_ids(cu_seqlens, T)
    rank = lax.axis_index(axis)
    outs = []
    for slot, pos in enumerate(_positions(rank, world, layout, L)):
        ql = q[:, slot * L : (slot + 1) * L].astype(ct).transpose(0, 2, 1, 3)
        origin = walk[..., pos[0], None]
        ci = jnp.take(walk, pos, axis=-1) - origin
        decay = ci[..., :, None] - (walk - origin)[..., None, :]  # sum_{l in (j, i]} log f_l
        logits = s * jnp.einsum("bnih,bjnh->bnij", ql, kg) + decay
        j_pos = jnp.arange(T)[None, :]
        mask = j_pos <= pos[:, None]
        if seg is not None:
            mask = mask & (jnp.asarray(seg)[j_pos] == jnp.asarray(seg)[pos[:, None]])
        logits = jnp.where(mask, logits, -jnp.inf)
        outs.append(jnp.einsum("bnij,bjnd->bind", jax.nn.softmax(logits, axis=-1), vg))
    return jnp.concatenate(outs, axis=1).astype(q.dtype)


# S4D on one shard


def s4d_shard(
    fq: jax.Array,
    kt: jax.Array,
    vt: jax.Array,
    lam: jax.Array,
    b: jax.Array,
    c: jax.Array,
    *,
    axis: str,
    world: int,
    readout: str = "linear",
    cu_seqlens: tuple[int, ...] | None = None,
    sharding: Sharding = DEFAULT,
) -> jax.Array:
    """(I11)-(I13) on this device's shard (inside ``shard_map``, contiguous layout): a local
    scan from zero, the entering state by (CP4) over the all-gathered (decay, final state)
    pairs, then x_t = x0_t + (decay since the shard start) * S.

    Args: fq, kt [B, T/P, N, R], vt [B, T/P, N, Hv]; lam, b [N, M], c [N, M, M] complex.
    """
    B, Tl, _, R = fq.shape
    rt = jnp.result_type(jnp.float32, fq.dtype, jnp.real(lam).dtype)
    cc = jnp.result_type(rt, jnp.complex64)
    parts = [kt.astype(rt), vt.astype(rt)]
    if readout == "ratio":
        parts.append(jnp.ones((*vt.shape[:-1], 1), rt))
    z = jnp.concatenate(parts, axis=-1)  # [B, Tl, N, C]
    lam, b, c = lam.astype(cc), b.astype(cc), c.astype(cc)
    rank = lax.axis_index(axis)
    starts = np.zeros(Tl * world, dtype=bool)
    if cu_seqlens is not None:
        starts[list(cu_seqlens[:-1])] = True
    start = lax.dynamic_slice_in_dim(jnp.asarray(starts), rank * Tl, Tl)  # [Tl]
    a = jnp.where(start[:, None, None], 0, lam[None])[None, :, :, :, None]  # [1, Tl, N, M, 1]
    u = b[None, None, :, :, None] * z[:, :, :, None, :]  # [B, Tl, N, M, C]
    a = jnp.broadcast_to(a, (B, *a.shape[1:]))

    def combine(x: tuple[jax.Array, jax.Array], y: tuple[jax.Array, jax.Array]) -> Any:
        return x[0] * y[0], y[0] * x[1] + y[1]

    A, X0 = lax.associative_scan(combine, (a, u), axis=1)
    decays = lax.all_gather(A[:, -1], axis)  # [P, B, N, M, 1]
    finals = lax.all_gather(X0[:, -1], axis)  # [P, B, N, M, C]
    S = sharding.carry(decays, finals)[rank]  # (CP4)
    x = X0 + A * S[:, None]
    Y = jnp.einsum("nmk,btnkc->btnmc", c, x)  # (I12)
    dv = vt.shape[-1]
    w = jnp.einsum("btnmr,btnr->btnm", Y[..., :R], fq.astype(rt))
    o = jnp.einsum("btnm,btnmd->btnd", jnp.conj(w), Y[..., R : R + dv]).real  # (I13)
    if readout == "ratio":
        o = o / jnp.einsum("btnm,btnm->btn", jnp.conj(w), Y[..., R + dv]).real[..., None]
    return o.astype(fq.dtype)


# Wrappers over a mesh


def _specs(seq_axis: str, batch_axis: str | None, head_axis: str | None) -> tuple[P, P]:
    return P(batch_axis, seq_axis, head_axis, None), P(batch_axis, seq_axis, head_axis)


def _prepare(
    mesh: Mesh, seq_axis: str, layout: str, T: int, cu_seqlens: Sequence[int] | None
) -> tuple[int, np.ndarray, tuple[int, ...] | None]:
    if seq_axis not in mesh.axis_names:
        raise ValueError(f"seq_axis: {seq_axis!r} is not an axis of the mesh {mesh.axis_names}")
    world = mesh.shape[seq_axis]
    order = layout_order(T, world, layout)
    return world, order, _check_offsets(cu_seqlens, T)


def fpa_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    *,
    mesh: Mesh,
    seq_axis: str = "seq",
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: str = "contiguous",
    scale: float | None = None,
    cu_seqlens: Sequence[int] | None = None,
    return_lse: bool = False,
    sharding: Sharding = DEFAULT,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`attnspec.backends.jax.fpa.fpa_attention` with the sequence sharded over the mesh
    axis ``seq_axis`` (and batch / heads over ``batch_axis`` / ``head_axis`` if given).

    Whole arrays in the public layout [B, T, N, H]; usable under ``jit`` and ``grad``.
    """
    world, order, offsets = _prepare(mesh, seq_axis, layout, q.shape[1], cu_seqlens)
    inverse = np.argsort(order)
    big, small = _specs(seq_axis, batch_axis, head_axis)

    def body(*xs: jax.Array) -> tuple[jax.Array, jax.Array]:
        return fpa_shard(
            *xs,
            axis=seq_axis,
            world=world,
            layout=layout,
            scale=scale,
            cu_seqlens=offsets,
            sharding=sharding,
        )

    run = jax.shard_map(
        body, mesh=mesh, in_specs=(big, big, big, small, small), out_specs=(big, small)
    )
    o, lse = run(*(x[:, order] for x in (q, k, v, field, level)))
    o, lse = o[:, inverse], lse[:, inverse]
    return (o, lse) if return_lse else o


def fox_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_f: jax.Array,
    *,
    mesh: Mesh,
    seq_axis: str = "seq",
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: str = "contiguous",
    scale: float | None = None,
    cu_seqlens: Sequence[int] | None = None,
    sharding: Sharding = DEFAULT,
) -> jax.Array:
    """:func:`attnspec.backends.jax.fpa.fox_attention` sharded as :func:`fpa_attention`."""
    world, order, offsets = _prepare(mesh, seq_axis, layout, q.shape[1], cu_seqlens)
    big, small = _specs(seq_axis, batch_axis, head_axis)

    def body(*xs: jax.Array) -> jax.Array:
        return fox_shard(
            *xs,
            axis=seq_axis,
            world=world,
            layout=layout,
            scale=scale,
            cu_seqlens=offsets,
            sharding=sharding,
        )

    run = jax.shard_map(body, mesh=mesh, in_specs=(big, big, big, small), out_specs=big)
    return run(*(x[:, order] for x in (q, k, v, log_f)))[:, np.argsort(order)]


def interdomain_s4d(
    fq: jax.Array,
    kt: jax.Array,
    vt: jax.Array,
    lam: jax.Array,
    b: jax.Array,
    c: jax.Array,
    *,
    mesh: Mesh,
    seq_axis: str = "seq",
    batch_axis: str | None = None,
    head_axis: str | None = None,
    readout: str = "linear",
    cu_seqlens: Sequence[int] | None = None,
    sharding: Sharding = DEFAULT,
) -> jax.Array:
    """:func:`attnspec.backends.jax.interdomain.interdomain_s4d` with the sequence sharded
    (contiguous) over ``seq_axis``; lam, b, c replicated (or split over ``head_axis``)."""
    if readout not in ("linear", "ratio"):
        raise ValueError(f"readout: expected 'linear' or 'ratio', got {readout!r}")
    world, _, offsets = _prepare(mesh, seq_axis, "contiguous", fq.shape[1], cu_seqlens)
    big, _ = _specs(seq_axis, batch_axis, head_axis)
    par = P(head_axis, None)
    par3 = P(head_axis, None, None)

    def body(*xs: jax.Array) -> jax.Array:
        return s4d_shard(
            *xs, axis=seq_axis, world=world, readout=readout, cu_seqlens=offsets, sharding=sharding
        )

    run = jax.shard_map(body, mesh=mesh, in_specs=(big, big, big, par, par, par3), out_specs=big)
    return run(fq, kt, vt, lam, b, c)


__all__ = [
    "DEFAULT",
    "LAYOUTS",
    "Sharding",
    "fox_attention",
    "fox_shard",
    "fpa_attention",
    "fpa_shard",
    "interdomain_s4d",
    "layout_order",
    "s4d_shard",
]

"""Spec section 7 in JAX: the tiled segment minimum and the per-tile math of FPA and FoX.

The sequence is cut into nb blocks of ``bs`` positions. For a key block strictly before a query
block, the segment minimum of (F1) splits into three pieces (spec/fpa.md section 7):

    m_ij = min(A_j, mid, B_i),  A_j = min phi over (j, j1],  mid = min phi over (j1, i0),
                                B_i = min phi over [i0, i]

and FoX's decay D_ij = sum_{l in (j, i]} a_l (a = -log f >= 0) splits the same way into sums,
S_j + gap + P_i. Everything that runs along the sequence (prefix/suffix minima with their latest
argmins, the in-block segment minimum of the diagonal tiles, the argmin of each gap) is computed
here once, in O(T * bs) memory, so that the XLA loop (``blockwise``) and the Pallas kernels
(``fpa_pallas``) only do tile arithmetic. The per-tile functions below take arrays with any
leading dims: rows are the second-to-last axis of a tile, keys the last.

Argmin ties go to the latest position (G3): every (value, position) pair is ordered by value, then
by position descending.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# A running minimum along a scan: (value,) or, with argmins, (value, latest position).
Running = tuple[jax.Array, ...]
_Minima = tuple[Running, Running, Running]  # prefix, suffix, diagonal tile row


def _latest_min(a: Running, b: Running) -> tuple[jax.Array, jax.Array]:
    """Combine two (value, position) pairs: the smaller value; on ties, the later position."""
    a_val, a_pos = a
    b_val, b_pos = b
    take_a = (a_val < b_val) | ((a_val == b_val) & (a_pos > b_pos))
    return jnp.where(take_a, a_val, b_val), jnp.where(take_a, a_pos, b_pos)


class FieldTiles(NamedTuple):
    """Per-position pieces of the tiled segment minimum of a field (..., nb, bs).

    suffix_min (A_j), suffix_arg: min of phi over (j, j1] in j's block and its latest argmin,
    +inf / -1 at the last position of a block. prefix_min (B_i), prefix_arg: min over [i0, i].
    block_min, block_arg (..., nb): the minimum of each block and its latest argmin.
    diag_min (..., nb, bs, bs): the in-block segment minimum m_ij over (j, i], +inf for j >= i;
    diag_arg: its latest argmin. Positions are global indices into the padded sequence. The
    ``*_arg`` pieces are None when computed without argmins (the forward pass).
    """

    suffix_min: jax.Array
    suffix_arg: jax.Array | None
    prefix_min: jax.Array
    prefix_arg: jax.Array | None
    block_min: jax.Array
    block_arg: jax.Array | None
    diag_min: jax.Array
    diag_arg: jax.Array | None


def field_tiles(field: jax.Array, bs: int, argmins: bool = True) -> FieldTiles:
    """Spec section 7 pieces of ``field`` (..., T), T a multiple of ``bs``; O(T bs) work.

    One sequential scan over the positions of a block, vectorised over blocks and heads (it
    compiles much faster than ``lax.associative_scan`` for the same O(bs) steps per lane).
    Without ``argmins`` (the forward pass) the ``*_arg`` fields are None.
    """
    *lead, T = field.shape
    nb = T // bs
    phi = field.reshape(*lead, nb, bs)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32).reshape(nb, bs), phi.shape)
    cols = jnp.arange(bs)

    def pair(value: jax.Array, position: jax.Array) -> Running:
        return (value, position) if argmins else (value,)

    def least(a: Running, b: Running) -> Running:
        return _latest_min(a, b) if argmins else (jnp.minimum(a[0], b[0]),)

    def step(carry: _Minima, t: jax.Array) -> tuple[_Minima, _Minima]:
        prefix, suffix, diag = carry
        prefix = least(prefix, pair(phi[..., t], pos[..., t]))  # B over [i0, t]
        back = bs - 1 - t
        suffix = least(suffix, pair(phi[..., back], pos[..., back]))  # over [back, j1]
        # diagonal tile, row t: column j takes phi_t when j < t, so m_tj = min over (j, t]
        later = cols < t
        candidate = pair(
            jnp.where(later, phi[..., t, None], jnp.inf),
            jnp.where(later, pos[..., t, None], -1),
        )
        diag = least(diag, candidate)
        return (prefix, suffix, diag), (prefix, suffix, diag)

    none = pair(jnp.full_like(phi[..., 0], jnp.inf), jnp.full_like(pos[..., 0], -1))
    wide = pair(jnp.full_like(phi, jnp.inf), jnp.full_like(pos, -1))
    _, (prefix, suffix, diag) = lax.scan(step, (none, none, wide), jnp.arange(bs))
    # scan outputs lead with the step axis: rows of the diagonal tiles, positions otherwise
    prefix = tuple(jnp.moveaxis(x, 0, -1) for x in prefix)
    suffix = tuple(jnp.flip(jnp.moveaxis(x, 0, -1), -1) for x in suffix)  # inclusive over [j, j1]
    diag = tuple(jnp.moveaxis(x, 0, -2) for x in diag)
    # A_j over (j, j1]: the inclusive suffix shifted by one position.
    a_min = jnp.concatenate([suffix[0][..., 1:], jnp.full_like(phi[..., :1], jnp.inf)], -1)
    block_min, block_arg = block_minimum(phi, pos)
    if not argmins:
        return FieldTiles(a_min, None, prefix[0], None, block_min, None, diag[0], None)
    a_arg = jnp.concatenate([suffix[1][..., 1:], jnp.full_like(pos[..., :1], -1)], -1)
    return FieldTiles(a_min, a_arg, prefix[0], prefix[1], block_min, block_arg, diag[0], diag[1])


def block_minimum(phi: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The minimum of each block (last axis) and its latest argmin."""
    low = jnp.min(phi, axis=-1)
    return low, jnp.max(jnp.where(phi == low[..., None], pos, -1), axis=-1)


class DecayTiles(NamedTuple):
    """Per-position pieces of FoX's decay D_ij = sum_{l in (j, i]} a_l, a = -log f (..., nb, bs).

    suffix_sum (S_j): sum over (j, j1]; prefix_sum (P_i): sum over [i0, i]; block_sum (..., nb);
    diag_sum (..., nb, bs, bs): D_ij inside a block (0 for j >= i). Every piece sums only tokens
    of its own segment (j, i], all a_l >= 0: no difference of large partial sums, so float32
    keeps D to its own relative precision however large the decay before j.
    """

    suffix_sum: jax.Array
    prefix_sum: jax.Array
    block_sum: jax.Array
    diag_sum: jax.Array


def decay_tiles(log_f: jax.Array, bs: int) -> DecayTiles:
    """(F6) FoX's decay pieces for ``log_f`` (..., T), T a multiple of ``bs``; O(T bs) work."""
    *lead, T = log_f.shape
    a = -log_f.reshape(*lead, T // bs, bs)  # decay per token, >= 0
    prefix = jnp.cumsum(a, axis=-1)
    total = prefix[..., -1]
    suffix = jnp.flip(jnp.cumsum(jnp.flip(a, -1), axis=-1), -1)  # over [j, j1]
    suffix = jnp.concatenate([suffix[..., 1:], jnp.zeros_like(a[..., :1])], axis=-1)
    cols = jnp.arange(bs)

    def row(diag: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        # diagonal tile, row t: D_tj = D_{t-1,j} + a_t for j < t
        diag = diag + jnp.where(cols < t, a[..., t, None], 0.0)
        return diag, diag

    _, diag = lax.scan(row, jnp.zeros_like(a), jnp.arange(bs))
    return DecayTiles(suffix, prefix, total, jnp.moveaxis(diag, 0, -2))


# per-tile math


def diagonal_penalty(kind: str, diag: jax.Array, level_cols: jax.Array | None = None) -> jax.Array:
    """Penalty of a diagonal tile (rows i, keys j of one block); masked above the diagonal.

    fpa: pi_ij = max(0, l_j - m_ij), ``diag`` the in-block segment minimum (F2).
    fox: ``diag`` is D_ij, the decay over (j, i].
    """
    if kind == "fpa":
        assert level_cols is not None, "an fpa penalty needs the key levels"
        return jnp.maximum(0.0, level_cols[..., None, :] - diag)  # (F2)
    return diag


def offdiagonal_min(prefix_rows: jax.Array, suffix_cols: jax.Array, mid: jax.Array) -> jax.Array:
    """(F1) m_ij = min(A_j, mid, B_i) for a key block strictly before the query block."""
    m = jnp.minimum(suffix_cols[..., None, :], jnp.asarray(mid)[..., None, None])
    return jnp.minimum(m, prefix_rows[..., :, None])


def offdiagonal_penalty(
    kind: str, rows: jax.Array, cols: tuple[jax.Array, ...], gap: jax.Array
) -> jax.Array:
    """Penalty of a key block strictly before the query block.

    fpa: rows = B_i, cols = (A_j, l_j), gap = mid; pi_ij = max(0, l_j - min(A_j, mid, B_i)).
    fox: rows = P_i, cols = (S_j,), gap = the decay of the blocks in between; D = S_j + gap + P_i.
    """
    if kind == "fpa":
        suffix, level = cols
        return jnp.maximum(0.0, level[..., None, :] - offdiagonal_min(rows, suffix, gap))
    (suffix,) = cols
    return suffix[..., None, :] + jnp.asarray(gap)[..., None, None] + rows[..., :, None]


def extend_gap(kind: str, gap: jax.Array, block_stat: jax.Array) -> jax.Array:
    """Extend the gap by one more key block (visited from the diagonal outward); block_stat is
    the block's minimum (fpa) or its decay sum (fox)."""
    return jnp.minimum(gap, block_stat) if kind == "fpa" else gap + block_stat


def empty_gap(kind: str, like: jax.Array) -> jax.Array:
    """The gap between adjacent blocks: +inf for a minimum, 0 for a sum."""
    return jnp.full_like(like, jnp.inf if kind == "fpa" else 0.0)


def offdiagonal_regions(
    prefix_rows: jax.Array, suffix_cols: jax.Array, mid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Where the latest argmin of (j, i] lies (G3): in [i0, i] (B), in the gap, or in (j, j1].

    Ties go to the latest piece: B before the gap before A.
    """
    b = prefix_rows[..., :, None]
    a = suffix_cols[..., None, :]
    mid = jnp.asarray(mid)[..., None, None]
    in_b = b <= jnp.minimum(a, mid)
    in_mid = ~in_b & (mid <= a)
    return in_b, in_mid


def logit_cotangent(p: jax.Array, dp: jax.Array, delta: jax.Array) -> jax.Array:
    """G_ij = p_ij (<dO_i, v_j> - delta_i), delta_i = <dO_i, o_i> - dLSE_i (G1, G4)."""
    return p * (dp - delta[..., :, None])

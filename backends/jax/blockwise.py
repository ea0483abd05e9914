"""FPA and FoX blockwise in XLA: a scan over query blocks, a loop over key blocks from the
diagonal outward, carrying the running minimum (FoX: sum) of the gap (spec/fpa.md section 7).

Memory is O(T * bs): one (bs, bs) tile per head at a time, plus the per-position pieces of
``tiles``. Work is causal: query block i visits key blocks i, i-1, ..., 0 only. This is the CPU
path, the fallback of the Pallas kernels, and their twin in the tests.

Layout (blocked, internal): q (Z, G, nb, bs, dk) with Z = batch * kv heads and G query heads per
kv head (GQA); k (Z, nb, bs, dk); v (Z, nb, bs, dv); per-position arrays (Z, G, nb, bs);
segment ids (nb, bs) or None. Everything arrives in the compute dtype (float32 or float64).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from . import tiles

HIGHEST = lax.Precision.HIGHEST  # full float32 matmuls on GPUs too (no TF32)


class Penalties(NamedTuple):
    """What the penalty of a tile is made of: fpa uses level and ``field`` (tiles.FieldTiles);
    fox uses ``decay`` (tiles.DecayTiles)."""

    level: jnp.ndarray | None = None
    field: tiles.FieldTiles | None = None
    decay: tiles.DecayTiles | None = None


def _at(x, j, axis=2):
    return lax.dynamic_index_in_dim(x, j, axis, keepdims=False)


def _add_at(x, j, value, axis):
    return lax.dynamic_update_index_in_dim(x, _at(x, j, axis) + value, j, axis)


def _segment_mask(seg, i, j):
    """(bs, bs) True where row i and key j lie in the same packed sequence; None without."""
    if seg is None:
        return None
    return _at(seg, i, 0)[:, None] == _at(seg, j, 0)[None, :]


def _diagonal_tile(kind, pen: Penalties, i):
    """(penalty, m) of the diagonal tile of block i; m is the segment minimum (fpa only)."""
    if kind == "fpa":
        m = _at(pen.field.diag_min, i)
        return tiles.diagonal_penalty("fpa", m, _at(pen.level, i)), m
    return tiles.diagonal_penalty("fox", _at(pen.decay.diag_sum, i)), None


def _offdiagonal_tile(kind, pen: Penalties, i, j, gap):
    """(penalty, m) of key block j < i with the gap between them; m only for fpa."""
    if kind == "fpa":
        m = tiles.offdiagonal_min(_at(pen.field.prefix_min, i), _at(pen.field.suffix_min, j), gap)
        return jnp.maximum(0.0, _at(pen.level, j)[..., None, :] - m), m  # (F2)
    rows = _at(pen.decay.prefix_sum, i)
    cols = (_at(pen.decay.suffix_sum, j),)
    return tiles.offdiagonal_penalty("fox", rows, cols, gap), None


def _block_stat(kind, pen: Penalties, j):
    stat = pen.field.block_min if kind == "fpa" else pen.decay.block_sum
    return _at(stat, j)


def _logits(q_i, k_j, scale, penalty, mask):
    s = scale * jnp.einsum("zgid,zjd->zgij", q_i, k_j, precision=HIGHEST)  # (Z, G, bs, bs)
    logits = s - penalty  # (F3)
    return logits if mask is None else jnp.where(mask, logits, -jnp.inf)


def _causal(bs, seg_mask):
    below = jnp.arange(bs)[None, :] <= jnp.arange(bs)[:, None]
    return below if seg_mask is None else below & seg_mask


def forward(kind: str, q, k, v, pen: Penalties, seg, scale: float):
    """o (Z, G, nb, bs, dv) and lse (Z, G, nb, bs) by the online softmax of (F4)-(F5)."""
    nb, bs = q.shape[2], q.shape[3]

    def query_block(i):
        q_i = _at(q, i)  # (Z, G, bs, dk)
        penalty, _ = _diagonal_tile(kind, pen, i)
        mask = _causal(bs, _segment_mask(seg, i, i))
        logits = _logits(q_i, _at(k, i, 1), scale, penalty, mask)
        m = jnp.max(logits, axis=-1)  # finite: the diagonal key is always visible
        p = jnp.exp(logits - m[..., None])
        l = jnp.sum(p, axis=-1)
        acc = jnp.einsum("zgij,zjd->zgid", p, _at(v, i, 1), precision=HIGHEST)

        def key_block(t, carry):
            m, l, acc, gap = carry
            j = i - 1 - t  # from the diagonal outward
            penalty, _ = _offdiagonal_tile(kind, pen, i, j, gap)
            mask = _segment_mask(seg, i, j)
            logits = _logits(q_i, _at(k, j, 1), scale, penalty, mask)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(logits - m_new[..., None])
            l = l * correction + jnp.sum(p, axis=-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "zgij,zjd->zgid", p, _at(v, j, 1), precision=HIGHEST
            )
            return m_new, l, acc, tiles.extend_gap(kind, gap, _block_stat(kind, pen, j))

        gap = tiles.empty_gap(kind, m[..., 0])
        m, l, acc, _ = lax.fori_loop(0, i, key_block, (m, l, acc, gap))
        return acc / l[..., None], m + jnp.log(l)  # (F5), (F4)

    o, lse = lax.map(query_block, jnp.arange(nb))
    return jnp.moveaxis(o, 0, 2), jnp.moveaxis(lse, 0, 2)


class Partials(NamedTuple):
    """What the backward sweeps produce before the field cotangent is assembled.

    dq (Z, G, nb, bs, dk); dk, dv (Z, nb, bs, d) summed over the query heads of each group.
    fpa: row_b (Z, G, nb, bs) the sums of W_ij = G_ij active_ij whose argmin lies in [i0, i];
    col_a the sums whose argmin lies in (j, j1]; col_w all column sums of W (for dlevel);
    gap_sums (Z, G, nb, nb) [i, j] the sums whose argmin lies in the gap and gap_args the
    latest argmin of each gap (0 where empty); diag_w (Z, G, nb, bs, bs) W on the diagonal
    tiles. fox: row, col the row and column sums of G.
    """

    dq: jnp.ndarray
    dk: jnp.ndarray
    dv: jnp.ndarray
    row: jnp.ndarray
    col: jnp.ndarray
    col_w: jnp.ndarray | None = None
    gap_sums: jnp.ndarray | None = None
    gap_args: jnp.ndarray | None = None
    diag_w: jnp.ndarray | None = None


def extend_gap_argmin(gap, gap_arg, block_min, block_arg):
    """The gap's minimum and latest argmin after adding an earlier block: the block wins only
    when strictly lower (on ties the later position, already in the gap, stays)."""
    lower = block_min < gap
    return jnp.where(lower, block_min, gap), jnp.where(lower, block_arg, gap_arg)


def backward(kind: str, q, k, v, pen: Penalties, seg, scale: float, lse, do, delta) -> Partials:
    """One sweep over the tiles in the forward's order, recomputing p from lse (G1)-(G4).

    lse, delta (Z, G, nb, bs) with delta_i = <dO_i, o_i> - dLSE_i; do (Z, G, nb, bs, dv).
    """
    Z, G, nb, bs, _ = q.shape
    fpa = kind == "fpa"
    below = jnp.arange(bs)[None, :] < jnp.arange(bs)[:, None]

    def tile(q_i, do_i, lse_i, delta_i, j, penalty, mask):
        logits = _logits(q_i, _at(k, j, 1), scale, penalty, mask)
        p = jnp.exp(logits - lse_i[..., None])  # (F4), 0 where masked
        dp = jnp.einsum("zgid,zjd->zgij", do_i, _at(v, j, 1), precision=HIGHEST)
        g = tiles.logit_cotangent(p, dp, delta_i)  # (G1), (G4)
        dq = scale * jnp.einsum("zgij,zjd->zgid", g, _at(k, j, 1), precision=HIGHEST)
        dk = scale * jnp.einsum("zgij,zgid->zjd", g, q_i, precision=HIGHEST)
        dv = jnp.einsum("zgij,zgid->zjd", p, do_i, precision=HIGHEST)
        return g, dq, dk, dv

    def query_block(carry, i):
        dk, dv, col, col_a, col_w = carry
        q_i, do_i, lse_i, delta_i = _at(q, i), _at(do, i), _at(lse, i), _at(delta, i)
        penalty, m = _diagonal_tile(kind, pen, i)
        mask = _causal(bs, _segment_mask(seg, i, i))
        g, dq_i, dk_i, dv_i = tile(q_i, do_i, lse_i, delta_i, i, penalty, mask)
        dk, dv = _add_at(dk, i, dk_i, 1), _add_at(dv, i, dv_i, 1)
        if fpa:
            w = g * ((_at(pen.level, i)[..., None, :] >= m) & below)  # active_ij, j < i
            col_w = _add_at(col_w, i, jnp.sum(w, axis=-2), 2)
            row, diag_w = jnp.zeros_like(lse_i), w
        else:
            row, diag_w = jnp.sum(g, axis=-1), None
            col = _add_at(col, i, jnp.sum(g, axis=-2), 2)
        gap_sums = jnp.zeros((Z, G, nb), q.dtype) if fpa else None
        gap_args = jnp.zeros((Z, G, nb), jnp.int32) if fpa else None

        def key_block(t, inner):
            dq_i, row, gap_sums, gap_args, dk, dv, col, col_a, col_w, gap, gap_arg = inner
            j = i - 1 - t
            penalty, m = _offdiagonal_tile(kind, pen, i, j, gap)
            mask = _segment_mask(seg, i, j)
            g, dq_ij, dk_j, dv_j = tile(q_i, do_i, lse_i, delta_i, j, penalty, mask)
            dq_i = dq_i + dq_ij
            dk, dv = _add_at(dk, j, dk_j, 1), _add_at(dv, j, dv_j, 1)
            if fpa:
                w = g * (_at(pen.level, j)[..., None, :] >= m)  # active_ij (G2)
                col_w = _add_at(col_w, j, jnp.sum(w, axis=-2), 2)
                in_b, in_gap = tiles.offdiagonal_regions(
                    _at(pen.field.prefix_min, i), _at(pen.field.suffix_min, j), gap
                )
                row = row + jnp.sum(jnp.where(in_b, w, 0.0), axis=-1)  # (G3) argmin in B
                in_a = ~(in_b | in_gap)
                col_a = _add_at(col_a, j, jnp.sum(jnp.where(in_a, w, 0.0), axis=-2), 2)
                gap_sum = jnp.sum(jnp.where(in_gap, w, 0.0), axis=(-2, -1))
                gap_sums = lax.dynamic_update_index_in_dim(gap_sums, gap_sum, j, 2)
                gap_args = lax.dynamic_update_index_in_dim(gap_args, gap_arg, j, 2)
                gap, gap_arg = extend_gap_argmin(
                    gap, gap_arg, _at(pen.field.block_min, j), _at(pen.field.block_arg, j)
                )
            else:
                row = row + jnp.sum(g, axis=-1)
                col = _add_at(col, j, jnp.sum(g, axis=-2), 2)
                gap = tiles.extend_gap(kind, gap, _block_stat(kind, pen, j))
            return dq_i, row, gap_sums, gap_args, dk, dv, col, col_a, col_w, gap, gap_arg

        gap = tiles.empty_gap(kind, lse_i[..., 0])
        gap_arg = jnp.zeros(gap.shape, jnp.int32)
        inner = (dq_i, row, gap_sums, gap_args, dk, dv, col, col_a, col_w, gap, gap_arg)
        inner = lax.fori_loop(0, i, key_block, inner)
        dq_i, row, gap_sums, gap_args, dk, dv, col, col_a, col_w, _, _ = inner
        return (dk, dv, col, col_a, col_w), (dq_i, row, gap_sums, gap_args, diag_w)

    zeros_rows = jnp.zeros(lse.shape, q.dtype)  # (Z, G, nb, bs)
    carry = (
        jnp.zeros(k.shape, q.dtype),
        jnp.zeros((*k.shape[:-1], v.shape[-1]), q.dtype),
        zeros_rows,
        zeros_rows if fpa else None,
        zeros_rows if fpa else None,
    )
    (dk, dv, col, col_a, col_w), (dq, row, gap_sums, gap_args, diag_w) = lax.scan(
        query_block, carry, jnp.arange(nb)
    )
    dq, row = jnp.moveaxis(dq, 0, 2), jnp.moveaxis(row, 0, 2)
    if fpa:
        return Partials(
            dq,
            dk,
            dv,
            row,
            col_a,
            col_w,
            jnp.moveaxis(gap_sums, 0, 2),
            jnp.moveaxis(gap_args, 0, 2),
            jnp.moveaxis(diag_w, 0, 2),
        )
    return Partials(dq, dk, dv, row, col)

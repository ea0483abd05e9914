"""FPA and FoX blockwise in XLA: a scan over query blocks, a loop over key blocks from the
diagonal outward, carrying the running minimum (FoX: sum) of the gap (spec/fpa.md section 7).

Memory is O(T * bs): one (bs, bs) tile per head at a time, plus the per-position pieces of
``tiles``. Work is causal: query block i visits key blocks i, i-1, ..., 0 only (and the
backward's key sweep, key block j the query blocks j, ..., nb - 1). This is the CPU
path, the fallback of the Pallas kernels, and their twin in the tests.

Layout (blocked, internal): q (Z, G, nb, bs, dk) with Z = batch * kv heads and G query heads per
kv head (GQA); k (Z, nb, bs, dk); v (Z, nb, bs, dv); per-position arrays (Z, G, nb, bs);
segment ids (nb, bs) or None. Everything arrives in the compute dtype (float32 or float64).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import tiles

HIGHEST = lax.Precision.HIGHEST  # full float32 matmuls on GPUs too (no TF32)
_Online = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # online softmax: m, l, acc, gap


class Penalties(NamedTuple):
    """What the penalty of a tile is made of: fpa uses level and ``field`` (tiles.FieldTiles);
    fox uses ``decay`` (tiles.DecayTiles)."""

    level: jax.Array | None = None
    field: tiles.FieldTiles | None = None
    decay: tiles.DecayTiles | None = None

    def fpa(self) -> tuple[jax.Array, tiles.FieldTiles]:
        """(level, field) of fpa penalties (built with kind "fpa", see ``fpa._Blocked``)."""
        assert self.level is not None and self.field is not None, "not fpa penalties"
        return self.level, self.field

    def fox(self) -> tiles.DecayTiles:
        """The decay pieces of fox penalties."""
        assert self.decay is not None, "not fox penalties"
        return self.decay


def _at(x: jax.Array, j: int | jax.Array, axis: int = 2) -> jax.Array:
    return lax.dynamic_index_in_dim(x, j, axis, keepdims=False)


def _segment_mask(seg: jax.Array | None, i: jax.Array, j: jax.Array) -> jax.Array | None:
    """(bs, bs) True where row i and key j lie in the same packed sequence; None without."""
    if seg is None:
        return None
    return _at(seg, i, 0)[:, None] == _at(seg, j, 0)[None, :]


def _pair_mask(
    seg: jax.Array | None, window: int | None, bs: int, i: jax.Array, j: jax.Array
) -> jax.Array | None:
    """(bs, bs) mask of the pairs of query block i and key block j that may attend: the same
    packed sequence, and with the window W of (F3w) i - j < W; None when every pair may."""
    mask = _segment_mask(seg, i, j)
    if window is None:
        return mask
    rows = i * bs + jnp.arange(bs)[:, None]
    inside = rows - (j * bs + jnp.arange(bs)[None, :]) < window  # (F3w)
    return inside if mask is None else mask & inside


def _reach(window: int | None, bs: int, nb: int) -> int:
    """How many blocks left of the diagonal (key blocks) or below it (query blocks) meet the
    window W of (F3w): cdiv(W - 1, bs), the farther ones lying wholly outside; nb without."""
    return nb if window is None else min(nb, -(-(window - 1) // bs))


def _diagonal_tile(kind: str, pen: Penalties, i: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """(penalty, m) of the diagonal tile of block i; m is the segment minimum (fpa only)."""
    if kind == "fpa":
        level, field = pen.fpa()
        m = _at(field.diag_min, i)
        return tiles.diagonal_penalty("fpa", m, _at(level, i)), m
    return tiles.diagonal_penalty("fox", _at(pen.fox().diag_sum, i)), None


def _offdiagonal_tile(
    kind: str, pen: Penalties, i: jax.Array, j: jax.Array, gap: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """(penalty, m) of key block j < i with the gap between them; m only for fpa."""
    if kind == "fpa":
        level, field = pen.fpa()
        m = tiles.offdiagonal_min(_at(field.prefix_min, i), _at(field.suffix_min, j), gap)
        return jnp.maximum(0.0, _at(level, j)[..., None, :] - m), m  # (F2)
    decay = pen.fox()
    rows = _at(decay.prefix_sum, i)
    cols = (_at(decay.suffix_sum, j),)
    return tiles.offdiagonal_penalty("fox", rows, cols, gap), None


def _block_stat(kind: str, pen: Penalties, j: jax.Array) -> jax.Array:
    stat = pen.fpa()[1].block_min if kind == "fpa" else pen.fox().block_sum
    return _at(stat, j)


def _logits(
    q_i: jax.Array, k_j: jax.Array, scale: float, penalty: jax.Array, mask: jax.Array | None
) -> jax.Array:
    s = scale * jnp.einsum("zgid,zjd->zgij", q_i, k_j, precision=HIGHEST)  # (Z, G, bs, bs)
    logits = s - penalty  # (F3)
    return logits if mask is None else jnp.where(mask, logits, -jnp.inf)


def _causal(bs: int, seg_mask: jax.Array | None) -> jax.Array:
    below = jnp.arange(bs)[None, :] <= jnp.arange(bs)[:, None]
    return below if seg_mask is None else below & seg_mask


def forward(
    kind: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pen: Penalties,
    seg: jax.Array | None,
    scale: float,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """o (Z, G, nb, bs, dv) and lse (Z, G, nb, bs) by the online softmax of (F4)-(F5); with
    the window of (F3w), key blocks wholly outside it are not visited."""
    nb, bs = q.shape[2], q.shape[3]
    reach = _reach(window, bs, nb)

    def query_block(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        q_i = _at(q, i)  # (Z, G, bs, dk)
        penalty, _ = _diagonal_tile(kind, pen, i)
        mask = _causal(bs, _pair_mask(seg, window, bs, i, i))
        logits = _logits(q_i, _at(k, i, 1), scale, penalty, mask)
        m = jnp.max(logits, axis=-1)  # finite: the diagonal key is always visible
        p = jnp.exp(logits - m[..., None])
        l = jnp.sum(p, axis=-1)
        acc = jnp.einsum("zgij,zjd->zgid", p, _at(v, i, 1), precision=HIGHEST)

        def key_block(t: jax.Array, carry: _Online) -> _Online:
            m, l, acc, gap = carry
            j = i - 1 - t  # from the diagonal outward
            penalty, _ = _offdiagonal_tile(kind, pen, i, j, gap)
            mask = _pair_mask(seg, window, bs, i, j)
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
        m, l, acc, _ = lax.fori_loop(0, jnp.minimum(i, reach), key_block, (m, l, acc, gap))
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

    dq: jax.Array
    dk: jax.Array
    dv: jax.Array
    row: jax.Array
    col: jax.Array
    col_w: jax.Array | None = None
    gap_sums: jax.Array | None = None
    gap_args: jax.Array | None = None
    diag_w: jax.Array | None = None


def extend_gap_argmin(
    gap: jax.Array, gap_arg: jax.Array, block_min: jax.Array, block_arg: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The gap's minimum and latest argmin after adding an earlier block: the block wins only
    when strictly lower (on ties the later position, already in the gap, stays)."""
    lower = block_min < gap
    return jnp.where(lower, block_min, gap), jnp.where(lower, block_arg, gap_arg)


def backward(
    kind: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pen: Penalties,
    seg: jax.Array | None,
    scale: float,
    lse: jax.Array,
    do: jax.Array,
    delta: jax.Array,
    window: int | None = None,
) -> Partials:
    """Two sweeps that recompute p from lse (G1)-(G4), FlashAttention-2 style: one over query
    blocks (dq and the query side of the field cotangent), one over key blocks (dk, dv and the
    key side). Each sweep accumulates into its own block only: no carried (T, d) arrays.

    lse, delta (Z, G, nb, bs) with delta_i = <dO_i, o_i> - dLSE_i; do (Z, G, nb, bs, dv).
    window: the window of (F3w) (G_ij = 0 outside; blocks wholly outside not visited).
    """
    dq, row, gap_sums, gap_args, diag_w = _query_sweep(
        kind, q, k, v, pen, seg, scale, lse, do, delta, window
    )
    dk, dv, col, col_w = _key_sweep(kind, q, k, v, pen, seg, scale, lse, do, delta, window)
    return Partials(dq, dk, dv, row, col, col_w, gap_sums, gap_args, diag_w)


def _tile_cotangent(
    q_i: jax.Array,
    k_j: jax.Array,
    v_j: jax.Array,
    do_i: jax.Array,
    lse_i: jax.Array,
    delta_i: jax.Array,
    scale: float,
    penalty: jax.Array,
    mask: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """p_ij and G_ij of one tile, p recomputed from lse (F4), G by (G1) and (G4)."""
    p = jnp.exp(_logits(q_i, k_j, scale, penalty, mask) - lse_i[..., None])  # 0 where masked
    dp = jnp.einsum("zgid,zjd->zgij", do_i, v_j, precision=HIGHEST)
    return p, tiles.logit_cotangent(p, dp, delta_i)


def _active(level_j: jax.Array, m: jax.Array, below: jax.Array | None = None) -> jax.Array:
    """active_ij = [l_j >= m_ij] (G2), on the diagonal tile only for j < i."""
    active = level_j[..., None, :] >= m
    return active if below is None else active & below


# The carries of the sweeps' inner loops; the pieces only fpa has are None for fox.
# query sweep: dq, row, gap_sums, gap_args, gap, gap_arg
_QueryCarry = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array, jax.Array]
# key sweep: dk, dv, col, col_w, gap
_KeyCarry = tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array]


def _query_sweep(
    kind: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pen: Penalties,
    seg: jax.Array | None,
    scale: float,
    lse: jax.Array,
    do: jax.Array,
    delta: jax.Array,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """dq (Z, G, nb, bs, dk); fpa: row sums of W in region B, gap sums and argmins per tile,
    W of the diagonal tiles; fox: row sums of G."""
    Z, G, nb, bs, _ = q.shape
    fpa = kind == "fpa"
    below = jnp.arange(bs)[None, :] < jnp.arange(bs)[:, None]
    reach = _reach(window, bs, nb)

    def query_block(
        i: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
        q_i, do_i, lse_i, delta_i = _at(q, i), _at(do, i), _at(lse, i), _at(delta, i)
        penalty, m = _diagonal_tile(kind, pen, i)
        mask = _causal(bs, _pair_mask(seg, window, bs, i, i))
        _, g = _tile_cotangent(
            q_i, _at(k, i, 1), _at(v, i, 1), do_i, lse_i, delta_i, scale, penalty, mask
        )
        dq = jnp.einsum("zgij,zjd->zgid", g, _at(k, i, 1), precision=HIGHEST)
        diag_w: jax.Array | None
        if fpa:
            assert m is not None  # fpa tiles carry their segment minimum
            diag_w = jnp.where(_active(_at(pen.fpa()[0], i), m, below), g, 0.0)
            row = jnp.zeros_like(lse_i)
        else:
            diag_w, row = None, jnp.sum(g, axis=-1)
        gap_sums = jnp.zeros((Z, G, nb), q.dtype) if fpa else None
        gap_args = jnp.zeros((Z, G, nb), jnp.int32) if fpa else None

        def key_block(t: jax.Array, carry: _QueryCarry) -> _QueryCarry:
            dq, row, gap_sums, gap_args, gap, gap_arg = carry
            j = i - 1 - t
            penalty, m = _offdiagonal_tile(kind, pen, i, j, gap)
            _, g = _tile_cotangent(
                q_i,
                _at(k, j, 1),
                _at(v, j, 1),
                do_i,
                lse_i,
                delta_i,
                scale,
                penalty,
                _pair_mask(seg, window, bs, i, j),
            )
            dq = dq + jnp.einsum("zgij,zjd->zgid", g, _at(k, j, 1), precision=HIGHEST)
            if not fpa:
                return (
                    dq,
                    row + jnp.sum(g, axis=-1),
                    gap_sums,
                    gap_args,
                    tiles.extend_gap(kind, gap, _block_stat(kind, pen, j)),
                    gap_arg,
                )
            level, field = pen.fpa()
            # fpa: the tile's segment minimum, the gap carries, the backward's argmins
            assert m is not None and gap_sums is not None and gap_args is not None
            assert field.block_arg is not None
            w = jnp.where(_active(_at(level, j), m), g, 0.0)  # W_ij (G2)
            in_b, in_gap = tiles.offdiagonal_regions(
                _at(field.prefix_min, i), _at(field.suffix_min, j), gap
            )
            row = row + jnp.sum(jnp.where(in_b, w, 0.0), axis=-1)  # (G3) argmin in [i0, i]
            gap_sum = jnp.sum(jnp.where(in_gap, w, 0.0), axis=(-2, -1))  # argmin in the gap
            gap_sums = lax.dynamic_update_index_in_dim(gap_sums, gap_sum, j, 2)
            gap_args = lax.dynamic_update_index_in_dim(gap_args, gap_arg, j, 2)
            gap, gap_arg = extend_gap_argmin(
                gap, gap_arg, _at(field.block_min, j), _at(field.block_arg, j)
            )
            return dq, row, gap_sums, gap_args, gap, gap_arg

        gap = tiles.empty_gap(kind, lse_i[..., 0])
        carry = (dq, row, gap_sums, gap_args, gap, jnp.zeros(gap.shape, jnp.int32))
        dq, row, gap_sums, gap_args, _, _ = lax.fori_loop(
            0, jnp.minimum(i, reach), key_block, carry
        )
        return scale * dq, row, gap_sums, gap_args, diag_w

    dq, row, gap_sums, gap_args, diag_w = lax.map(query_block, jnp.arange(nb))
    if not fpa:  # lax.map passes fox's None pieces through
        return _blocks_third(dq), _blocks_third(row), None, None, None
    return (
        _blocks_third(dq),
        _blocks_third(row),
        _blocks_third(gap_sums),
        _blocks_third(gap_args),
        _blocks_third(diag_w),
    )


def _blocks_third(x: jax.Array) -> jax.Array:
    """A sweep's output stacked by lax.map, (nb, Z, G, ...) -> (Z, G, nb, ...)."""
    return jnp.moveaxis(x, 0, 2)


def _key_sweep(
    kind: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pen: Penalties,
    seg: jax.Array | None,
    scale: float,
    lse: jax.Array,
    do: jax.Array,
    delta: jax.Array,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """dk, dv (Z, nb, bs, d) summed over each GQA group; fpa: column sums of W in region A
    and of all W (for dlevel); fox: column sums of G."""
    nb, bs = q.shape[2], q.shape[3]
    fpa = kind == "fpa"
    below = jnp.arange(bs)[None, :] < jnp.arange(bs)[:, None]
    reach = _reach(window, bs, nb)

    def key_block(j: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        k_j, v_j = _at(k, j, 1), _at(v, j, 1)

        def tile(
            i: jax.Array, penalty: jax.Array, mask: jax.Array | None
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            q_i, do_i = _at(q, i), _at(do, i)
            p, g = _tile_cotangent(
                q_i, k_j, v_j, do_i, _at(lse, i), _at(delta, i), scale, penalty, mask
            )
            dk = jnp.einsum("zgij,zgid->zjd", g, q_i, precision=HIGHEST)
            dv = jnp.einsum("zgij,zgid->zjd", p, do_i, precision=HIGHEST)
            return g, dk, dv

        penalty, m = _diagonal_tile(kind, pen, j)
        g, dk, dv = tile(j, penalty, _causal(bs, _pair_mask(seg, window, bs, j, j)))
        col_w: jax.Array | None
        if fpa:
            assert m is not None  # fpa tiles carry their segment minimum
            col_w = jnp.sum(jnp.where(_active(_at(pen.fpa()[0], j), m, below), g, 0.0), axis=-2)
            col = jnp.zeros_like(col_w)
        else:
            col = jnp.sum(g, axis=-2)
            col_w = None

        def query_block(i: jax.Array, carry: _KeyCarry) -> _KeyCarry:
            dk, dv, col, col_w, gap = carry
            penalty, m = _offdiagonal_tile(kind, pen, i, j, gap)
            g, dk_i, dv_i = tile(i, penalty, _pair_mask(seg, window, bs, i, j))
            if fpa:
                level, field = pen.fpa()
                assert m is not None and col_w is not None  # fpa: the minimum, the W sums
                w = jnp.where(_active(_at(level, j), m), g, 0.0)  # W_ij (G2)
                col_w = col_w + jnp.sum(w, axis=-2)
                in_b, in_gap = tiles.offdiagonal_regions(
                    _at(field.prefix_min, i), _at(field.suffix_min, j), gap
                )
                col = col + jnp.sum(jnp.where(in_b | in_gap, 0.0, w), axis=-2)  # argmin in A
            else:
                col = col + jnp.sum(g, axis=-2)
            gap = tiles.extend_gap(kind, gap, _block_stat(kind, pen, i))
            return dk + dk_i, dv + dv_i, col, col_w, gap

        gap = tiles.empty_gap(kind, col[..., 0])
        carry = (dk, dv, col, col_w, gap)
        end = jnp.minimum(nb, j + 1 + reach)
        dk, dv, col, col_w, _ = lax.fori_loop(j + 1, end, query_block, carry)
        return scale * dk, dv, col, col_w

    dk, dv, col, col_w = lax.map(key_block, jnp.arange(nb))
    dk, dv = jnp.moveaxis(dk, 0, 1), jnp.moveaxis(dv, 0, 1)
    return dk, dv, jnp.moveaxis(col, 0, 2), None if col_w is None else jnp.moveaxis(col_w, 0, 2)

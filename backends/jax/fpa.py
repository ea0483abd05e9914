"""First Passage Attention and FoX in JAX: pure functions that compose with jit, grad and vmap.

Public layout (as ``jax.nn.dot_product_attention``): q ``[B, T, N, H]``; k ``[B, T, K, H]`` and
v ``[B, T, K, Hv]`` with K dividing N (GQA: query head n reads kv head n // (N / K)); per-token
scalars (field, level, log_f) ``[B, T, N]``, float32 or float64 (half precision is widened to
float32); o ``[B, T, N, Hv]`` in q's dtype; lse ``[B, T, N]`` float32 (float64 for float64
inputs). Packed sequences: B = 1 and static ``cu_seqlens`` offsets (0, ..., T), each segment an
independent sequence (a zero-length one contributes nothing).

Both ops are blockwise (spec/fpa.md section 7): time O(T^2 (dk + dv) / 2), memory O(T * bs) for
the forward and the backward. Gradients are a ``jax.custom_vjp`` that follows spec section 6
(active at zero, latest argmin); autodiff never runs through a min. ``implementation`` picks the
XLA loop (``blockwise``) or the Pallas kernels (``fpa_pallas``); both produce the same partial
sums, assembled into the field cotangent here. ``"mosaic"`` runs both passes on the Mosaic GPU
kernels (``fpa_mosaic``, 16-bit inputs), which produce the same partial sums too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from attnspec.reference.packing import Packing

from ..tile_sizes import JAX_BLOCK, fitted
from . import blockwise, tiles
from . import validation as check

IMPLEMENTATIONS = ("xla", "pallas", "mosaic")


@dataclass(frozen=True)
class AttentionConfig:
    """Static configuration of one call: a ``jit`` static argument and the ``custom_vjp``
    non-differentiable argument, so it is frozen and hashable.

    kind: "fpa" or "fox". scale: softmax scale s. block: the largest tile size (positions per
    block; short sequences use the next power of two >= 16). cu_seqlens: static packed-sequence
    offsets or None. implementation: "xla", "pallas" or "mosaic". interpret: run Pallas kernels
    in the Pallas interpreter (the CPU path of the kernels). window: None, or the window W of
    (F3w) (the XLA loop only).
    """

    kind: str
    scale: float
    block: int = JAX_BLOCK["xla"]
    cu_seqlens: tuple[int, ...] | None = None
    implementation: str = "xla"
    interpret: bool = False
    window: int | None = None


def tile_size(block: int, T: int) -> int:
    """Positions per tile: ``block``, or the next power of two >= max(T, 16) when T is short."""
    return fitted(block, T, 16)


def compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    """float64 when any input is float64, else float32: accumulation is never narrower."""
    return jnp.result_type(jnp.float32, *(a.dtype for a in arrays))


def _pad(x: jax.Array, Tp: int, axis: int) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, Tp - x.shape[axis])
    return jnp.pad(x, widths)


def _segments(cu_seqlens: tuple[int, ...] | None, Tp: int, bs: int) -> jax.Array | None:
    """Segment ids (nb, bs) of the packed sequences, padding in a segment of its own."""
    if cu_seqlens is None:
        return None
    seg = np.full(Tp, len(cu_seqlens), dtype=np.int32)
    seg[: cu_seqlens[-1]] = Packing(cu_seqlens).segment_ids()
    return jnp.asarray(seg.reshape(Tp // bs, bs))


class _Blocked:
    """The inputs of one call padded to whole tiles and blocked (see ``blockwise``)."""

    def __init__(
        self,
        cfg: AttentionConfig,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        scalars: tuple[jax.Array, ...],
        backward: bool = False,
    ) -> None:
        Z, G, T, dk = q.shape
        self.shape = (Z, G, T)
        # the Mosaic GPU kernels take whole 64-position tiles, short sequences padded
        self.bs = bs = cfg.block if cfg.implementation == "mosaic" else tile_size(cfg.block, T)
        self.Tp = Tp = -(-T // bs) * bs
        self.nb = nb = Tp // bs
        self.ct = ct = compute_dtype(q, *scalars)
        # The XLA loop computes in ct throughout; kernels load q, k, v as stored and cast.
        data = ct if cfg.implementation == "xla" else q.dtype
        self.q = _pad(q.astype(data), Tp, 2).reshape(Z, G, nb, bs, dk)
        self.k = _pad(k.astype(data), Tp, 1).reshape(Z, nb, bs, dk)
        self.v = _pad(v.astype(data), Tp, 1).reshape(Z, nb, bs, v.shape[-1])
        wide = [_pad(s.astype(ct), Tp, 2) for s in scalars]  # (Z, G, Tp)
        if cfg.kind == "fpa":
            field, level = wide
            self.pen = blockwise.Penalties(
                level=level.reshape(Z, G, nb, bs),
                field=tiles.field_tiles(field, bs, argmins=backward),  # argmins for (G3)
            )
        else:
            (log_f,) = wide
            self.pen = blockwise.Penalties(decay=tiles.decay_tiles(log_f, bs))
        self.seg = _segments(cfg.cu_seqlens, Tp, bs)

    def rows(self, x: jax.Array, dtype: DTypeLike | None = None) -> jax.Array:
        """(Z, G, T, ...) -> padded and blocked (Z, G, nb, bs, ...)."""
        Z, G, _ = self.shape
        return _pad(x.astype(dtype or self.ct), self.Tp, 2).reshape(
            Z, G, self.nb, self.bs, *x.shape[3:]
        )

    def unblock(self, x: jax.Array, axis: int = 2) -> jax.Array:
        """Blocked (..., nb, bs, ...) at ``axis`` -> (..., T, ...), padding dropped."""
        x = x.reshape(*x.shape[:axis], self.Tp, *x.shape[axis + 2 :])
        return jax.lax.slice_in_dim(x, 0, self.shape[2], axis=axis)


def _forward(
    cfg: AttentionConfig, q: jax.Array, k: jax.Array, v: jax.Array, scalars: tuple[jax.Array, ...]
) -> tuple[jax.Array, jax.Array]:
    x = _Blocked(cfg, q, k, v, scalars)
    args = (cfg.kind, x.q, x.k, x.v, x.pen, x.seg, cfg.scale)
    if cfg.implementation == "mosaic":
        from . import fpa_mosaic

        o, lse = fpa_mosaic.forward(*args, interpret=cfg.interpret)
    elif cfg.implementation == "pallas":
        from . import fpa_pallas

        o, lse = fpa_pallas.forward(*args, interpret=cfg.interpret)
    else:
        o, lse = blockwise.forward(*args, window=cfg.window)
    # lse keeps its padding (Z, G, Tp): the backward recomputes the padded rows from it.
    return x.unblock(o), lse.reshape(*x.shape[:2], x.Tp)


def _field_cotangent(parts: blockwise.Partials, field: tiles.FieldTiles) -> jax.Array:
    """(G3) scatter every W_ij to the latest argmin of its segment: row sums to the argmin of
    [i0, i], column sums to the argmin of (j, j1], gap sums to the argmin of the gap, and the
    diagonal tiles entry by entry. Entries with no argmin (-1) carry zero and are clipped."""
    Z, G, nb, bs = parts.row.shape
    pieces = [
        (field.prefix_arg, parts.row),
        (field.suffix_arg, parts.col),
        (parts.gap_args, parts.gap_sums),
        (field.diag_arg, parts.diag_w),
    ]
    positions, values = [], []
    for p, w in pieces:
        assert p is not None and w is not None  # the fpa backward computes all of them
        positions.append(jnp.maximum(p, 0).reshape(Z * G, -1))
        values.append(w.reshape(Z * G, -1))
    pos = jnp.concatenate(positions, axis=1)
    val = jnp.concatenate(values, axis=1)
    heads = jnp.arange(Z * G)[:, None]
    return jnp.zeros((Z * G, nb * bs), val.dtype).at[heads, pos].add(val).reshape(Z, G, -1)


def _backward(
    cfg: AttentionConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    scalars: tuple[jax.Array, ...],
    o: jax.Array,
    lse: jax.Array,
    do: jax.Array,
    dlse: jax.Array,
) -> tuple[jax.Array, ...]:
    x = _Blocked(cfg, q, k, v, scalars, backward=True)
    delta = jnp.sum(do.astype(x.ct) * o, axis=-1) - dlse.astype(x.ct)  # (Z, G, T)
    args = (
        cfg.kind,
        x.q,
        x.k,
        x.v,
        x.pen,
        x.seg,
        cfg.scale,
        lse.reshape(*x.shape[:2], x.nb, x.bs),
        x.rows(do, x.q.dtype),
        x.rows(delta),
    )
    if cfg.implementation == "mosaic":
        from . import fpa_mosaic

        parts = fpa_mosaic.backward(*args, interpret=cfg.interpret)
    elif cfg.implementation == "pallas":
        from . import fpa_pallas

        parts = fpa_pallas.backward(*args, interpret=cfg.interpret)
    else:
        parts = blockwise.backward(*args, window=cfg.window)
    dq = x.unblock(parts.dq).astype(q.dtype)
    dk = x.unblock(parts.dk, 1).astype(k.dtype)
    dv = x.unblock(parts.dv, 1).astype(v.dtype)
    if cfg.kind == "fpa":
        assert parts.col_w is not None  # the fpa backward sums W by column
        dfield = _field_cotangent(parts, x.pen.fpa()[1])[..., : x.shape[2]]
        dlevel = -x.unblock(parts.col_w)  # (G2)
        field, level = scalars
        return dq, dk, dv, dfield.astype(field.dtype), dlevel.astype(level.dtype)
    # FoX: dlog f_l = sum over pairs j < l <= i of G_ij = sum_{t >= l} (rows_t - cols_t).
    diff = (parts.row - parts.col).reshape(*x.shape[:2], x.Tp)
    dlog_f = jnp.flip(jnp.cumsum(jnp.flip(diff, -1), axis=-1), -1)[..., : x.shape[2]]
    return dq, dk, dv, dlog_f.astype(scalars[0].dtype)


# custom_vjp cores
# Internal layout: q (Z, G, T, dk), k (Z, T, dk), v (Z, T, dv), per-token scalars (Z, G, T).


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fpa_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    cfg: AttentionConfig,
) -> tuple[jax.Array, jax.Array]:
    return _fpa_core_fwd(q, k, v, field, level, cfg)[0]


def _fpa_core_fwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    cfg: AttentionConfig,
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    o, lse = _forward(cfg, q, k, v, (field, level))
    residuals = (q, k, v, field, level, o, lse)
    return (o.astype(q.dtype), lse[..., : q.shape[2]]), residuals


def _fpa_core_bwd(
    cfg: AttentionConfig,
    residuals: tuple[jax.Array, ...],
    cotangents: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, ...]:
    q, k, v, field, level, o, lse = residuals
    do, dlse = cotangents
    return _backward(cfg, q, k, v, (field, level), o, lse, do, dlse)


_fpa_core.defvjp(_fpa_core_fwd, _fpa_core_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fox_core(
    q: jax.Array, k: jax.Array, v: jax.Array, log_f: jax.Array, cfg: AttentionConfig
) -> tuple[jax.Array, jax.Array]:
    return _fox_core_fwd(q, k, v, log_f, cfg)[0]


def _fox_core_fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, log_f: jax.Array, cfg: AttentionConfig
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    o, lse = _forward(cfg, q, k, v, (log_f,))
    return (o.astype(q.dtype), lse[..., : q.shape[2]]), (q, k, v, log_f, o, lse)


def _fox_core_bwd(
    cfg: AttentionConfig,
    residuals: tuple[jax.Array, ...],
    cotangents: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, ...]:
    q, k, v, log_f, o, lse = residuals
    do, dlse = cotangents
    return _backward(cfg, q, k, v, (log_f,), o, lse, do, dlse)


_fox_core.defvjp(_fox_core_fwd, _fox_core_bwd)


# public layout


def _to_internal(
    q: jax.Array, k: jax.Array, v: jax.Array, scalars: tuple[jax.Array, ...]
) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """[B, T, N, H] -> q (B*K, G, T, H), k and v (B*K, T, .), scalars (B*K, G, T)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    q = q.transpose(0, 2, 1, 3).reshape(B * K, G, T, H)
    k = k.transpose(0, 2, 1, 3).reshape(B * K, T, H)
    v = v.transpose(0, 2, 1, 3).reshape(B * K, T, v.shape[-1])
    scalars = tuple(s.transpose(0, 2, 1).reshape(B * K, G, T) for s in scalars)
    return q, k, v, scalars


def _from_internal(o: jax.Array, lse: jax.Array, B: int) -> tuple[jax.Array, jax.Array]:
    ZG = o.shape[0] * o.shape[1]
    T = o.shape[2]
    o = o.reshape(B, ZG // B, T, o.shape[-1]).transpose(0, 2, 1, 3)
    lse = lse.reshape(B, ZG // B, T).transpose(0, 2, 1)
    return o, lse


@functools.partial(jax.jit, static_argnums=(5,))
def _fpa_public(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    cfg: AttentionConfig,
) -> tuple[jax.Array, jax.Array]:
    qi, ki, vi, (f, lev) = _to_internal(q, k, v, (field, level))
    o, lse = _fpa_core(qi, ki, vi, f, lev, cfg)
    return _from_internal(o, lse, q.shape[0])


@functools.partial(jax.jit, static_argnums=(4,))
def _fox_public(
    q: jax.Array, k: jax.Array, v: jax.Array, log_f: jax.Array, cfg: AttentionConfig
) -> tuple[jax.Array, jax.Array]:
    qi, ki, vi, (lf,) = _to_internal(q, k, v, (log_f,))
    o, lse = _fox_core(qi, ki, vi, lf, cfg)
    return _from_internal(o, lse, q.shape[0])


def _check_qkv(q: ArrayLike, k: ArrayLike, v: ArrayLike) -> tuple[jax.Array, jax.Array, jax.Array]:
    q = check.array("q", q, 4, meaning="[B, T, N, H]")
    B, T, N, H = q.shape
    check.length("q", T)
    if H < 1:
        raise ValueError(f"q: expected a head dim H >= 1, got shape {q.shape}")
    k = check.array("k", k, 4, meaning="[B, T, K, H]")
    check.same_dtype("k", k, q, "q")
    K = k.shape[2]
    if K < 1 or N % K:
        raise ValueError(f"k: expected a number of heads K dividing N = {N} (GQA), got {K}")
    check.shape("k", k, (B, T, K, H), "[B, T, K, H], B, T and H of q")
    v = check.array("v", v, 4, meaning="[B, T, K, Hv]")
    check.same_dtype("v", v, q, "q")
    if v.shape[:3] != (B, T, K) or v.shape[3] < 1:
        raise ValueError(f"v: expected shape {(B, T, K)} + (Hv,) (B, T, K of k), got {v.shape}")
    return q, k, v


def _check_scalar(
    name: str, x: ArrayLike, q: jax.Array, validate: bool, nonpositive: bool = False
) -> jax.Array:
    x = check.array(name, x, 3, meaning="[B, T, N]")
    check.shape(name, x, q.shape[:3], "[B, T, N]: B, T and N of q")
    if validate:
        check.check_values(name, x, nonpositive=nonpositive)
    return check.widened(x)


def _empty_batch(
    q: jax.Array, v: jax.Array, scalars: tuple[jax.Array, ...]
) -> tuple[jax.Array, jax.Array]:
    """B = 0 [decision, as jax.nn.dot_product_attention]: empty o and lse, no kernel run; the
    gradients of the empty inputs are empty."""
    B, T, N, _ = q.shape
    lse_dtype = compute_dtype(q, *scalars)
    return jnp.zeros((B, T, N, v.shape[-1]), q.dtype), jnp.zeros((B, T, N), lse_dtype)


def _config(
    kind: str,
    q: jax.Array,
    v: jax.Array,
    scale: float | None,
    cu_seqlens: Sequence[int] | None,
    implementation: str | None,
    block_size: int | None,
    interpret: bool | None,
    window: int | None = None,
) -> AttentionConfig:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window: expected an integer >= 1 or None, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"window: expected an integer >= 1 or None, got {window!r}")
    if implementation is None:
        implementation = "xla" if window is not None else _default_implementation(q, v)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: expected one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    block = JAX_BLOCK[implementation] if block_size is None else block_size
    if isinstance(block, bool) or not isinstance(block, int) or block < 16 or block & (block - 1):
        raise ValueError(f"block_size: expected a power of two >= 16, got {block_size!r}")
    if implementation == "mosaic":
        from . import fpa_mosaic

        if block != fpa_mosaic.BLOCK:
            raise ValueError(f"block_size: the Mosaic GPU kernels use 64, got {block_size!r}")
        _, T, _, dk = q.shape
        reason = fpa_mosaic.supports(q.dtype, jnp.float32, block, dk, v.shape[-1], T)
        if reason is not None:
            raise ValueError(f"implementation='mosaic': {reason}")
    if window is not None and implementation != "xla":
        raise ValueError(
            f"window: the window of (F3w) runs on implementation='xla' only, got "
            f"implementation={implementation!r}"
        )
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return AttentionConfig(
        kind,
        check.scale(scale, q.shape[-1]),
        block,
        check.offsets(cu_seqlens, q.shape[0], q.shape[1]),
        implementation,
        bool(interpret),
        window,
    )


def _default_implementation(q: jax.Array, v: jax.Array) -> str:
    """On a GPU: the Pallas kernels where JAX lowers them through Triton without a deprecation
    (JAX < 0.11), else the Mosaic GPU kernels for 16-bit inputs; the XLA loop otherwise."""
    if jax.default_backend() != "gpu":
        return "xla"
    from . import fpa_mosaic, fpa_pallas

    if fpa_pallas.triton_lowering_available():
        return "pallas"
    _, T, _, dk = q.shape
    reason = fpa_mosaic.supports(q.dtype, jnp.float32, fpa_mosaic.BLOCK, dk, v.shape[-1], T)
    return "mosaic" if reason is None else "xla"


@overload
def fpa_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = ...,
    cu_seqlens: Sequence[int] | None = ...,
    window: int | None = ...,
    return_lse: Literal[False] = ...,
    implementation: str | None = ...,
    block_size: int | None = ...,
    interpret: bool | None = ...,
    validate: bool = ...,
) -> jax.Array: ...


@overload
def fpa_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = ...,
    cu_seqlens: Sequence[int] | None = ...,
    window: int | None = ...,
    return_lse: Literal[True],
    implementation: str | None = ...,
    block_size: int | None = ...,
    interpret: bool | None = ...,
    validate: bool = ...,
) -> tuple[jax.Array, jax.Array]: ...


def fpa_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    cu_seqlens: Sequence[int] | None = None,
    window: int | None = None,
    return_lse: bool = False,
    implementation: str | None = "xla",
    block_size: int | None = None,
    interpret: bool | None = None,
    validate: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """First Passage Attention, (F1)-(F5), blockwise; gradients by (G1)-(G4).

    Args:
        q: [B, T, N, H] queries (float64, float32, float16 or bfloat16).
        k: [B, T, K, H] keys, v: [B, T, K, Hv] values, dtype of q; K divides N (GQA).
        field, level: [B, T, N] float32 or float64: the field phi and the key levels l;
            float16 and bfloat16 are widened to float32 (they carry no more precision than
            they arrive with).
        scale: softmax scale s (static); default 1/sqrt(H).
        cu_seqlens: static offsets (0, ..., T) of packed sequences; needs B = 1.
        window: None, or the static window W >= 1 of (F3w): query i sees keys i-W+1..i
            (flash-linear-attention's ``window_size``); the XLA loop only (None picks it).
        return_lse: also return lse [B, T, N] (float32, float64 for float64 inputs).
        implementation: "xla" (the blockwise XLA loop), "pallas" (the Pallas kernels, compiled
            through Triton on JAX < 0.11), "mosaic" (the Mosaic GPU kernels: Hopper, 16-bit
            inputs, float32 field and level, tiles of 64), or
            None (on a GPU: pallas on JAX < 0.11, else mosaic where it applies; XLA elsewhere).
        block_size: the largest tile size, a power of two >= 16 (default 128 for XLA, 64 for
            Pallas). interpret: run Pallas in its interpreter (default: on CPU).
        validate: check field and level for NaN/Inf when called eagerly (see ``validation``).

    Returns:
        o [B, T, N, Hv] in q's dtype, or (o, lse). An empty batch (B = 0) gives empty outputs,
        as ``jax.nn.dot_product_attention``; a zero-length packed sequence contributes nothing.

    Time O(B N T^2 (H + Hv) / 2); memory O(B N T (H + Hv + block)).
    """
    q, k, v = _check_qkv(q, k, v)
    field = _check_scalar("field", field, q, validate)
    level = _check_scalar("level", level, q, validate)
    cfg = _config("fpa", q, v, scale, cu_seqlens, implementation, block_size, interpret, window)
    if q.shape[0] == 0:
        o, lse = _empty_batch(q, v, (field, level))
    else:
        o, lse = _fpa_public(q, k, v, field, level, cfg)
    return (o, lse) if return_lse else o


@overload
def fox_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = ...,
    cu_seqlens: Sequence[int] | None = ...,
    window: int | None = ...,
    return_lse: Literal[False] = ...,
    implementation: str | None = ...,
    block_size: int | None = ...,
    interpret: bool | None = ...,
    validate: bool = ...,
) -> jax.Array: ...


@overload
def fox_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = ...,
    cu_seqlens: Sequence[int] | None = ...,
    window: int | None = ...,
    return_lse: Literal[True],
    implementation: str | None = ...,
    block_size: int | None = ...,
    interpret: bool | None = ...,
    validate: bool = ...,
) -> tuple[jax.Array, jax.Array]: ...


def fox_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    cu_seqlens: Sequence[int] | None = None,
    window: int | None = None,
    return_lse: bool = False,
    implementation: str | None = "xla",
    block_size: int | None = None,
    interpret: bool | None = None,
    validate: bool = True,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Forgetting Transformer attention (F6): a_ij = s <q_i, k_j> + sum_{l in (j, i]} log f_l.

    The arguments of flash-linear-attention's ``parallel_forgetting_attn(q, k, v, g, scale=None,
    window_size=None, cu_seqlens=None)`` (``window`` for window_size, keyword only here), in
    the JAX layout. Decay sums stay local to a tile (offsets carried across
    tiles), so long T costs no precision.

    Args:
        q: [B, T, N, H]; k: [B, T, K, H]; v: [B, T, K, Hv] (K divides N).
        log_f: [B, T, N] log forget gates, all <= 0: float32 or float64, or float16 and
            bfloat16 as ``parallel_forgetting_attn`` takes them, widened to float32 (they
            carry no more precision than they arrive with).
        scale, cu_seqlens, window, return_lse, implementation, block_size, interpret, validate:
            as for :func:`fpa_attention` (validate also rejects log gates > 0).

    Returns:
        o [B, T, N, Hv] in q's dtype, or (o, lse).

    Time O(B N T^2 (H + Hv) / 2); memory O(B N T (H + Hv + block)).
    """
    q, k, v = _check_qkv(q, k, v)
    log_f = _check_scalar("log_f", log_f, q, validate, nonpositive=True)
    cfg = _config("fox", q, v, scale, cu_seqlens, implementation, block_size, interpret, window)
    if q.shape[0] == 0:
        o, lse = _empty_batch(q, v, (log_f,))
    else:
        o, lse = _fox_public(q, k, v, log_f, cfg)
    return (o, lse) if return_lse else o


__all__ = ["AttentionConfig", "fox_attention", "fpa_attention", "tile_size"]

"""Interdomain Attention in JAX: the LegS projection (I2)-(I5) and the S4D core (I11)-(I13).

Public layout: fq, fk, kt ``[B, T, N, R]``; v, vt ``[B, T, N, Hv]``; complex S4D parameters as
complex arrays, lam and b ``[N, M]``, c ``[N, M, M]``; o ``[B, T, N, Hv]`` in the dtype of fq.
Computation in float32 / complex64 (float64 / complex128 for float64 inputs). Both ops are
chunked: within a chunk of L tokens a few dense contractions, across chunks a scan over the
states (nc = T / L steps); gradients are JAX's autodiff of these (no min, no tie rule).

S4D (I11)-(I13) per head, with u_t = x^k_t fq_t (M,) and Q = C^H C (the readout only needs the
Gram matrix): o_t = Re(u_t^H Q x^v_t). Inside a chunk starting after state x_prev,
x_{t0+p} = Lambda^(p+1) x_prev + sum_{q<=p} Lambda^(p-q) b z_{t0+q}.

LegS (I5) is time-varying, c_n = E_n c_{n-1} + F_n f_n with E_n, F_n from
``attnspec.reference.hippo.legs_step``; the products of E's across a chunk are precomputed on the
host (float64) once per (T, M, L), so the readout (I3) never materialises a state per token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike
from numpy.typing import NDArray

from attnspec.reference import hippo
from attnspec.reference.packing import Packing
from attnspec.reference.validation import positive_int

from ..tile_sizes import JAX_CHUNK, fitted
from . import validation as check

HIGHEST = lax.Precision.HIGHEST
READOUTS = ("linear", "ratio")


def chunk_size(chunk: int, T: int) -> int:
    """Tokens per chunk: ``chunk``, or the next power of two >= max(T, 8) when T is short."""
    return fitted(chunk, T, 8)


def _pad_time(x: jax.Array, Tp: int, axis: int = 2) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, Tp - x.shape[axis])
    return jnp.pad(x, widths)


def _chunks(x: jax.Array, L: int) -> jax.Array:
    """(B, N, Tp, d) -> (B, N, nc, L, d)."""
    return x.reshape(*x.shape[:2], x.shape[2] // L, L, *x.shape[3:])


def _einsum(spec: str, *args: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *args, precision=HIGHEST)


# S4D


class _SegmentGates(TypedDict):
    """Static masks of packed sequences for the chunked recurrence (see ``_segment_gates``)."""

    same: jax.Array
    carry_in: jax.Array
    carry_out: jax.Array
    tail: jax.Array


def _segment_gates(cu_seqlens: tuple[int, ...] | None, Tp: int, L: int) -> _SegmentGates | None:
    """Static masks of packed sequences for the chunked recurrence (None without packing).

    same (nc, L, L): token q may reach token p inside the chunk; carry_in (nc, L): the state
    before the chunk reaches token p; carry_out (nc,): it survives to the chunk's end;
    tail (nc, L): token q reaches the chunk's end.
    """
    if cu_seqlens is None:
        return None
    ids = np.full(Tp, len(cu_seqlens), dtype=np.int64)
    ids[: cu_seqlens[-1]] = Packing(cu_seqlens).segment_ids()
    seg = ids.reshape(-1, L)
    before = np.concatenate([[-1], seg[:-1, -1]])  # segment of the token before each chunk
    return _SegmentGates(
        same=jnp.asarray(seg[:, :, None] == seg[:, None, :]),
        carry_in=jnp.asarray(seg == before[:, None]),
        carry_out=jnp.asarray(seg[:, -1] == before),
        tail=jnp.asarray(seg == seg[:, -1:]),
    )


def _s4d_core(
    fq: jax.Array,
    kt: jax.Array,
    vt: jax.Array,
    lam: jax.Array,
    b: jax.Array,
    c: jax.Array,
    readout: str,
    cu_seqlens: tuple[int, ...] | None,
    chunk: int,
) -> jax.Array:
    """(I11)-(I13) on the internal layout (B, N, T, .); lam, b (N, M), c (N, M, M) complex."""
    B, N, T, _R = fq.shape
    L = chunk_size(chunk, T)
    Tp = -(-T // L) * L
    if readout == "ratio":
        vt = jnp.concatenate([vt, jnp.ones((*vt.shape[:-1], 1), vt.dtype)], axis=-1)
    fq, kt, vt = (_chunks(_pad_time(x, Tp), L) for x in (fq, kt, vt))  # (B, N, nc, L, .)
    gates = _segment_gates(cu_seqlens, Tp, L)

    # Lambda^n for n = 0..L by cumulative products, not exp(n log Lambda): a mode with
    # Lambda = 0 (it forgets at once) has no logarithm, and its gradient stays finite.
    factors = jnp.broadcast_to(lam[:, None, :], (lam.shape[0], L, lam.shape[1]))
    powers = jnp.cumprod(jnp.concatenate([jnp.ones_like(factors[:, :1]), factors], axis=1), axis=1)
    p = jnp.arange(L)
    lag = p[:, None] - p[None, :]  # (L, L): p - q
    causal = lag >= 0
    decay = powers[:, jnp.where(causal, lag, 0)]  # (N, L, L, M): Lambda^(p - q)
    kernel = jnp.where(causal[None, :, :, None], decay, 0) * b[:, None, None, :]  # (N, L, L, M)
    entry = powers[:, 1:]  # (N, L, M): Lambda^(p+1)
    tail = powers[:, L - 1 - p] * b[:, None, :]  # (N, L, M): Lambda^(L-1-p) b
    gram = _einsum("nkm,nkl->nml", jnp.conj(c), c)  # Q = C^H C (N, M, M)

    scores = _einsum("bncpr,bncqr->bncpq", fq, kt)  # fq_p . kt_q (B, N, nc, L, L)
    if gates is not None:
        scores = jnp.where(gates["same"], scores, 0.0)
        tail = tail[:, None] * gates["tail"][None, :, :, None]  # (N, nc, L, M)
        inputs = "nclm"
    else:
        inputs = "nlm"
    # state increments of each chunk, then the states before each chunk by a scan over chunks
    d_key = _einsum(f"{inputs},bnclr->bncmr", tail, kt)  # (B, N, nc, M, R)
    d_val = _einsum(f"{inputs},bncld->bncmd", tail, vt)
    through = powers[:, L][None, :, :, None]  # (1, N, M, 1): Lambda^L
    keep = jnp.ones(fq.shape[2], fq.dtype) if gates is None else gates["carry_out"].astype(fq.dtype)

    def carry(
        state: tuple[jax.Array, jax.Array], step: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        x_key, x_val = state
        dk, dv, kept = step
        nxt = (kept * through * x_key + dk, kept * through * x_val + dv)  # (I11)
        return nxt, state

    zero = (jnp.zeros_like(d_key[:, :, 0]), jnp.zeros_like(d_val[:, :, 0]))
    steps = (jnp.moveaxis(d_key, 2, 0), jnp.moveaxis(d_val, 2, 0), keep)
    _, (x_key, x_val) = lax.scan(carry, zero, steps)
    x_key, x_val = jnp.moveaxis(x_key, 0, 2), jnp.moveaxis(x_val, 0, 2)  # before each chunk

    enter = entry[None, :, None]  # (1, N, 1, L, M)
    if gates is not None:
        enter = enter * gates["carry_in"][None, None, :, :, None]
    u = _einsum("bncpq,npqm->bncpm", scores, kernel)  # within the chunk
    u = u + enter * _einsum("bncpr,bncmr->bncpm", fq, x_key)  # from the carried state
    w = _einsum("bncpm,nmk->bncpk", jnp.conj(u), gram)  # u^H Q
    o = _einsum("bncpk,bnckd->bncpd", w * enter, x_val).real  # (I13) carried part
    weights = _einsum("bncpk,npqk->bncpq", w, kernel).real  # Re(u_p^H Q Lambda^(p-q) b)
    if gates is not None:
        weights = jnp.where(gates["same"], weights, 0.0)
    o = o + _einsum("bncpq,bncqd->bncpd", weights, vt)  # (I13) in-chunk part
    o = o.reshape(B, N, Tp, -1)[:, :, :T]
    if readout == "ratio":
        return o[..., :-1] / o[..., -1:]  # (I13) ratio readout
    return o


@functools.partial(jax.jit, static_argnames=("readout", "cu_seqlens", "chunk"))
def _s4d_public(
    fq: jax.Array,
    kt: jax.Array,
    vt: jax.Array,
    lam: jax.Array,
    b: jax.Array,
    c: jax.Array,
    *,
    readout: str,
    cu_seqlens: tuple[int, ...] | None,
    chunk: int,
) -> jax.Array:
    ct = jnp.result_type(jnp.float32, fq.dtype, jnp.real(lam).dtype)
    cc = jnp.result_type(ct, jnp.complex64)
    to = lambda x: x.transpose(0, 2, 1, 3).astype(ct)  # noqa: E731  [B,T,N,.] -> (B,N,T,.)
    o = _s4d_core(
        to(fq),
        to(kt),
        to(vt),
        lam.astype(cc),
        b.astype(cc),
        c.astype(cc),
        readout,
        cu_seqlens,
        chunk,
    )
    return o.transpose(0, 2, 1, 3).astype(fq.dtype)


def _check_features(
    names: tuple[str, str, str], arrays: tuple[ArrayLike, ArrayLike, ArrayLike], meaning: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    fq = check.array(names[0], arrays[0], 4, meaning=meaning)
    B, T, N, R = fq.shape
    check.length(names[0], T)
    second = check.array(names[1], arrays[1], 4, meaning=meaning)
    check.same_dtype(names[1], second, fq, names[0])
    check.shape(names[1], second, (B, T, N, R), f"[B, T, N, R] as {names[0]}")
    third = check.array(names[2], arrays[2], 4, meaning="[B, T, N, Hv]")
    check.same_dtype(names[2], third, fq, names[0])
    if third.shape[:3] != (B, T, N) or third.shape[3] < 1:
        raise ValueError(
            f"{names[2]}: expected shape {(B, T, N)} + (Hv,) (B, T, N of {names[0]}), "
            f"got {third.shape}"
        )
    return fq, second, third


# complex parameters; real float32/float64 ones are accepted as complex with zero imaginary part
COMPLEX = (jnp.dtype(jnp.complex64), jnp.dtype(jnp.complex128), *check.WIDE)


def _check_ssm(
    lam: ArrayLike, b: ArrayLike, c: ArrayLike, heads: int, validate: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    lam = check.array("lam", lam, 2, dtypes=COMPLEX, meaning="[N, M]")
    if lam.shape[0] != heads or lam.shape[1] < 1:
        raise ValueError(f"lam: expected shape ({heads}, M) (N heads of fq), got {lam.shape}")
    M = lam.shape[1]
    b = check.array("b", b, 2, dtypes=COMPLEX, meaning="[N, M]")
    check.shape("b", b, (heads, M), "[N, M] as lam")
    c = check.array("c", c, 3, dtypes=COMPLEX, meaning="[N, M, M]")
    check.shape("c", c, (heads, M, M), "[N, M, M], M from lam")
    if validate:
        for name, x in (("lam", lam), ("b", b), ("c", c)):
            check.check_values(name, x)
        if check.concrete(lam) and bool(jnp.any(jnp.abs(lam) > 1)):
            raise ValueError("lam: expected |Lambda| <= 1 (a stable recurrence), got a larger one")
    return lam, b, c


def interdomain_s4d(
    fq: ArrayLike,
    kt: ArrayLike,
    vt: ArrayLike,
    lam: ArrayLike,
    b: ArrayLike,
    c: ArrayLike,
    *,
    readout: str = "linear",
    cu_seqlens: Sequence[int] | None = None,
    chunk: int = JAX_CHUNK["s4d"],
    validate: bool = True,
) -> jax.Array:
    """The S4D core of the Interdomain layer, (I11)-(I13), chunked.

    Args:
        fq: [B, T, N, R] query features xi(q); kt: [B, T, N, R] SSM key inputs k~;
            vt: [B, T, N, Hv] SSM value inputs v~ (float64, float32, float16 or bfloat16).
        lam, b: [N, M] complex; c: [N, M, M] complex (complex64 or complex128).
        readout: "linear" (denominator-free, the default) or "ratio".
        cu_seqlens: static offsets (0, ..., T) of packed sequences; needs B = 1.
        chunk: tokens per chunk (static).
        validate: check lam, b, c for NaN/Inf and |Lambda| <= 1 when called eagerly.

    Returns:
        o [B, T, N, Hv] in fq's dtype.

    Time O(B N T (L (M + R + Hv) + M (R + Hv + M))) for chunk L; memory O(B N T (L + M)).
    """
    if readout not in READOUTS:
        raise ValueError(f"readout: expected one of {READOUTS}, got {readout!r}")
    fq, kt, vt = _check_features(("fq", "kt", "vt"), (fq, kt, vt), "[B, T, N, R]")
    lam, b, c = _check_ssm(lam, b, c, fq.shape[2], validate)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected a positive int, got {chunk!r}")
    offsets = check.offsets(cu_seqlens, fq.shape[0], fq.shape[1])
    if fq.shape[0] == 0:  # an empty batch [decision, as SDPA]: gradients are empty or zero
        return jnp.zeros(vt.shape, fq.dtype)
    return _s4d_public(fq, kt, vt, lam, b, c, readout=readout, cu_seqlens=offsets, chunk=chunk)


# S4D decode


class S4DState(NamedTuple):
    """The fixed-size recurrent state of :func:`interdomain_s4d` (H6): x [B, N, M, C] complex,
    C = R + Hv (+ 1 for the ratio readout's constant channel). It never grows with T."""

    x: jax.Array


def s4d_state(
    batch: int,
    heads: int,
    M: int,
    R: int,
    Hv: int,
    *,
    readout: str = "linear",
    dtype: DTypeLike | None = None,
) -> S4DState:
    """The zero state before the first token [B, N, M, C]; dtype complex64 (default) or
    complex128. Memory O(B N M (R + Hv))."""
    if readout not in READOUTS:
        raise ValueError(f"readout: expected one of {READOUTS}, got {readout!r}")
    C = R + Hv + (readout == "ratio")
    return S4DState(jnp.zeros((batch, heads, M, C), dtype or jnp.complex64))


def interdomain_s4d_step(
    state: S4DState,
    fq: ArrayLike,
    kt: ArrayLike,
    vt: ArrayLike,
    lam: ArrayLike,
    b: ArrayLike,
    c: ArrayLike,
    *,
    readout: str = "linear",
) -> tuple[jax.Array, S4DState]:
    """One token of :func:`interdomain_s4d`, (I11)-(I13): fq, kt [B, N, R], vt [B, N, Hv] ->
    (o [B, N, Hv] in fq's dtype, the next state). Equals the parallel op token by token (H6).
    Time O(B N M (M + R + Hv)); memory O(B N M (R + Hv)), independent of T."""
    if readout not in READOUTS:
        raise ValueError(f"readout: expected one of {READOUTS}, got {readout!r}")
    fq = check.array("fq", fq, 3, meaning="[B, N, R]")
    kt = check.array("kt", kt, 3, meaning="[B, N, R]")
    check.shape("kt", kt, fq.shape, "[B, N, R] as fq")
    vt = check.array("vt", vt, 3, meaning="[B, N, Hv]")
    if vt.shape[:2] != fq.shape[:2]:
        raise ValueError(f"vt: expected shape {fq.shape[:2]} + (Hv,) (B, N of fq), got {vt.shape}")
    lam, b, c = _check_ssm(lam, b, c, fq.shape[1], validate=False)
    C = fq.shape[2] + vt.shape[2] + (readout == "ratio")
    expected = (*fq.shape[:2], lam.shape[1], C)
    check.shape("state", state.x, expected, "[B, N, M, R + Hv (+1 for ratio)]")
    return _s4d_step(state, fq, kt, vt, lam, b, c, readout)


@functools.partial(jax.jit, static_argnums=(7,))
def _s4d_step(
    state: S4DState,
    fq: jax.Array,
    kt: jax.Array,
    vt: jax.Array,
    lam: jax.Array,
    b: jax.Array,
    c: jax.Array,
    readout: str,
) -> tuple[jax.Array, S4DState]:
    R, Hv = fq.shape[-1], vt.shape[-1]
    parts = [kt, vt] + ([jnp.ones((*vt.shape[:-1], 1), vt.dtype)] if readout == "ratio" else [])
    z = jnp.concatenate(parts, axis=-1).astype(jnp.real(state.x).dtype)  # (B, N, C)
    x = lam[..., None] * state.x + b[..., None] * z[:, :, None, :]  # (I11)
    y = _einsum("nmk,bnkc->bnmc", c.astype(x.dtype), x)  # (I12)
    a = _einsum("bnmr,bnr->bnm", y[..., :R], fq.astype(z.dtype))  # U_t fq_t
    o = _einsum("bnm,bnmd->bnd", jnp.conj(a), y[..., R : R + Hv]).real  # (I13)
    if readout == "ratio":
        o = o / _einsum("bnm,bnm->bn", jnp.conj(a), y[..., R + Hv]).real[..., None]
    return o.astype(fq.dtype), S4DState(x)


# LegS


@functools.lru_cache(maxsize=2)
def legs_chunk_operators(T: int, M: int, L: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(I5) across chunks of L tokens, float64: ``hippo.legs_chunk_products`` by chunk.

    entry[c, p] (nc, L, M, M) = E_{t0+p+1} ... E_{t0+1}: the state before chunk c carried to
    token p of the chunk (t0 = c L; 1-based steps). inject[c, p, q] (nc, L, L, M) =
    E_{t0+p+1} ... E_{t0+q+2} F_{t0+q+1} for q <= p, else 0: token q's input in the state at p.
    Time O(T M^2 (M + L)) once per (T, M, L); memory O(T M (M + L)).
    """
    entry, inject = hippo.legs_chunk_products(M, L, T)
    nc = T // L
    return entry.reshape(nc, L, M, M), inject.reshape(nc, L, L, M)


def _legs_core(
    fq: jax.Array, fk: jax.Array, v: jax.Array, entry: jax.Array, inject: jax.Array
) -> jax.Array:
    """(I3) with the coefficients of (I5), chunk by chunk; internal layout (B, N, T, .)."""
    B, N, T, _R = fq.shape
    nc, L, _M, _ = entry.shape
    Tp = nc * L
    ones = jnp.ones((*v.shape[:-1], 1), v.dtype)
    values = jnp.concatenate([v, ones], axis=-1)  # [v, 1]: Gamma and eta share the recurrence
    fq, fk, values = (_chunks(_pad_time(x, Tp), L) for x in (fq, fk, values))
    last = inject[:, L - 1]  # (nc, L, M): each token's input at the chunk's end
    d_key = _einsum("cqm,bncqr->bncmr", last, fk)  # (B, N, nc, M, R)
    d_val = _einsum("cqm,bncqd->bncmd", last, values)
    through = entry[:, L - 1]  # (nc, M, M)

    def carry(
        state: tuple[jax.Array, jax.Array], step: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        u, g = state
        dk, dv, E = step
        nxt = (_einsum("mk,bnkr->bnmr", E, u) + dk, _einsum("mk,bnkd->bnmd", E, g) + dv)
        return nxt, state  # (I5) state before this chunk

    zero = (jnp.zeros_like(d_key[:, :, 0]), jnp.zeros_like(d_val[:, :, 0]))
    _, (U, Gam) = lax.scan(
        carry, zero, (jnp.moveaxis(d_key, 2, 0), jnp.moveaxis(d_val, 2, 0), through)
    )
    U, Gam = jnp.moveaxis(U, 0, 2), jnp.moveaxis(Gam, 0, 2)  # (B, N, nc, M, .)

    scores = _einsum("bncpr,bncqr->bncpq", fq, fk)  # fq_p . fk_q
    a = _einsum("cpmk,bncpk->bncpm", entry, _einsum("bnckr,bncpr->bncpk", U, fq))
    a = a + _einsum("cpqm,bncpq->bncpm", inject, scores)  # a_p = U_p fq_p (I3)
    carried = _einsum("cpkm,bncpk->bncpm", entry, a)  # entry^T a
    num_den = _einsum("bncmd,bncpm->bncpd", Gam, carried)
    weights = _einsum("cpqm,bncpm->bncpq", inject, a)
    num_den = num_den + _einsum("bncpq,bncqd->bncpd", weights, values)
    num_den = num_den.reshape(B, N, Tp, -1)[:, :, :T]  # padding dropped before dividing:
    return num_den[..., :-1] / num_den[..., -1:]  # (I3) its 0/0 would poison the gradients


@functools.partial(jax.jit, static_argnums=(5,))
def _legs_public(
    fq: jax.Array,
    fk: jax.Array,
    v: jax.Array,
    entry: jax.Array,
    inject: jax.Array,
    dtype_name: str,
) -> jax.Array:
    ct = jnp.dtype(dtype_name)
    to = lambda x: x.transpose(0, 2, 1, 3).astype(ct)  # noqa: E731
    o = _legs_core(to(fq), to(fk), to(v), entry.astype(ct), inject.astype(ct))
    return o.transpose(0, 2, 1, 3).astype(fq.dtype)


def interdomain_legs(
    fq: ArrayLike, fk: ArrayLike, v: ArrayLike, M: int, *, chunk: int = JAX_CHUNK["legs"]
) -> jax.Array:
    """Interdomain attention with the HiPPO-LegS basis: (I2)/(I5) coefficients, (I3) readout.

    Args:
        fq, fk: [B, T, N, R] features (float64, float32, float16 or bfloat16); v: [B, T, N, Hv].
        M: basis size (static). chunk: tokens per chunk (static).

    Returns:
        o [B, T, N, Hv] in fq's dtype.

    Time O(B N T (M (M + R + Hv) + L (M + R + Hv))) plus the host constants of
    :func:`legs_chunk_operators`; memory O(B N T (L + M) + T M (M + L)).
    """
    fq, fk, v = _check_features(("fq", "fk", "v"), (fq, fk, v), "[B, T, N, R]")
    M = positive_int("M", M)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected a positive int, got {chunk!r}")
    if fq.shape[0] == 0:  # an empty batch [decision, as SDPA]
        return jnp.zeros(v.shape, fq.dtype)
    T = fq.shape[1]
    L = chunk_size(chunk, T)
    entry, inject = legs_chunk_operators(-(-T // L) * L, int(M), L)
    ct = jnp.result_type(jnp.float32, fq.dtype)
    return _legs_public(fq, fk, v, jnp.asarray(entry, ct), jnp.asarray(inject, ct), ct.name)

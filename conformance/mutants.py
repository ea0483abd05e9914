"""Deliberately wrong backends: the kit's self-test.

Each mutant is the reference backend with one error, written the way an implementation really
goes wrong: the errors listed in spec/conformance.md ("mutation testing"), and the ways tiled
kernels go wrong (a term lost at a tile border past some length, a head-dim tail, tie rules
across tiles, half-precision accumulation, a field rounded to the input dtype, a fixed-size
cache, varlen and GQA indexing, in-place updates of inputs, gradients of the wrong dtype). The
kit's tests assert that every mutant is caught by at least one case while the reference passes
everything. A kit that cannot fail proves nothing. Select one with
``attnspec conformance --backend attnspec.conformance.mutants:SumNotMax``.

Each mutant names the ops it changes (``ops``) and the dtype in which the kit must catch it
(``caught_in``): some errors only show below float64 (a missing row maximum underflows in
float32; half-precision accumulation needs float16).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from itertools import pairwise
from typing import Any, ClassVar, cast
from unittest import mock

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import logsumexp

from attnspec.reference import fpa, hippo
from attnspec.reference import interdomain as idm

from .numpy_backend import FloatArray, NumpyBackend

BLOCK = 64  # the tile size of the mutants that imitate tiled kernels


def _causal(T: int) -> NDArray[np.bool_]:
    return np.tril(np.ones((T, T), dtype=bool))


def _attend(
    logits: NDArray[np.float64], v: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Causal softmax of logits (..., T, T) and the weighted values; returns (o, lse)."""
    a = np.where(_causal(logits.shape[-1]), logits, -np.inf)
    lse = logsumexp(a, axis=-1)
    return np.exp(a - lse[..., None]) @ v, lse


def _tile(positions: ArrayLike) -> NDArray[np.intp]:
    return np.asarray(positions, dtype=np.intp) // BLOCK


class Mutant(NumpyBackend):
    """The reference backend, without the optional features unless a mutant is about them."""

    FEATURES: ClassVar[tuple[str, ...]] = ()
    SESSIONS: ClassVar[tuple[str, ...]] = ()  # decode sessions: conformance/session_mutants.py
    ops: ClassVar[tuple[str, ...]] = ()
    caught_in: ClassVar[str] = "float64"
    # Case-id prefixes that catch it (each of their cases fails), for the mutants written
    # with the families that catch them; the earlier mutants are run on every case of their ops.
    caught_by: ClassVar[tuple[str, ...]] = ()


# FPA/FoX


class _FPAMutant(Mutant):
    """FPA (and FoX through F6) from overridable pieces: logits, penalty and softmax."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def logits(
        self, q: NDArray[np.float64], k: NDArray[np.float64], s: float
    ) -> NDArray[np.float64]:
        return s * q @ np.swapaxes(k, -1, -2)

    def depth(self, field: NDArray[np.float64], level: NDArray[np.float64]) -> NDArray[np.float64]:
        return fpa.descent_depth(field, level)

    def attend(
        self, logits: NDArray[np.float64], v: NDArray[np.float64], dtype: np.dtype[Any]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        return _attend(logits, v)

    def fpa_attention(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        scale: float | None = None,
        return_lse: bool = False,
    ) -> FloatArray | tuple[FloatArray, NDArray[np.float64]]:
        s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        q64, k64, v64 = (np.asarray(x, float) for x in (q, k, v))
        penalty = self.depth(np.asarray(field, float), np.asarray(level, float))
        o, lse = self.attend(self.logits(q64, k64, s) - penalty, v64, q.dtype)
        return (o.astype(q.dtype), lse) if return_lse else o.astype(q.dtype)

    def fox_attention(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        log_f: FloatArray,
        *,
        scale: float | None = None,
    ) -> FloatArray:
        c = np.cumsum(np.asarray(log_f, float), axis=-1)
        o = self.fpa_attention(q, k, v, c, c, scale=scale)
        return cast(FloatArray, o)  # without return_lse: o alone


class ClosedSegment(_FPAMutant):
    """Segment [j, i] instead of (j, i]: the key's own field value enters the minimum."""

    def depth(self, field: NDArray[np.float64], level: NDArray[np.float64]) -> NDArray[np.float64]:
        m = np.minimum(fpa.segment_min(field), field[..., None, :])  # adds t = j
        return np.maximum(0.0, level[..., None, :] - m)


class SumNotMax(_FPAMutant):
    """The total descent l_j - phi_i (a FoX-like sum) instead of the deepest one."""

    def depth(self, field: NDArray[np.float64], level: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.maximum(0.0, level[..., None, :] - field[..., :, None])


class NoClamp(_FPAMutant):
    """pi = l_j - m_ij without max(0, .): keys below the field get a bonus."""

    def depth(self, field: NDArray[np.float64], level: NDArray[np.float64]) -> NDArray[np.float64]:
        T = field.shape[-1]
        raw = level[..., None, :] - fpa.segment_min(field)
        return np.where(np.tril(np.ones((T, T), dtype=bool), k=-1), raw, 0.0)


class ForgottenGap(_FPAMutant):
    """A tiled kernel (tiles of 64) that forgets the running minimum of the gap between a key
    tile and a query tile that are not adjacent: m_ij = min(A_j, B_i) only. It only differs
    from the reference past T = 128."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention",)

    def depth(self, field: NDArray[np.float64], level: NDArray[np.float64]) -> NDArray[np.float64]:
        T = field.shape[-1]
        m = fpa.segment_min(field)
        pos = np.arange(T)
        start = _tile(pos) * BLOCK  # first position of each position's tile
        end = np.minimum(start + BLOCK, T) - 1
        # A_j = min over (j, end of j's tile]; B_i = min over [start of i's tile, i].
        A = np.array(
            [m[..., end[j], j] if end[j] > j else np.full(m.shape[:-2], np.inf) for j in range(T)]
        )
        A = np.moveaxis(A, 0, -1)
        B = np.stack([field[..., start[i] : i + 1].min(axis=-1) for i in range(T)], axis=-1)
        far = _tile(pos)[None, :] < _tile(pos)[:, None] - 1  # tiles with a gap between them
        m = np.where(far, np.minimum(A[..., None, :], B[..., :, None]), m)
        return np.maximum(0.0, level[..., None, :] - m)


class HeadDimTail(_FPAMutant):
    """A kernel with one key-dim block of 64 in its off-diagonal tiles: dims past 64 are lost
    whenever key and query lie in different tiles."""

    def logits(
        self, q: NDArray[np.float64], k: NDArray[np.float64], s: float
    ) -> NDArray[np.float64]:
        full = s * q @ np.swapaxes(k, -1, -2)
        head = s * q[..., :BLOCK] @ np.swapaxes(k[..., :BLOCK], -1, -2)
        pos = np.arange(q.shape[-2])
        off_diagonal = _tile(pos)[None, :] < _tile(pos)[:, None]
        return np.where(off_diagonal, head, full)


class NoScale(Mutant):
    """The softmax scale is ignored (s = 1)."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def fpa_attention(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        scale: float | None = None,
        return_lse: bool = False,
    ) -> FloatArray | tuple[FloatArray, NDArray[np.float64]]:
        return super().fpa_attention(q, k, v, field, level, scale=1.0, return_lse=return_lse)

    def fox_attention(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        log_f: FloatArray,
        *,
        scale: float | None = None,
    ) -> FloatArray:
        return super().fox_attention(q, k, v, log_f, scale=1.0)


class BackwardDefaultScale(Mutant):
    """The backward pass ignores a non-default scale and uses 1/sqrt(dk)."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        params = {k: v for k, v in params.items() if k != "scale"}
        return super().vjp(op, inputs, params, cotangents)


class NoRowMax(_FPAMutant):
    """Softmax without subtracting the row maximum, in the dtype of q: exp overflows for logits
    in the hundreds and underflows to 0 / 0 for rows whose logits are all near -200."""

    caught_in: ClassVar[str] = "float32"

    def attend(
        self, logits: NDArray[np.float64], v: NDArray[np.float64], dtype: np.dtype[Any]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        work = np.float64 if dtype == np.float64 else np.float32
        a = np.where(_causal(logits.shape[-1]), logits, -np.inf).astype(work)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            e = np.exp(a)
            total = e.sum(axis=-1)
            return (e @ v.astype(work)) / total[..., None], np.log(total)


class HalfAccumulation(_FPAMutant):
    """The softmax sum and the weighted sum of values accumulated in float16 (each partial sum
    rounded), as a kernel that keeps its accumulators in the input dtype."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention",)
    caught_in: ClassVar[str] = "float16"

    def attend(
        self, logits: NDArray[np.float64], v: NDArray[np.float64], dtype: np.dtype[Any]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        if dtype != np.float16:
            return _attend(logits, v)
        a = np.where(_causal(logits.shape[-1]), logits, -np.inf)
        m = a.max(axis=-1, keepdims=True)
        p = np.exp(a - m).astype(np.float16)
        total = np.add.accumulate(p, axis=-1, dtype=np.float16)[..., -1]
        terms = (p[..., :, :, None] * v.astype(np.float16)[..., None, :, :]).astype(np.float16)
        o = np.add.accumulate(terms, axis=-2, dtype=np.float16)[..., -1, :]
        return o.astype(float) / total.astype(float)[..., None], np.log(total) + m[..., 0]


class FieldInInputDtype(_FPAMutant):
    """field and level rounded to the dtype of q before the penalty arithmetic."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention",)
    caught_in: ClassVar[str] = "float16"

    def fpa_attention(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        scale: float | None = None,
        return_lse: bool = False,
    ) -> FloatArray | tuple[FloatArray, NDArray[np.float64]]:
        with np.errstate(over="ignore"):  # a 1e30 descent becomes inf, as it would on a GPU
            field, level = np.asarray(field).astype(q.dtype), np.asarray(level).astype(q.dtype)
        return super().fpa_attention(q, k, v, field, level, scale=scale, return_lse=return_lse)


class DiagonalDroppedInRaggedTail(_FPAMutant):
    """When T is not a multiple of the tile, the last query loses its own key (an off-by-one in
    the mask of the ragged tail tile): one row of T is wrong."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention",)
    caught_in: ClassVar[str] = "float16"

    def attend(
        self, logits: NDArray[np.float64], v: NDArray[np.float64], dtype: np.dtype[Any]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        T = logits.shape[-1]
        if T % BLOCK and T > 1:
            logits = logits.copy()
            logits[..., T - 1, T - 1] = -np.inf
        return _attend(logits, v)


def _earliest_segment_argmin(field: ArrayLike) -> NDArray[np.int64]:
    """t*_ij with ties sent to the EARLIEST minimiser (the wrong convention)."""
    field = np.asarray(field, dtype=float)
    m = fpa.segment_min(field)
    tstar = np.full(m.shape, -1, dtype=np.int64)
    for i in range(1, field.shape[-1]):
        newest = field[..., i, None] < m[..., i - 1, :i]  # strict: ties keep the older t
        tstar[..., i, :i] = np.where(newest, i, tstar[..., i - 1, :i])
    return tstar


def _tiled_segment_argmin(field: ArrayLike) -> NDArray[np.int64]:
    """t*_ij latest within a tile of 64, but the EARLIEST tile holding the minimum wins."""
    field = np.asarray(field, dtype=float)
    m = fpa.segment_min(field)
    tstar = np.full(m.shape, -1, dtype=np.int64)
    for i in range(1, field.shape[-1]):
        before, where = m[..., i - 1, :i], tstar[..., i - 1, :i]  # over (j, i - 1]
        new = field[..., i, None]
        same_tile = _tile(where) == _tile(i)
        take = (new < before) | ((new == before) & same_tile)
        tstar[..., i, :i] = np.where(take, i, where)
    return tstar


class EarliestArgmin(Mutant):
    """The backward of (G3) sends the field cotangent to the earliest argmin on ties."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention",)

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        with mock.patch.object(fpa, "segment_argmin", _earliest_segment_argmin):
            return super().vjp(op, inputs, params, cotangents)


class TieAcrossTiles(Mutant):
    """(G3) ties go to the latest position inside a tile of 64, but across tiles the earlier
    tile keeps the cotangent (a merge of per-tile argmins that compares with '<')."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention",)

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        with mock.patch.object(fpa, "segment_argmin", _tiled_segment_argmin):
            return super().vjp(op, inputs, params, cotangents)


class ZeroLevelGradient(Mutant):
    """A backward kernel that never writes dL/dlevel: the buffer stays zero."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention",)

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        grads = super().vjp(op, inputs, params, cotangents)
        if "level" in grads:
            grads["level"] = np.zeros_like(grads["level"])
        return grads


class Float64Gradients(Mutant):
    """Gradients returned in float64 whatever the dtype of the inputs."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")
    caught_in: ClassVar[str] = "float16"

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        return {
            n: np.asarray(g, np.float64)
            for n, g in self._vjp(op, inputs, params, cotangents).items()
        }


class InPlaceCumsum(Mutant):
    """FoX that turns log_f into its cumulative sum in place (right outputs, clobbered input)."""

    ops: ClassVar[tuple[str, ...]] = ("fox_attention",)

    def fox_attention(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        log_f: FloatArray,
        *,
        scale: float | None = None,
    ) -> FloatArray:
        c = np.cumsum(log_f, axis=-1, out=log_f)
        return self.fpa_attention(q, k, v, c, c, scale=scale)


class VarlenBackwardLeak(Mutant):
    """Packed sequences: the forward respects cu_seqlens, the backward ignores it, so gradients
    flow across segment borders."""

    FEATURES: ClassVar[tuple[str, ...]] = ("fpa_attention.varlen", "fox_attention.varlen")
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        params = {k: v for k, v in params.items() if k != "cu_seqlens"}
        return super().vjp(op, inputs, params, cotangents)


class GQAWrongHead(Mutant):
    """GQA with query head h reading key/value head h % H_kv instead of h // (H / H_kv)."""

    FEATURES: ClassVar[tuple[str, ...]] = ("fpa_attention.gqa", "fox_attention.gqa")
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def _patched(self) -> AbstractContextManager[Any]:
        from . import numpy_backend

        def tile_heads(x: FloatArray, H: int, name: str) -> FloatArray:
            return np.tile(x, (1,) * (x.ndim - 3) + (H // x.shape[-3], 1, 1))

        def sum_tiled(g: NDArray[np.float64], H_kv: int) -> NDArray[np.float64]:
            *lead, H, T, D = g.shape
            return g.reshape(*lead, H // H_kv, H_kv, T, D).sum(axis=-4)

        return mock.patch.multiple(
            numpy_backend, _heads_for_queries=tile_heads, _sum_groups=sum_tiled
        )

    def fpa_attention(self, *args: Any, **kwargs: Any) -> Any:
        with self._patched():
            return super().fpa_attention(*args, **kwargs)

    def fox_attention(self, *args: Any, **kwargs: Any) -> Any:
        with self._patched():
            return super().fox_attention(*args, **kwargs)

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        with self._patched():
            return super().vjp(op, inputs, params, cotangents)


# decode


class EagerEviction(Mutant):
    """Decoding that evicts at theta / 4: unsafe, and keeps too few keys."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_decode",)

    def fpa_decode(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        theta: float,
        scale: float | None = None,
    ) -> tuple[FloatArray, float]:
        return super().fpa_decode(q, k, v, field, level, theta=theta / 4, scale=scale)


class StrictEviction(Mutant):
    """Evicts when pi > theta instead of pi >= theta (F7)."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_decode",)

    def fpa_decode(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        theta: float,
        scale: float | None = None,
    ) -> tuple[FloatArray, float]:
        strict = float(np.nextafter(theta, np.inf))  # pi >= nextafter(theta) <=> pi > theta
        return super().fpa_decode(q, k, v, field, level, theta=strict, scale=scale)


class _RingBufferDecoder(fpa.FPADecoder):
    """A cache of at most 128 entries that overwrites its oldest entry when full."""

    capacity = 128

    def step(
        self, q: ArrayLike, k: ArrayLike, v: ArrayLike, field: float, level: float
    ) -> NDArray[np.float64]:
        if self.cache_size >= self.capacity:
            for store in (self.keys, self.values, self.levels, self.mins, self.positions):
                del store[0]
        return super().step(q, k, v, field, level)


class RingBufferCache(Mutant):
    """Decoding with a fixed 128-entry ring buffer: correct until more than 128 keys are live."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_decode",)

    def fpa_decode(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        theta: float,
        scale: float | None = None,
    ) -> tuple[FloatArray, float]:
        with mock.patch.object(fpa, "FPADecoder", _RingBufferDecoder):
            return super().fpa_decode(q, k, v, field, level, theta=theta, scale=scale)


class FinalNotPeak(Mutant):
    """Reports the final cache size over T as the kept fraction instead of the peak."""

    ops: ClassVar[tuple[str, ...]] = ("fpa_decode",)

    def fpa_decode(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        theta: float,
        scale: float | None = None,
    ) -> tuple[FloatArray, float]:
        res = fpa.fpa_decode(q, k, v, field, level, theta=theta, scale=scale)
        return res.o.astype(q.dtype), float(np.mean(res.cache_sizes[..., -1]) / q.shape[-2])


# Interdomain


def _s4d_variant(
    fq: NDArray[np.float64],
    kt: NDArray[np.float64],
    vt: NDArray[np.float64],
    lam: NDArray[np.complex128],
    b: NDArray[np.complex128],
    c: NDArray[np.complex128],
    readout: str,
    *,
    pairing: str = "conjugate",
    lag: int = 0,
    denominator: bool = True,
    state: np.dtype[Any] | None = None,
    log_powers: bool = False,
    late_borders: tuple[int, ...] | None = None,
) -> NDArray[np.float64]:
    """The S4D core with optional errors: transposed pairing, an input lag, no denominator, a
    state rounded to the dtype ``state`` after every step, powers of Lambda through its
    logarithm, packed sequences whose borders inside a later chunk let the carried state in."""
    z = np.concatenate(
        [kt, vt] + ([np.ones((*kt.shape[:-1], 1))] if readout == "ratio" else []), axis=-1
    )
    if lag:
        z = np.concatenate([np.zeros_like(z[..., :lag, :]), z[..., :-lag, :]], axis=-2)
    if late_borders is not None:
        x = _late_border_states(z, lam, b, late_borders)
    elif state is None:
        x = idm.s4d_states(z, lam, b)  # (..., H, T, M, C)
    else:
        x = np.zeros((*z.shape[:-2], z.shape[-2], lam.shape[1], z.shape[-1]), complex)
        h = np.zeros(x[..., 0, :, :].shape, complex)
        for t in range(z.shape[-2]):
            h = lam[:, :, None] * h + b[:, :, None] * z[..., t, None, :]  # (I11)
            h = h.real.astype(state) + 1j * h.imag.astype(state)  # the stored state
            x[..., t, :, :] = h
    if log_powers:  # each state times Lambda^0 = exp(0 log Lambda): NaN where Lambda = 0
        with np.errstate(divide="ignore", invalid="ignore"):
            x = x * np.exp(0.0 * np.log(lam))[:, None, :, None]
    Y = np.einsum("hmn,...htnc->...htmc", c, x)
    R, dv = kt.shape[-1], vt.shape[-1]
    a = np.einsum("...tmr,...tr->...tm", Y[..., :R], fq)
    a = a.conj() if pairing == "conjugate" else a
    o = np.einsum("...tm,...tmd->...td", a, Y[..., R : R + dv]).real
    if readout == "ratio" and denominator:
        with np.errstate(invalid="ignore", divide="ignore"):  # a wrong pairing can give 0 / 0
            o = o / np.einsum("...tm,...tm->...t", a, Y[..., R + dv]).real[..., None]
    return o


CHUNK = 128  # the chunk length of the mutants that imitate chunked scans


def _late_border_states(
    z: NDArray[np.float64],
    lam: NDArray[np.complex128],
    b: NDArray[np.complex128],
    offsets: tuple[int, ...],
) -> NDArray[np.complex128]:
    """(I11) over packed sequences in chunks of 128, with the state carried into a chunk
    masked by one flag per chunk (does its first token continue a segment?) instead of per
    token: a segment that starts inside a later chunk starts from the carried state."""
    T = z.shape[-2]
    starts = set(offsets[:-1])
    x = np.zeros((*z.shape[:-2], T, lam.shape[1], z.shape[-1]), complex)
    state = np.zeros(x[..., 0, :, :].shape, complex)
    for cs in range(0, T, CHUNK):
        carry = np.zeros_like(state) if cs in starts else state
        intra = np.zeros_like(state)
        power = np.ones(lam.shape, complex)
        for t in range(cs, min(cs + CHUNK, T)):
            if t in starts:
                intra = np.zeros_like(state)
            intra = lam[:, :, None] * intra + b[:, :, None] * z[..., t, None, :]
            power = power * lam
            x[..., t, :, :] = intra + power[:, :, None] * carry
        state = x[..., min(cs + CHUNK, T) - 1, :, :]
    return x


class _S4DMutant(Mutant):
    ops: ClassVar[tuple[str, ...]] = ("interdomain_s4d",)
    options: ClassVar[dict[str, Any]] = {}

    def interdomain_s4d(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        fq: FloatArray,
        kt: FloatArray,
        vt: FloatArray,
        lam_re: FloatArray,
        lam_im: FloatArray,
        b_re: FloatArray,
        b_im: FloatArray,
        c_re: FloatArray,
        c_im: FloatArray,
        *,
        readout: str,
    ) -> FloatArray:
        options = dict(self.options)
        if options.get("state") == "input":
            options["state"] = fq.dtype
        o = _s4d_variant(
            np.asarray(fq, float),
            np.asarray(kt, float),
            np.asarray(vt, float),
            lam_re + 1j * lam_im,
            b_re + 1j * b_im,
            c_re + 1j * c_im,
            readout,
            **options,
        )
        return o.astype(fq.dtype)


class TransposePairing(_S4DMutant):
    """xi(q)^T U^T Gamma (transpose) instead of the conjugate pairing of (I13)."""

    options: ClassVar[dict[str, Any]] = {"pairing": "transpose"}


class RecurrenceOffByOne(_S4DMutant):
    """x_t = Lambda x_{t-1} + b z_{t-1}: the input enters one step late."""

    options: ClassVar[dict[str, Any]] = {"lag": 1}


class HalfPrecisionState(_S4DMutant):
    """The recurrent state stored in the input dtype between steps (float16 state storage)."""

    options: ClassVar[dict[str, Any]] = {"state": "input"}
    caught_in: ClassVar[str] = "float16"


class DroppedDenominator(_S4DMutant):
    """The ratio readouts (I3) and (I13) without their denominators."""

    ops: ClassVar[tuple[str, ...]] = ("interdomain_s4d", "interdomain_legs")
    options: ClassVar[dict[str, Any]] = {"denominator": False}

    def interdomain_legs(
        self, fq: FloatArray, fk: FloatArray, v: FloatArray, *, M: int
    ) -> FloatArray:
        co = idm.basis_coefficients(fk, v, M)
        a = np.einsum("...tmr,...tr->...tm", co.U, np.asarray(fq, float))
        return np.einsum("...tm,...tmd->...td", a, co.Gamma).astype(fq.dtype)


class EulerLegs(Mutant):
    """LegS by forward Euler in time (c += (-A c + B f) / n) instead of the exact step (I5)."""

    ops: ClassVar[tuple[str, ...]] = ("interdomain_legs",)

    def interdomain_legs(
        self, fq: FloatArray, fk: FloatArray, v: FloatArray, *, M: int
    ) -> FloatArray:
        A, B = hippo.legs_transition(M)
        z = np.concatenate([fk, v, np.ones((*v.shape[:-1], 1))], axis=-1).astype(float)
        c = np.zeros((*z.shape[:-2], M, z.shape[-1]))
        out = np.zeros(v.shape)
        R, dv = fk.shape[-1], v.shape[-1]
        for t in range(z.shape[-2]):
            n = t + 1
            c = c + (-A @ c + B[:, None] * z[..., t, None, :]) / n
            a = np.einsum("...mr,...r->...m", c[..., :R], np.asarray(fq[..., t, :], float))
            num = np.einsum("...m,...md->...d", a, c[..., R : R + dv])
            out[..., t, :] = num / np.einsum("...m,...m->...", a, c[..., R + dv])[..., None]
        return out.astype(fq.dtype)


# Combined features: heads, packings, long rows, strides, modes, decoding, windows


class _Heads:
    """GQA head maps: the kv row each (batch, query head) reads, and its adjoint."""

    @staticmethod
    def batch_stride_one(x: FloatArray, H: int, name: str) -> FloatArray:
        """kv row b + h // group of the flattened (B * H_kv) heads: the batch stride taken as
        1 instead of H_kv on the GQA path (right for B = 1 or H_kv = 1)."""
        B, H_kv = x.shape[0], x.shape[-3]
        if H_kv == H:
            return x
        flat = x.reshape(-1, *x.shape[-2:])
        return flat[_Heads.rows(B, H, H_kv)]

    @staticmethod
    def rows(B: int, H: int, H_kv: int) -> NDArray[np.intp]:
        return np.arange(B)[:, None] + np.arange(H)[None, :] // (H // H_kv)

    @staticmethod
    def sum_batch_stride_one(g: NDArray[np.float64], H_kv: int) -> NDArray[np.float64]:
        B, H, T, D = g.shape
        if H_kv == H:
            return g
        out = np.zeros((B * H_kv, T, D))
        np.add.at(out, _Heads.rows(B, H, H_kv).ravel(), g.reshape(-1, T, D))
        return out.reshape(B, H_kv, T, D)


class _PatchedHeads(Mutant):
    """Ops and VJPs of attention with the GQA head map of :meth:`_patched`, where it applies."""

    def _patched(self, params: Mapping[str, Any]) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def fpa_attention(self, *args: Any, **kwargs: Any) -> Any:
        with self._patched(kwargs):
            return super().fpa_attention(*args, **kwargs)

    def fox_attention(self, *args: Any, **kwargs: Any) -> Any:
        with self._patched(kwargs):
            return super().fox_attention(*args, **kwargs)

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        with self._patched(params):
            return super().vjp(op, inputs, params, cotangents)


class GQABatchStride(_PatchedHeads):
    """GQA indexing the flattened key/value heads with batch stride 1 instead of H_kv: right
    when B = 1 or H_kv = 1 (every GQA case of the second round), wrong for B > 1 with several
    key/value heads."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/gqa_batch/", "fox/gqa_batch/")

    FEATURES: ClassVar[tuple[str, ...]] = ("fpa_attention.gqa", "fox_attention.gqa")
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def _patched(self, params: Mapping[str, Any]) -> AbstractContextManager[Any]:
        from . import numpy_backend

        return mock.patch.multiple(
            numpy_backend,
            _heads_for_queries=_Heads.batch_stride_one,
            _sum_groups=_Heads.sum_batch_stride_one,
        )


class VarlenGQAModulo(_PatchedHeads):
    """Packed sequences and GQA each right on their own, but the packed path has its own head
    map, h % H_kv instead of h // (H / H_kv): wrong only when both are used together."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/varlen_gqa/", "fox/varlen_gqa/")

    FEATURES: ClassVar[tuple[str, ...]] = (
        "fpa_attention.varlen",
        "fox_attention.varlen",
        "fpa_attention.gqa",
        "fox_attention.gqa",
    )
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def _patched(self, params: Mapping[str, Any]) -> AbstractContextManager[Any]:
        if params.get("cu_seqlens") is None:
            return nullcontext()
        return GQAWrongHead()._patched()


def _rows_past_last_length(cu_seqlens: ArrayLike) -> NDArray[np.bool_]:
    """Rows of packed sequences at local positions past the last segment's length rounded up
    to tiles of 64: those a grid sized by the last segment's length never computes."""
    offsets = [int(x) for x in np.asarray(cu_seqlens).ravel()]
    covered = -(-(offsets[-1] - offsets[-2]) // BLOCK) * BLOCK
    lost = np.zeros(offsets[-1], dtype=bool)
    for a, b in pairwise(offsets):
        lost[a + covered : b] = True
    return lost


class MaxSeqlenFromLast(Mutant):
    """Packed sequences with the kernel grid sized by the LAST segment's length instead of the
    longest: query tiles past it are never computed (rows stay zero). Right whenever the
    longest segment is last (both packings of the second round)."""

    caught_by: ClassVar[tuple[str, ...]] = (
        "fpa/packings/1",
        "fpa/packings/2",
        "fox/packings/",
        "fpa/varlen_gqa/",
        "fox/varlen_gqa/",
    )

    FEATURES: ClassVar[tuple[str, ...]] = VarlenGQAModulo.FEATURES
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def fpa_attention(self, *args: Any, **kwargs: Any) -> Any:
        o, lse = super().fpa_attention(*args, **{**kwargs, "return_lse": True})
        if kwargs.get("cu_seqlens") is not None:
            lost = _rows_past_last_length(kwargs["cu_seqlens"])
            o, lse = o.copy(), lse.copy()
            o[..., lost, :], lse[..., lost] = 0.0, 0.0
        return (o, lse) if kwargs.get("return_lse") else o

    def fox_attention(self, *args: Any, **kwargs: Any) -> Any:
        o = super().fox_attention(*args, **kwargs)
        if kwargs.get("cu_seqlens") is not None:
            o = o.copy()
            o[..., _rows_past_last_length(kwargs["cu_seqlens"]), :] = 0.0
        return o


class S4DLateBorderCarry(_S4DMutant):
    """Packed S4D in chunks of 128 whose carried state is masked per chunk, not per token: a
    segment starting inside a later chunk inherits the previous segment's state. Right when
    every border lies in the first chunk or on a chunk start (the second round's packings)."""

    caught_by: ClassVar[tuple[str, ...]] = ("s4d/packings/1", "s4d/packings/2")

    FEATURES: ClassVar[tuple[str, ...]] = ("interdomain_s4d.varlen",)

    def interdomain_s4d(  # type: ignore[override]
        self, *, readout: str, cu_seqlens: ArrayLike | None = None, **arrays: Any
    ) -> FloatArray:
        if cu_seqlens is None:
            return NumpyBackend.interdomain_s4d(self, **arrays, readout=readout)
        offsets = tuple(int(x) for x in np.asarray(cu_seqlens).ravel())
        self.options = {"late_borders": offsets}  # type: ignore[misc]  # this call only
        try:
            return super().interdomain_s4d(**arrays, readout=readout)
        finally:
            del self.options


class HeadDimOver128(_FPAMutant):
    """A kernel with head-dim blocks of 128 whose loop stops after the first: key dims past
    128 never reach the logits (right up to dk = 128, the largest of the second round)."""

    caught_by: ClassVar[tuple[str, ...]] = (
        "fpa/headdim_big/0",
        "fpa/headdim_big/1",
        "fox/headdim_big/0",
        "fox/headdim_big/1",
    )

    def logits(
        self, q: NDArray[np.float64], k: NDArray[np.float64], s: float
    ) -> NDArray[np.float64]:
        return s * q[..., :128] @ np.swapaxes(k[..., :128], -1, -2)


def _attention_parts(
    op: str, inputs: Mapping[str, FloatArray], params: Mapping[str, Any]
) -> tuple[NDArray[np.float64], ...]:
    """(q, k, v, probabilities P, scale) of FPA or FoX (through F6) in float64."""
    q, k, v = (np.asarray(inputs[n], float) for n in ("q", "k", "v"))
    if op == "fox_attention":
        field = level = np.cumsum(np.asarray(inputs["log_f"], float), axis=-1)
    else:
        field, level = np.asarray(inputs["field"], float), np.asarray(inputs["level"], float)
    scale = params.get("scale")
    s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    a = s * q @ np.swapaxes(k, -1, -2) - fpa.descent_depth(field, level)
    a = np.where(_causal(a.shape[-1]), a, -np.inf)
    P = np.exp(a - logsumexp(a, axis=-1, keepdims=True))
    return q, k, v, P, np.asarray(s)


class LongRowSplitBackward(Mutant):
    """Past T = 512 the backward splits the keys at 512 (a split-K strategy for long rows) and
    stores the second split's dq over the first split's instead of adding to it: rows past 512
    lose the gradient through keys before 512. Right for every T <= 512."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/long_gradient/", "fox/long_gradient/")

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")
    SPLIT = 512

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        grads = super().vjp(op, inputs, params, cotangents)
        T = inputs["q"].shape[-2]
        if T <= self.SPLIT:
            return grads
        _, k, v, P, s = _attention_parts(op, inputs, params)
        d_out = np.asarray(cotangents["o"], float)
        d_lse = np.asarray(cotangents["lse"], float) if "lse" in cotangents else 0.0
        o = P @ v
        D = np.sum(d_out * o, axis=-1) - d_lse  # (G1): dS = P (dP - D)
        dS = P * (d_out @ np.swapaxes(v, -1, -2) - D[..., None])
        dq = s * dS @ k
        late = s * dS[..., self.SPLIT :, self.SPLIT :] @ k[..., self.SPLIT :, :]
        dq[..., self.SPLIT :, :] = late  # stored, not added
        grads["q"] = dq.astype(inputs["q"].dtype)
        return grads


class SavedForwardByShape(Mutant):
    """A backward that reuses the inputs saved by the last forward of the same shapes and
    dtypes (a cache keyed by shape): right whenever each VJP directly follows the forward of
    its own inputs, as every case of the second round did."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/call_order/", "fox/call_order/")

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self._saved: dict[tuple[Any, ...], dict[str, FloatArray]] = {}

    @staticmethod
    def _key(op: str, inputs: Mapping[str, FloatArray]) -> tuple[Any, ...]:
        return (op, tuple((n, x.shape, x.dtype.str) for n, x in sorted(inputs.items())))

    def _save(self, op: str, inputs: dict[str, FloatArray]) -> None:
        self._saved[self._key(op, inputs)] = {n: np.array(x) for n, x in inputs.items()}

    def fpa_attention(self, q: Any, k: Any, v: Any, field: Any, level: Any, **kw: Any) -> Any:
        self._save("fpa_attention", {"q": q, "k": k, "v": v, "field": field, "level": level})
        return super().fpa_attention(q, k, v, field, level, **kw)

    def fox_attention(self, q: Any, k: Any, v: Any, log_f: Any, **kw: Any) -> Any:
        self._save("fox_attention", {"q": q, "k": k, "v": v, "log_f": log_f})
        return super().fox_attention(q, k, v, log_f, **kw)

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        saved = self._saved.get(self._key(op, inputs), inputs)
        return super().vjp(op, saved, params, cotangents)


_SHORT_CONV = idm.short_conv


def _chunked_short_conv(x: ArrayLike, w: ArrayLike) -> NDArray[np.float64]:
    """(I8) computed chunk by chunk (64 tokens), each chunk zero-padded on its own: the taps
    reaching back into the previous chunk are lost."""
    x = np.asarray(x, dtype=float)
    T = x.shape[-2]
    parts = [_SHORT_CONV(x[..., a : a + BLOCK, :], w) for a in range(0, T, BLOCK)]
    return np.concatenate(parts, axis=-2)


class ChunkedShortConv(Mutant):
    """The Interdomain layer's short convolution done in chunks of 64 tokens that forget the
    previous chunk's last tokens: right for every layer case of the second round (T <= 17)."""

    caught_by: ClassVar[tuple[str, ...]] = ("interdomain_layer/long/",)

    ops: ClassVar[tuple[str, ...]] = ("interdomain_layer",)

    def interdomain_layer(self, *args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(idm, "short_conv", _chunked_short_conv):
            return super().interdomain_layer(*args, **kwargs)


class LogPowers(_S4DMutant):
    """Powers of Lambda taken through its logarithm (Lambda^n = exp(n log Lambda)): NaN for a
    mode with Lambda = 0, a valid mode that forgets at once."""

    caught_by: ClassVar[tuple[str, ...]] = ("s4d/zero_mode/",)

    options: ClassVar[dict[str, Any]] = {"log_powers": True}


class ThetaInInputDtype(Mutant):
    """Decoding with the eviction threshold rounded to the dtype of q: theta = 2.0001 becomes
    2 in float16, a tie, and keys of depth 2 are evicted."""

    caught_by: ClassVar[tuple[str, ...]] = ("decode/theta_near/0",)

    ops: ClassVar[tuple[str, ...]] = ("fpa_decode",)
    caught_in: ClassVar[str] = "float16"

    def fpa_decode(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        theta: float,
        scale: float | None = None,
    ) -> tuple[FloatArray, float]:
        rounded = float(np.asarray(theta, dtype=q.dtype))
        return super().fpa_decode(q, k, v, field, level, theta=rounded, scale=scale)


class LayerDropsBias(Mutant):
    """Layers that ignore a bias which is zero at initialisation: FPA's level offset b_lam and
    the Interdomain value-norm bias norm_v_b. Right on every layer at its initial values."""

    caught_by: ClassVar[tuple[str, ...]] = (
        "fpa_layer/trained/",
        "fpa_layer/long/",
        "interdomain_layer/trained/",
        "interdomain_layer/long/",
    )

    ops: ClassVar[tuple[str, ...]] = ("fpa_layer", "interdomain_layer")

    def fpa_layer(self, x: Any, params: Mapping[str, Any], **kwargs: Any) -> Any:
        params = {**params, "b_lam": np.zeros_like(params["b_lam"])}
        return super().fpa_layer(x, params, **kwargs)

    def interdomain_layer(self, x: Any, params: Mapping[str, Any], **kwargs: Any) -> Any:
        params = {**params, "norm_v_b": np.zeros_like(params["norm_v_b"])}
        return super().interdomain_layer(x, params, **kwargs)


def _row_major(x: Any) -> Any:
    """``x`` read as row-major from its data pointer, whatever its strides (the bug)."""
    x = np.asarray(x)
    if x.flags.c_contiguous:
        return x
    root = x
    while isinstance(root.base, np.ndarray):
        root = root.base
    offset = x.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    if not root.flags.c_contiguous or offset < 0 or offset + x.nbytes > root.nbytes:
        return np.ascontiguousarray(x)  # would read past the buffer: not this bug's concern
    return np.ndarray(x.shape, x.dtype, buffer=root, offset=offset)


class IgnoresStrides(Mutant):
    """Attention that reads q, k, v (and the output cotangent) as row-major from their base
    pointer, ignoring strides: right on fresh contiguous arrays, wrong on a slice of a fused
    qkv array or a transposed layout."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/strided/", "fox/strided/")

    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def fpa_attention(self, q: Any, k: Any, v: Any, *args: Any, **kw: Any) -> Any:
        return super().fpa_attention(_row_major(q), _row_major(k), _row_major(v), *args, **kw)

    def fox_attention(self, q: Any, k: Any, v: Any, *args: Any, **kw: Any) -> Any:
        return super().fox_attention(_row_major(q), _row_major(k), _row_major(v), *args, **kw)

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        inputs = {n: _row_major(x) for n, x in inputs.items()}
        cotangents = {n: _row_major(x) for n, x in cotangents.items()}
        return super().vjp(op, inputs, params, cotangents)


# dtypes


class HalfOnlySlightScale(Mutant):
    """Declares only float16 and bfloat16 and computes with the scale 0.1% too large: hidden by
    the half-precision tolerance, caught by the float32 probe."""

    dtypes = ("float16", "bfloat16")
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention",)
    caught_in: ClassVar[str] = "float32"

    def asarray(self, x: NDArray[Any], dtype: str) -> NDArray[Any]:
        if dtype == "bfloat16":
            return np.asarray(x, dtype=np.float32)  # NumPy has no bfloat16: widened storage
        return super().asarray(x, dtype)

    def fpa_attention(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        scale: float | None = None,
        return_lse: bool = False,
    ) -> FloatArray | tuple[FloatArray, NDArray[np.float64]]:
        s = (1 / np.sqrt(q.shape[-1]) if scale is None else scale) * 1.001
        return super().fpa_attention(q, k, v, field, level, scale=s, return_lse=return_lse)


def _merged_around_empty(kwargs: dict[str, Any]) -> dict[str, Any]:
    """cu_seqlens with every repeated offset value removed (a de-duplication that keeps the
    values seen once), where only the zero-length sequences should go."""
    if kwargs.get("cu_seqlens") is None:
        return kwargs
    values, counts = np.unique(np.asarray(kwargs["cu_seqlens"]), return_counts=True)
    return {
        **kwargs,
        "cu_seqlens": tuple(int(v) for v, c in zip(values, counts, strict=True) if c == 1),
    }


class EmptySequenceMerges(Mutant):
    """Zero-length packed sequences dropped by removing every offset that repeats: the
    sequences on both sides of an empty one merge (or the offsets lose their 0 or their T and
    are refused). Right whenever no sequence is empty."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/empty_segment/", "fox/empty_segment/")

    FEATURES: ClassVar[tuple[str, ...]] = ("fpa_attention.varlen", "fox_attention.varlen")
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def fpa_attention(self, *args: Any, **kwargs: Any) -> Any:
        return super().fpa_attention(*args, **_merged_around_empty(kwargs))

    def fox_attention(self, *args: Any, **kwargs: Any) -> Any:
        return super().fox_attention(*args, **_merged_around_empty(kwargs))


class WindowOffByOne(Mutant):
    """The window of (F3w) masked at i - j >= W - 1 instead of i - j >= W: each query loses the
    oldest key of its window (no key at all at W = 1, a NaN row). Right without a window."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/window/", "fox/window/", "fox/window_one/")

    FEATURES: ClassVar[tuple[str, ...]] = ("fpa_attention.window", "fox_attention.window")
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def fpa_attention(self, *args: Any, window: int | None = None, **kwargs: Any) -> Any:
        if window is None:
            return super().fpa_attention(*args, **kwargs)
        with np.errstate(invalid="ignore"), _window_short_by_one():
            return super().fpa_attention(*args, window=window, **kwargs)

    def fox_attention(self, *args: Any, window: int | None = None, **kwargs: Any) -> Any:
        if window is None:
            return super().fox_attention(*args, **kwargs)
        with np.errstate(invalid="ignore"), _window_short_by_one():
            return super().fox_attention(*args, window=window, **kwargs)

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        if params.get("window") is None:
            return super().vjp(op, inputs, params, cotangents)
        with np.errstate(invalid="ignore"), _window_short_by_one():
            return super().vjp(op, inputs, params, cotangents)


def _window_short_by_one() -> AbstractContextManager[Any]:
    """The reference's window mask, off by one: pairs with i - j >= W - 1 are masked."""
    causal = fpa._causal

    def short(T: int, window: int | None = None) -> NDArray[np.bool_]:
        if window is None:
            return causal(T)
        return causal(T) & np.triu(np.ones((T, T), dtype=bool), k=2 - window)

    # the reference returns non-finite results as a ValueError; the kernel's NaN row is kept
    return mock.patch.multiple(fpa, _causal=short, finite_result=lambda x, cause: x)


# Where features meet
# Bugs where features meet, caught by the covering families (covering_cases.py) and by the
# results held across the call sequence; each passes the menu before them (tests say which
# case catches it).


def _below_power_of_two(M: int) -> int:
    return 1 << (M.bit_length() - 1)


class ModesRoundedDown(Mutant):
    """S4D with the mode count rounded down to a power of two (a kernel that tiles modes by
    powers of two drops the rest): right for M = 1, 4, 8, 16, 64, the menu before."""

    caught_by: ClassVar[tuple[str, ...]] = ("s4d/covering/0", "s4d/covering/8", "s4d/covering/9")
    FEATURES: ClassVar[tuple[str, ...]] = ("interdomain_s4d.varlen",)
    ops: ClassVar[tuple[str, ...]] = ("interdomain_s4d",)

    def interdomain_s4d(self, fq: Any, kt: Any, vt: Any, **kw: Any) -> Any:  # type: ignore[override]
        m = _below_power_of_two(kw["lam_re"].shape[-1])
        for name in ("lam_re", "lam_im", "b_re", "b_im"):
            kw[name] = kw[name][..., :m]
        for name in ("c_re", "c_im"):
            kw[name] = kw[name][:, :m, :m]
        return super().interdomain_s4d(fq, kt, vt, **kw)


class LegsModesRoundedDown(Mutant):
    """LegS computed with M rounded down to a power of two, padded back with zeros: right for
    the menu's M = 1, 4, 8, 16, 64."""

    caught_by: ClassVar[tuple[str, ...]] = ("legs/covering/3", "legs/covering/4", "legs/covering/5")
    ops: ClassVar[tuple[str, ...]] = ("interdomain_legs",)

    def interdomain_legs(self, fq: Any, fk: Any, v: Any, *, M: int) -> Any:
        return super().interdomain_legs(fq, fk, v, M=_below_power_of_two(M))


def _equal_parts(kwargs: dict[str, Any]) -> dict[str, Any]:
    """cu_seqlens dropped when every packed sequence has the same length (a 'batch' fast path
    that reshapes (1, n L) to (n, L) and then forgets to)."""
    cu = kwargs.get("cu_seqlens")
    if cu is not None and len(cu) > 2 and len(set(np.diff(np.asarray(cu)).tolist())) == 1:
        return {**kwargs, "cu_seqlens": None}
    return kwargs


class EqualPackingUnmasked(Mutant):
    """Packed sequences of equal lengths attended as one sequence: right for every packing of
    the menu before (none has equal lengths)."""

    caught_by: ClassVar[tuple[str, ...]] = ("fox/covering/6", "fpa/covering/12")
    FEATURES: ClassVar[tuple[str, ...]] = ("fpa_attention.varlen", "fox_attention.varlen")
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def fpa_attention(self, *args: Any, **kwargs: Any) -> Any:
        return super().fpa_attention(*args, **_equal_parts(kwargs))

    def fox_attention(self, *args: Any, **kwargs: Any) -> Any:
        return super().fox_attention(*args, **_equal_parts(kwargs))


def _first_of_group(q: Any, k: Any) -> Any:
    """q with every query head replaced by the first head of its GQA group, for a strided q."""
    H, H_kv = q.shape[-3], k.shape[-3]
    if H == H_kv or q.flags.c_contiguous:
        return q
    group = H // H_kv
    return np.ascontiguousarray(q[..., (np.arange(H) // group) * group, :, :])


class StridedGQAQueryHeads(Mutant):
    """Attention that, for a non-contiguous q with fewer key/value heads, reads one q head per
    group (its stride arithmetic steps by key/value heads): right on the strided cases (no GQA)
    and on the GQA cases (contiguous) of the menu before."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/covering/4", "fox/covering/3", "fox/covering/7")
    FEATURES: ClassVar[tuple[str, ...]] = (
        "fpa_attention.gqa",
        "fox_attention.gqa",
        "fpa_attention.varlen",
        "fox_attention.varlen",
    )
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")

    def fpa_attention(self, q: Any, k: Any, *args: Any, **kw: Any) -> Any:
        return super().fpa_attention(_first_of_group(q, k), k, *args, **kw)

    def fox_attention(self, q: Any, k: Any, *args: Any, **kw: Any) -> Any:
        return super().fox_attention(_first_of_group(q, k), k, *args, **kw)


class PersistentOutputs(Mutant):
    """Outputs and gradients written into one persistent buffer per op, name and shape (a static
    CUDA-graph output, a reused workspace) and that buffer returned: every value is right when
    it is returned, and wrong in any result the caller keeps past the next call of that shape."""

    caught_by: ClassVar[tuple[str, ...]] = (
        "fpa/call_order/",
        "fox/call_order/",
        "s4d/call_order/",
    )
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention", "interdomain_s4d")

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self._buffers: dict[tuple[Any, ...], FloatArray] = {}

    def _into(self, key: str, x: Any) -> Any:
        x = np.asarray(x)
        buf = self._buffers.setdefault((key, x.shape, x.dtype.str), np.empty_like(x))
        buf[...] = x
        return buf

    def fpa_attention(self, *args: Any, **kw: Any) -> Any:
        out = super().fpa_attention(*args, **kw)
        if isinstance(out, tuple):
            return self._into("fpa.o", out[0]), self._into("fpa.lse", out[1])
        return self._into("fpa.o", out)

    def fox_attention(self, *args: Any, **kw: Any) -> Any:
        return self._into("fox.o", super().fox_attention(*args, **kw))

    def interdomain_s4d(self, *args: Any, **kw: Any) -> Any:
        return self._into("s4d.o", super().interdomain_s4d(*args, **kw))

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        grads = super().vjp(op, inputs, params, cotangents)
        return {n: self._into(f"{op}.d{n}", g) for n, g in grads.items()}


class PackedRopePositions(Mutant):
    """The Interdomain layer on packed sequences with RoPE positions counted from the start of
    the pack, not of each sequence (a kernel that rotates by the token's row in the packed
    tensor): right without RoPE or without packing, the menu before (its packed layer cases have
    no RoPE, its RoPE cases no packing)."""

    caught_by: ClassVar[tuple[str, ...]] = tuple(
        f"interdomain_layer/covering/{n}"
        for n in (3, 5, 7, 8)  # RoPE on packed sequences
    )
    FEATURES: ClassVar[tuple[str, ...]] = ("interdomain_layer.varlen",)
    ops: ClassVar[tuple[str, ...]] = ("interdomain_layer",)

    def interdomain_layer(
        self,
        x: FloatArray,
        params: Mapping[str, FloatArray],
        *,
        readout: str = "linear",
        cu_seqlens: ArrayLike | None = None,
        **options: Any,
    ) -> FloatArray:
        if cu_seqlens is None or not options.get("use_rope"):
            return super().interdomain_layer(
                x, params, readout=readout, cu_seqlens=cu_seqlens, **options
            )
        parts = []
        for bos, eos in pairwise(np.asarray(cu_seqlens).tolist()):
            if eos == bos:
                continue

            def rotated(z: ArrayLike, start: int = bos) -> NDArray[np.float64]:
                z = np.asarray(z, dtype=np.float64)
                pad = np.zeros((*z.shape[:-2], start, z.shape[-1]))
                return _rope(np.concatenate([pad, z], axis=-2))[..., start:, :]

            with mock.patch.object(idm, "rope", rotated):
                parts.append(
                    idm.interdomain_layer(x[..., bos:eos, :], params, readout=readout, **options)
                )
        return np.concatenate(parts, axis=-2).astype(x.dtype)


_rope = idm.rope


class DecayClampedAt50(_FPAMutant):
    """FoX with the decay bias clamped at -50 ("exp(-50) is zero anyway"): wrong once the
    logits are large enough to outweigh it."""

    ops: ClassVar[tuple[str, ...]] = ("fox_attention",)
    caught_by: ClassVar[tuple[str, ...]] = ("fox/large_logits/",)

    def depth(self, field: NDArray[np.float64], level: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.minimum(fpa.descent_depth(field, level), 50.0)


class PaddingKeysAttended(Mutant):
    """A padding mask applied to the outputs only: each padded row runs as one sequence, its
    padding positions attended as keys, and the outputs there set to 0."""

    FEATURES: ClassVar[tuple[str, ...]] = ("fox_attention.padding", "fox_attention.gqa")
    ops: ClassVar[tuple[str, ...]] = ("fox_attention",)
    caught_by: ClassVar[tuple[str, ...]] = ("fox/padded/",)

    def fox_attention(  # type: ignore[override]  # no cu_seqlens: declares no varlen
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        log_f: FloatArray,
        *,
        scale: float | None = None,
        window: int | None = None,
        present: ArrayLike | None = None,
    ) -> FloatArray:
        o = super().fox_attention(q, k, v, log_f, scale=scale, window=window)
        if present is None:
            return o
        return np.where(np.asarray(present)[:, None, :, None], o, 0.0).astype(q.dtype)


class LongRowSharedAccumulator(Mutant):
    """Past T = 512 the backward's second key split (keys from 512 on) accumulates dk and dv
    in one buffer for every (batch, head) row: each row gets the sum of all rows there. Right
    whenever B = H = 1."""

    caught_by: ClassVar[tuple[str, ...]] = ("fpa/long_gradient/2", "fox/long_gradient/2")
    ops: ClassVar[tuple[str, ...]] = ("fpa_attention", "fox_attention")
    SPLIT = 512

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        grads = super().vjp(op, inputs, params, cotangents)
        if inputs["q"].shape[-2] <= self.SPLIT:
            return grads
        for name in ("k", "v"):
            g = np.array(grads[name], dtype=np.float64)  # (B, H_kv, T, D)
            shared = g[:, :, self.SPLIT :, :].sum(axis=(0, 1), keepdims=True)
            g[:, :, self.SPLIT :, :] = shared  # one accumulator for every row
            grads[name] = g.astype(grads[name].dtype)
        return grads


MUTANTS: dict[str, type[Mutant]] = {
    cls.__name__: cls
    for cls in [
        ClosedSegment,
        SumNotMax,
        NoClamp,
        ForgottenGap,
        HeadDimTail,
        NoScale,
        BackwardDefaultScale,
        NoRowMax,
        HalfAccumulation,
        FieldInInputDtype,
        DiagonalDroppedInRaggedTail,
        EarliestArgmin,
        TieAcrossTiles,
        ZeroLevelGradient,
        Float64Gradients,
        InPlaceCumsum,
        VarlenBackwardLeak,
        GQAWrongHead,
        EagerEviction,
        StrictEviction,
        RingBufferCache,
        FinalNotPeak,
        TransposePairing,
        RecurrenceOffByOne,
        HalfPrecisionState,
        DroppedDenominator,
        EulerLegs,
        HalfOnlySlightScale,
        GQABatchStride,
        VarlenGQAModulo,
        MaxSeqlenFromLast,
        S4DLateBorderCarry,
        HeadDimOver128,
        LongRowSplitBackward,
        SavedForwardByShape,
        ChunkedShortConv,
        LogPowers,
        ThetaInInputDtype,
        LayerDropsBias,
        IgnoresStrides,
        EmptySequenceMerges,
        WindowOffByOne,
        ModesRoundedDown,
        LegsModesRoundedDown,
        EqualPackingUnmasked,
        StridedGQAQueryHeads,
        PersistentOutputs,
        PackedRopePositions,
        DecayClampedAt50,
        PaddingKeysAttended,
        LongRowSharedAccumulator,
    ]
}
for _name, _cls in MUTANTS.items():
    _cls.name = f"mutant-{_name}"  # its own skip file, and no reference-only checks

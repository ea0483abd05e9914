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
from contextlib import AbstractContextManager
from typing import Any, ClassVar, cast
from unittest import mock

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import logsumexp

from attnspec.backends.numpy_backend import FloatArray, NumpyBackend
from attnspec.reference import fpa, hippo
from attnspec.reference import interdomain as idm

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
    ops: ClassVar[tuple[str, ...]] = ()
    caught_in: ClassVar[str] = "float64"


# ----------------------------------------------------------------------------------- FPA/FoX


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
        from attnspec.backends import numpy_backend

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


# ----------------------------------------------------------------------------------- decode


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


# ----------------------------------------------------------------------------------- Interdomain


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
) -> NDArray[np.float64]:
    """The S4D core with optional errors: transposed pairing, an input lag, no denominator, a
    state rounded to the dtype ``state`` after every step."""
    z = np.concatenate(
        [kt, vt] + ([np.ones((*kt.shape[:-1], 1))] if readout == "ratio" else []), axis=-1
    )
    if lag:
        z = np.concatenate([np.zeros_like(z[..., :lag, :]), z[..., :-lag, :]], axis=-2)
    if state is None:
        x = idm.s4d_states(z, lam, b)  # (..., H, T, M, C)
    else:
        x = np.zeros((*z.shape[:-2], z.shape[-2], lam.shape[1], z.shape[-1]), complex)
        h = np.zeros(x[..., 0, :, :].shape, complex)
        for t in range(z.shape[-2]):
            h = lam[:, :, None] * h + b[:, :, None] * z[..., t, None, :]  # (I11)
            h = h.real.astype(state) + 1j * h.imag.astype(state)  # the stored state
            x[..., t, :, :] = h
    Y = np.einsum("hmn,...htnc->...htmc", c, x)
    R, dv = kt.shape[-1], vt.shape[-1]
    a = np.einsum("...tmr,...tr->...tm", Y[..., :R], fq)
    a = a.conj() if pairing == "conjugate" else a
    o = np.einsum("...tm,...tmd->...td", a, Y[..., R : R + dv]).real
    if readout == "ratio" and denominator:
        with np.errstate(invalid="ignore", divide="ignore"):  # a wrong pairing can give 0 / 0
            o = o / np.einsum("...tm,...tm->...t", a, Y[..., R + dv]).real[..., None]
    return o


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


# ----------------------------------------------------------------------------------- dtypes


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
    ]
}
for _name, _cls in MUTANTS.items():
    _cls.name = f"mutant-{_name}"  # its own skip file, and no reference-only checks

"""Deliberately wrong backends: the kit's self-test.

Each mutant is the reference backend with one error from spec/conformance.md ("mutation
testing"); the kit's tests assert that every mutant is caught by at least one case. A kit that
cannot fail proves nothing. Select one with
``attnspec conformance --backend attnspec.conformance.mutants:SumNotMax``.
"""

from __future__ import annotations

from typing import ClassVar
from unittest import mock

import numpy as np
from scipy.special import logsumexp

from attnspec.backends.numpy_backend import NumpyBackend
from attnspec.reference import fpa, hippo
from attnspec.reference import interdomain as idm


def _attend(logits, v):
    """Causal softmax of logits (..., T, T) and the weighted values; returns (o, lse)."""
    T = logits.shape[-1]
    a = np.where(np.tril(np.ones((T, T), dtype=bool)), logits, -np.inf)
    lse = logsumexp(a, axis=-1)
    return np.exp(a - lse[..., None]) @ v, lse


class _PenaltyMutant(NumpyBackend):
    """FPA (and FoX, through F6) with a wrong penalty ``depth(field, level)`` (..., T, T)."""

    def depth(self, field, level):
        raise NotImplementedError

    def fpa_attention(self, q, k, v, field, level, *, scale=None, return_lse=False):
        s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        logits = s * np.asarray(q, float) @ np.swapaxes(np.asarray(k, float), -1, -2)
        o, lse = _attend(
            logits - self.depth(np.asarray(field, float), np.asarray(level, float)),
            np.asarray(v, float),
        )
        return (o.astype(q.dtype), lse) if return_lse else o.astype(q.dtype)

    def fox_attention(self, q, k, v, log_f, *, scale=None):
        c = np.cumsum(np.asarray(log_f, float), axis=-1)
        return self.fpa_attention(q, k, v, c, c, scale=scale)


class ClosedSegment(_PenaltyMutant):
    """Segment [j, i] instead of (j, i]: the key's own field value enters the minimum."""

    def depth(self, field, level):
        m = np.minimum(fpa.segment_min(field), field[..., None, :])  # adds t = j
        return np.maximum(0.0, level[..., None, :] - m)


class SumNotMax(_PenaltyMutant):
    """The total descent l_j - phi_i (a FoX-like sum) instead of the deepest one."""

    def depth(self, field, level):
        return np.maximum(0.0, level[..., None, :] - field[..., :, None])


class NoClamp(_PenaltyMutant):
    """pi = l_j - m_ij without max(0, .): keys below the field get a bonus."""

    def depth(self, field, level):
        T = field.shape[-1]
        raw = level[..., None, :] - fpa.segment_min(field)
        return np.where(np.tril(np.ones((T, T), dtype=bool), k=-1), raw, 0.0)


class NoScale(NumpyBackend):
    """The softmax scale is ignored (s = 1)."""

    def fpa_attention(self, q, k, v, field, level, *, scale=None, return_lse=False):
        return super().fpa_attention(q, k, v, field, level, scale=1.0, return_lse=return_lse)

    def fox_attention(self, q, k, v, log_f, *, scale=None):
        return super().fox_attention(q, k, v, log_f, scale=1.0)


def _earliest_segment_argmin(field):
    """t*_ij with ties sent to the EARLIEST minimiser (the wrong convention)."""
    field = np.asarray(field, dtype=float)
    m = fpa.segment_min(field)
    tstar = np.full(m.shape, -1, dtype=np.int64)
    for i in range(1, field.shape[-1]):
        newest = field[..., i, None] < m[..., i - 1, :i]  # strict: ties keep the older t
        tstar[..., i, :i] = np.where(newest, i, tstar[..., i - 1, :i])
    return tstar


class EarliestArgmin(NumpyBackend):
    """The backward of (G3) sends the field cotangent to the earliest argmin on ties."""

    def vjp(self, op, inputs, params, cotangents):
        with mock.patch.object(fpa, "segment_argmin", _earliest_segment_argmin):
            return super().vjp(op, inputs, params, cotangents)


def _s4d_variant(fq, kt, vt, lam, b, c, readout, *, pairing="conjugate", lag=0, denominator=True):
    """The S4D core with optional errors: transposed pairing, an input lag, no denominator."""
    z = np.concatenate(
        [kt, vt] + ([np.ones((*kt.shape[:-1], 1))] if readout == "ratio" else []), axis=-1
    )
    if lag:
        z = np.concatenate([np.zeros_like(z[..., :lag, :]), z[..., :-lag, :]], axis=-2)
    x = idm.s4d_states(z, lam, b)  # (..., H, T, M, C)
    Y = np.einsum("hmn,...htnc->...htmc", c, x)
    R, dv = kt.shape[-1], vt.shape[-1]
    a = np.einsum("...tmr,...tr->...tm", Y[..., :R], fq)
    a = a.conj() if pairing == "conjugate" else a
    o = np.einsum("...tm,...tmd->...td", a, Y[..., R : R + dv]).real
    if readout == "ratio" and denominator:
        with np.errstate(invalid="ignore", divide="ignore"):  # a wrong pairing can give 0 / 0
            o = o / np.einsum("...tm,...tm->...t", a, Y[..., R + dv]).real[..., None]
    return o


class _S4DMutant(NumpyBackend):
    options: ClassVar[dict] = {}

    def interdomain_s4d(self, fq, kt, vt, lam_re, lam_im, b_re, b_im, c_re, c_im, *, readout):
        o = _s4d_variant(
            np.asarray(fq, float),
            np.asarray(kt, float),
            np.asarray(vt, float),
            lam_re + 1j * lam_im,
            b_re + 1j * b_im,
            c_re + 1j * c_im,
            readout,
            **self.options,
        )
        return o.astype(fq.dtype)


class TransposePairing(_S4DMutant):
    """xi(q)^T U^T Gamma (transpose) instead of the conjugate pairing of (I13)."""

    options: ClassVar[dict] = {"pairing": "transpose"}


class RecurrenceOffByOne(_S4DMutant):
    """x_t = Lambda x_{t-1} + b z_{t-1}: the input enters one step late."""

    options: ClassVar[dict] = {"lag": 1}


class DroppedDenominator(_S4DMutant):
    """The ratio readouts (I3) and (I13) without their denominators."""

    options: ClassVar[dict] = {"denominator": False}

    def interdomain_legs(self, fq, fk, v, *, M):
        co = idm.basis_coefficients(fk, v, M)
        a = np.einsum("...tmr,...tr->...tm", co.U, np.asarray(fq, float))
        return np.einsum("...tm,...tmd->...td", a, co.Gamma).astype(fq.dtype)


class EagerEviction(NumpyBackend):
    """Decoding that evicts at theta / 4: unsafe, and keeps too few keys."""

    def fpa_decode(self, q, k, v, field, level, *, theta, scale=None):
        return super().fpa_decode(q, k, v, field, level, theta=theta / 4, scale=scale)


class EulerLegs(NumpyBackend):
    """LegS by forward Euler in time (c += (-A c + B f) / n) instead of the exact step (I5)."""

    def interdomain_legs(self, fq, fk, v, *, M):
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


MUTANTS: dict[str, type[NumpyBackend]] = {
    cls.__name__: cls
    for cls in [
        ClosedSegment,
        SumNotMax,
        NoClamp,
        EarliestArgmin,
        NoScale,
        TransposePairing,
        RecurrenceOffByOne,
        DroppedDenominator,
        EagerEviction,
        EulerLegs,
    ]
}
for _name, _cls in MUTANTS.items():
    _cls.name = f"mutant-{_name}"  # its own skip file, and no reference-only checks

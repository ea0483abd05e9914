"""Inputs of the backend tests, drawn by the conformance kit's drawers (conformance/drawers.py),
so that the kit and the tests share one source for fields, levels, forget gates and S4D
parameters; and the two layouts the torch tests convert between.

Arrays are float64 in the reference layout (B, H, T, ...); this module gives the kit's drawers the
shapes and layouts the backend tests ask for.
"""

import numpy as np

from attnspec.conformance import drawers as kit


def attention(rng, B, T, HQ, H, K, V, *, field="walk", level="offset", centre=0.0):
    """q, k, v, field, level; k and v with H heads (GQA when H < HQ, as the kit's families).

    field: a kind of :func:`kit.draw_field` ("walk", "monotone", "brackets", "constant", "huge",
    "cliff"); level: of :func:`kit.draw_level` ("offset", "one_walk", "extreme"); centre: added
    to both (as the kit's large_field family: O(1) penalties as differences of large numbers).
    """
    x = kit.draw_fpa_inputs(rng, (B, HQ, T, K, V), field_kind=field, level_kind=level)
    k, v = x["k"][:, :H].copy(), x["v"][:, :H].copy()
    return x["q"], k, v, x["field"] + centre, x["level"] + centre


def field(rng, kind, shape):
    """A field of one of the kit's kinds (:func:`kit.draw_field`: "walk", "monotone", "brackets",
    "constant", "huge", "cliff"), a walk along the last axis of ``shape``."""
    return kit.draw_field(rng, kind, shape)


def level(rng, kind, field_):
    """Levels of one of the kit's kinds (:func:`kit.draw_level`: "offset", "one_walk",
    "extreme") for ``field_``."""
    return kit.draw_level(rng, kind, field_)


def gated(rng, B, T, HQ, H, K, V, *, unit=0.0, decay=0.5):
    """q, k, v, log_f of forget-gate attention; log f = -Exp(decay) - 0.01, a fraction ``unit``
    of the gates exactly 1 (log f = 0: the ties of (F6))."""
    x = kit.draw_fox_inputs(rng, B, HQ, T, K, V, decay=decay, H_kv=H)
    log_f = x["log_f"]
    log_f[rng.random(log_f.shape) < unit] = 0.0
    return x["q"], x["k"], x["v"], log_f


def positive(rng, shape):
    """Positive features (ratio readouts need fq . u_0 > 0)."""
    return kit.draw_positive(rng, shape)


def features(rng, shape, readout="linear"):
    """Query or key features for a readout: positive for "ratio", standard normal for "linear"
    (as the kit's S4D families)."""
    return positive(rng, shape) if readout == "ratio" else rng.standard_normal(shape)


def s4d(rng, B, H, T, R, V, M, readout="linear", dt=(0.01, 0.3)):
    """fq, kt, vt and the complex lam, b, c of an S4D-Inv layer with steps dt ~ U(dt); for the
    ratio readout positive features and C near I (the denominator stays away from 0)."""
    x, _ = kit.s4d_builder([(B, H, T, R, V, M)], dt_range=dt, readout=readout)(rng, 0)
    pair = {name: x[f"{name}_re"] + 1j * x[f"{name}_im"] for name in ("lam", "b", "c")}
    return x["fq"], x["kt"], x["vt"], pair["lam"], pair["b"], pair["c"]


def s4d_parameters(rng, H, M, readout="linear", dt=(0.01, 0.3)):
    """lam, b, c alone: those :func:`s4d` draws first (with no tokens, no features follow)."""
    return s4d(rng, 0, H, 1, 1, 1, M, readout, dt)[3:]


def to_torch(x):
    """Reference layout (B, H, T, ...) -> a torch tensor [B, T, H, ...]."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2)))


def to_ref(t):
    """A torch tensor [B, T, H, ...] -> float64 NumPy in the reference layout (B, H, T, ...)."""
    return np.swapaxes(t.detach().double().cpu().numpy(), 1, 2)

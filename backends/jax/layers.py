"""Flax-free layers: pure functions of an input and a parameter pytree (a dict of arrays).

The parameter dicts are those of the reference layers (``attnspec.reference.fpa.init_fpa_params``
and ``attnspec.reference.interdomain.init_interdomain_params``: same names, same shapes), so a
dict of NumPy arrays from the reference, or of JAX arrays being trained, can be passed as is;
gradients with respect to the parameters come from ``jax.grad`` of these functions.

Projections accumulate in float32 (float64 for float64 inputs); q, k, v enter the ops in the
input's dtype; field, level and the SSM parameters stay float32 or wider. An empty batch (B = 0)
gives an empty output. :func:`init_fpa_params` and :func:`init_interdomain_params` draw a
parameter dict from a PRNG key.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from attnspec.reference import fpa as reference_fpa
from attnspec.reference import interdomain as reference_interdomain
from attnspec.reference.fpa import FPA_PARAMETER_SCHEMA
from attnspec.reference.interdomain import OPTIONAL_PARAMETERS, PARAMETER_SCHEMA

from . import validation as check
from .fpa import fpa_attention
from .interdomain import interdomain_s4d

HIGHEST = lax.Precision.HIGHEST


def _params(
    name: str, params: object, schema: dict[str, str], optional: tuple[str, ...] = ()
) -> dict[str, jax.Array]:
    if not isinstance(params, dict):
        raise ValueError(f"params: expected a dict of arrays, got {type(params).__name__}")
    missing = sorted(set(schema) - set(optional) - set(params))
    if missing:
        raise ValueError(f"params: missing {missing}; see {name}")
    return {
        key: check.array(f"params[{key!r}]", value, jnp.ndim(value))
        for key, value in params.items()
    }


def _expect(
    P: dict[str, jax.Array], shapes: dict[str, tuple[int, ...]], schema: dict[str, str]
) -> None:
    for key, shape in shapes.items():
        if key in P:
            check.shape(f"params[{key!r}]", P[key], shape, schema[key])


def _project(x: jax.Array, w: jax.Array, ct: jnp.dtype) -> jax.Array:
    return jnp.matmul(x.astype(ct), w.astype(ct), precision=HIGHEST)


def _seed(key: jax.Array | int) -> int:
    """A NumPy seed from a JAX PRNG key (typed or raw uint32) or an int."""
    if isinstance(key, int):
        return key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return int(np.asarray(key, np.uint64).ravel()[-1])


def init_fpa_params(
    key: jax.Array | int, d: int, H: int, dk: int, dv: int, *, dtype: DTypeLike = jnp.float32
) -> dict[str, jax.Array]:
    """Parameters of :func:`fpa_layer` (``FPA_PARAMETER_SCHEMA``): the reference's
    initialisation (``attnspec.reference.fpa.init_fpa_params``, normal / sqrt(fan-in)) drawn
    with a seed taken from ``key`` and cast to ``dtype``. Time and memory O(d H (dk + dv))."""
    params = reference_fpa.init_fpa_params(d, H, dk, dv, seed=_seed(key))
    return {name: jnp.asarray(value, dtype) for name, value in params.items()}


def init_interdomain_params(
    key: jax.Array | int,
    d: int,
    H: int,
    R: int,
    dv: int,
    M: int,
    *,
    gate: bool = False,
    output_norm: bool = True,
    dtype: DTypeLike = jnp.float32,
) -> dict[str, jax.Array]:
    """Parameters of :func:`interdomain_layer` (``PARAMETER_SCHEMA``): the reference's S4D-Inv
    initialisation (``attnspec.reference.interdomain.init_interdomain_params``) drawn with a
    seed taken from ``key`` and cast to ``dtype``; norm_o_g (I14) with ``output_norm``, wg with
    ``gate``. Time and memory O(d H (R + dv) + H M^2)."""
    params = reference_interdomain.init_interdomain_params(
        d, H, R, dv, M, seed=_seed(key), gate=gate, output_norm=output_norm
    )
    return {name: jnp.asarray(value, dtype) for name, value in params.items()}


def fpa_layer(
    x: ArrayLike,
    params: dict[str, Any],
    *,
    increments: str = "signed",
    implementation: str = "xla",
) -> jax.Array:
    """Multi-head FPA layer (spec section 3): x [B, T, d] -> y [B, T, d] in x's dtype.

    Per head: delta_t = x_t . w_delta + b_delta (``increments="logsigmoid"``: the FoX-initialised
    layer), phi = cumsum(delta) in float32 or wider, l_j = phi_j + x_j . w_lam + b_lam; then
    :func:`attnspec.backends.jax.fpa_attention` and the output projection. Matches
    ``attnspec.reference.fpa.fpa_layer``. Time O(B T H (d + T) (dk + dv)); memory
    O(B T (d + H (dk + dv))) plus the op's O(B H T block).
    """
    x = check.array("x", x, 3, meaning="[B, T, d]")
    P = _params("FPA_PARAMETER_SCHEMA", params, FPA_PARAMETER_SCHEMA)
    if increments not in ("signed", "logsigmoid"):
        raise ValueError(f"increments: expected 'signed' or 'logsigmoid', got {increments!r}")
    d = x.shape[-1]
    H = P["b_delta"].shape[0]
    dk, dv = P["wq"].shape[1] // H, P["wv"].shape[1] // H
    shapes = {
        "wq": (d, H * dk),
        "wk": (d, H * dk),
        "wv": (d, H * dv),
        "wo": (H * dv, d),
        "w_delta": (d, H),
        "b_delta": (H,),
        "w_lam": (d, H),
        "b_lam": (H,),
    }
    _expect(P, shapes, FPA_PARAMETER_SCHEMA)
    return _fpa_layer(x, P, increments, implementation)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _fpa_layer(
    x: jax.Array, P: dict[str, jax.Array], increments: str, implementation: str
) -> jax.Array:
    ct = jnp.result_type(jnp.float32, x.dtype)
    B, T, _ = x.shape
    H = P["b_delta"].shape[0]
    heads = lambda y: y.reshape(B, T, H, y.shape[-1] // H).astype(x.dtype)  # noqa: E731
    delta = _project(x, P["w_delta"], ct) + P["b_delta"].astype(ct)  # [B, T, N]
    if increments == "logsigmoid":
        delta = jax.nn.log_sigmoid(delta)
    field = jnp.cumsum(delta, axis=1)  # phi
    level = field + _project(x, P["w_lam"], ct) + P["b_lam"].astype(ct)  # l = phi + lam
    q, k, v = (heads(_project(x, P[w], ct)) for w in ("wq", "wk", "wv"))
    o = fpa_attention(q, k, v, field, level, implementation=implementation, validate=False)
    return _project(o.reshape(B, T, P["wo"].shape[0]), P["wo"], ct).astype(x.dtype)


def short_conv(x: jax.Array, w: jax.Array) -> jax.Array:
    """(I8) causal depthwise convolution: x [B, T, C], w [K, C] -> [B, T, C], zero-padded.
    Time O(B T C K)."""
    T = x.shape[1]
    out = jnp.zeros_like(x)
    for s in range(min(w.shape[0], T)):
        out = out.at[:, s:].add(w[s] * x[:, : T - s])  # x_{t-s}, zero for t < s
    return out


def feature_map(y: jax.Array, eps: float = 1e-6) -> jax.Array:
    """(I9) xi(y) = SiLU(y) / sqrt(||y||^2 + eps) over the last axis; same shape, O(size)."""
    return jax.nn.silu(y) / jnp.sqrt(jnp.sum(y * y, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, g: ArrayLike, eps: float = 1e-6) -> jax.Array:
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g over the last axis (I10); O(size)."""
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding on the last axis of x [B, T, N, R], R even; base 10000.
    O(size)."""
    T, R = x.shape[1], x.shape[-1]
    freq = 10000.0 ** (-jnp.arange(R // 2) / (R // 2))
    angle = jnp.arange(T)[:, None] * freq  # (T, R/2)
    cos, sin = jnp.cos(angle)[:, None], jnp.sin(angle)[:, None]
    x1, x2 = x[..., : R // 2], x[..., R // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def interdomain_layer(
    x: ArrayLike,
    params: dict[str, Any],
    *,
    readout: str = "linear",
    use_rope: bool = False,
    gate: bool = False,
    output_norm: bool = True,
) -> jax.Array:
    """The Interdomain layer (I8)-(I14): x [B, T, d] -> y [B, T, d] in x's dtype.

    Projections, short conv on q and k (I8), optional RoPE, feature map (I9), norms and biases
    (I10), b discretised by zero-order hold and :func:`attnspec.backends.jax.interdomain_s4d`
    (I11)-(I13), the readout's per-head RMSNorm (I14; ``output_norm=False`` gives the
    paper-literal layer), optional output gate, output projection. Matches
    ``attnspec.reference.interdomain.interdomain_layer``. Time
    O(B T (d H (R + dv) + H M (M + R + dv + L))) for S4D chunks of L; memory O(B T H (R + dv + M)).
    """
    x = check.array("x", x, 3, meaning="[B, T, d]")
    flags = {"gate": gate, "output_norm": output_norm}
    optional = tuple(name for name, flag in OPTIONAL_PARAMETERS.items() if not flags[flag])
    P = _params("PARAMETER_SCHEMA", params, PARAMETER_SCHEMA, optional=optional)
    if readout not in ("linear", "ratio"):
        raise ValueError(f"readout: expected 'linear' or 'ratio', got {readout!r}")
    if use_rope and P["norm_k_g"].shape[1] % 2:
        raise ValueError(f"use_rope: RoPE needs an even head dim, got {P['norm_k_g'].shape[1]}")
    d = x.shape[-1]
    H, R = P["norm_k_g"].shape
    dv = P["norm_v_g"].shape[1]
    M = P["a_log"].shape[1]
    shapes = {
        "wq": (d, H * R),
        "wk": (d, H * R),
        "wv": (d, H * dv),
        "wo": (H * dv, d),
        "conv_q": (4, H * R),
        "conv_k": (4, H * R),
        "norm_k_b": (H, R),
        "norm_v_b": (H, dv),
        "log_dt": (H,),
        "a_im": (H, M),
        "b_re": (H, M),
        "b_im": (H, M),
        "c_re": (H, M, M),
        "c_im": (H, M, M),
        "norm_o_g": (H, dv),
        "wg": (d, H * dv),
    }
    _expect(P, shapes, PARAMETER_SCHEMA)
    return _interdomain_layer(x, P, readout, use_rope, gate, output_norm)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _interdomain_layer(
    x: jax.Array,
    P: dict[str, jax.Array],
    readout: str,
    use_rope: bool,
    gate: bool,
    output_norm: bool,
) -> jax.Array:
    ct = jnp.result_type(jnp.float32, x.dtype)
    cc = jnp.result_type(ct, jnp.complex64)
    B, T, _ = x.shape
    H, R = P["norm_k_g"].shape
    dv = P["norm_v_g"].shape[1]
    wide = {key: value.astype(ct) for key, value in P.items()}
    q = short_conv(_project(x, P["wq"], ct), wide["conv_q"])  # (I8)
    k = short_conv(_project(x, P["wk"], ct), wide["conv_k"])
    v = _project(x, P["wv"], ct)  # values are not convolved
    q, k, v = q.reshape(B, T, H, R), k.reshape(B, T, H, R), v.reshape(B, T, H, dv)
    if use_rope:
        q, k = rope(q), rope(k)
    fq, fk = feature_map(q), feature_map(k)  # (I9)
    kt = rms_norm(fk, 1.0) * wide["norm_k_g"] + wide["norm_k_b"]  # (I10)
    vt = rms_norm(v, 1.0) * wide["norm_v_g"] + wide["norm_v_b"]
    a = -jnp.exp(wide["a_log"]) + 1j * wide["a_im"]  # (I11)
    dt_a = jnp.exp(wide["log_dt"])[:, None] * a
    lam = jnp.exp(dt_a).astype(cc)  # (I11) Lambda = exp(dt a)
    b_bar = jnp.expm1(dt_a) / a * (wide["b_re"] + 1j * wide["b_im"])  # (I11) zero-order hold
    b = b_bar.astype(cc)
    c = (wide["c_re"] + 1j * wide["c_im"]).astype(cc)
    o = interdomain_s4d(
        fq.astype(x.dtype),
        kt.astype(x.dtype),
        vt.astype(x.dtype),
        lam,
        b,
        c,
        readout=readout,
        validate=False,
    )  # [B, T, N, dv]
    if output_norm:
        o = rms_norm(o.astype(ct), wide["norm_o_g"])  # (I14) per head
    o = o.reshape(B, T, H * dv).astype(ct)
    if gate:
        o = jax.nn.silu(_project(x, P["wg"], ct)) * o  # SiLU(W_g x) * o
    return _project(o, P["wo"], ct).astype(x.dtype)

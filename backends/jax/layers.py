"""Flax-free layers: pure functions of an input and a parameter pytree (a dict of arrays).

The parameter dicts are those of the reference layers (``attnspec.reference.fpa.init_fpa_params``
and ``attnspec.reference.interdomain.init_interdomain_params``: same names, same shapes), so a
dict of NumPy arrays from the reference, or of JAX arrays being trained, can be passed as is;
gradients with respect to the parameters come from ``jax.grad`` of these functions.

Projections accumulate in float32 (float64 for float64 inputs); q, k, v enter the ops in the
input's dtype; field, level and the SSM parameters stay float32 or wider. An empty batch (B = 0)
gives an empty output. :func:`init_fpa_params` and :func:`init_interdomain_params` draw a
parameter dict from a PRNG key; ``*_layer_state``, ``*_layer_prefill`` and ``*_layer_step``
decode token by token with an explicit state pytree (docs/examples/generation.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from attnspec.reference.fpa import FPA_PARAMETER_SCHEMA, fpa_parameter_shapes
from attnspec.reference.hippo import s4d_init
from attnspec.reference.interdomain import (
    OPTIONAL_PARAMETERS,
    PARAMETER_SCHEMA,
    interdomain_parameter_shapes,
)

from . import validation as check
from .decode import FPACache, _decode_step, fpa_cache, raise_if_overflowed
from .fpa import fpa_attention
from .interdomain import S4DState, interdomain_s4d, interdomain_s4d_step, s4d_state

HIGHEST = lax.Precision.HIGHEST


def _params(
    name: str, params: object, schema: dict[str, str], optional: tuple[str, ...] = ()
) -> dict[str, jax.Array]:
    if not isinstance(params, dict):
        raise ValueError(f"params: expected a dict of arrays, got {type(params).__name__}")
    missing = sorted(set(schema) - set(optional) - set(params))
    if missing:
        raise ValueError(f"params: missing {missing}; see {name}")
    unknown = sorted(set(params) - set(schema))  # a typo would keep its initial value silently
    if unknown:
        raise ValueError(f"params: unknown {unknown}; see {name}")
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


def _key(key: jax.Array | int) -> jax.Array:
    """A PRNG key from a JAX key (typed or raw uint32, possibly traced) or an int seed."""
    if isinstance(key, bool) or not isinstance(key, int | jax.Array | np.ndarray):
        raise ValueError(f"key: expected a jax.random key or an int seed, got {type(key).__name__}")
    return jax.random.key(key) if isinstance(key, int) else jnp.asarray(key)


def _draw(
    key: jax.Array, shapes: dict[str, tuple[int, ...]], rules: dict[str, Callable[..., jax.Array]]
) -> dict[str, jax.Array]:
    """One array per entry of ``shapes``, drawn by ``rules[name](key, shape)`` with its own key."""
    keys = jax.random.split(key, len(shapes))
    return {name: rules[name](keys[i], shape) for i, (name, shape) in enumerate(shapes.items())}


def _rules(dtype: DTypeLike, M: int = 1) -> dict[str, Callable[..., jax.Array]]:
    """The reference's initialisation per parameter, drawn with ``jax.random`` in float32 (or
    float64) and cast to ``dtype``: matrices normal / sqrt(fan-in) (fan-in = the first axis),
    biases and norm offsets 0, norm scales 1; the S4D-Inv modes of M (I11); C normal / sqrt(2 M)
    per part; conv normal / 2; log_dt ~ U[log 1e-3, log 1e-1]."""
    wide = jnp.result_type(jnp.float32, dtype)
    a_log, a_im = s4d_init(M, "inv")

    def normal(scale: Callable[[tuple[int, ...]], float]) -> Callable[..., jax.Array]:
        return lambda key, shape: (jax.random.normal(key, shape, wide) * scale(shape)).astype(dtype)

    def constant(value: ArrayLike) -> Callable[..., jax.Array]:
        return lambda key, shape: jnp.broadcast_to(jnp.asarray(value, wide), shape).astype(dtype)

    def log_dt(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        low, high = np.log(1e-3), np.log(1e-1)
        return jax.random.uniform(key, shape, wide, low, high).astype(dtype)

    fan_in = normal(lambda shape: 1 / np.sqrt(shape[0]))
    zeros, ones = constant(0.0), constant(1.0)
    return {
        **{name: fan_in for name in ("wq", "wk", "wv", "wo", "wg", "w_delta", "w_lam")},
        **{name: zeros for name in ("b_delta", "b_lam", "norm_k_b", "norm_v_b", "b_im")},
        **{name: ones for name in ("norm_k_g", "norm_v_g", "norm_o_g", "b_re")},
        "conv_q": normal(lambda shape: 0.5),
        "conv_k": normal(lambda shape: 0.5),
        "log_dt": log_dt,
        "a_log": constant(a_log),
        "a_im": constant(a_im),
        "c_re": normal(lambda shape: 1 / np.sqrt(2 * M)),
        "c_im": normal(lambda shape: 1 / np.sqrt(2 * M)),
    }


def _sizes(**sizes: object) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def init_fpa_params(
    key: jax.Array | int, d: int, H: int, dk: int, dv: int, *, dtype: DTypeLike = jnp.float32
) -> dict[str, jax.Array]:
    """Parameters of :func:`fpa_layer` (``FPA_PARAMETER_SCHEMA``): the reference's
    initialisation (``attnspec.reference.fpa.init_fpa_params``: normal / sqrt(fan-in), biases
    0) drawn with ``jax.random`` from ``key`` (a key or an int seed), in ``dtype``. Traceable:
    works under jit (sizes static) and vmap over keys. Time and memory O(d H (dk + dv))."""
    _sizes(d=d, H=H, dk=dk, dv=dv)
    return _draw(_key(key), fpa_parameter_shapes(d, H, dk, dv), _rules(dtype))


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
    initialisation (``attnspec.reference.interdomain.init_interdomain_params``) drawn with
    ``jax.random`` from ``key`` (a key or an int seed), in ``dtype``; norm_o_g (I14) with
    ``output_norm``, wg with ``gate``. Traceable: works under jit (sizes static) and vmap over
    keys. Time and memory O(d H (R + dv) + H M^2)."""
    _sizes(d=d, H=H, R=R, dv=dv, M=M)
    shapes = interdomain_parameter_shapes(d, H, R, dv, M, output_norm=output_norm, gate=gate)
    return _draw(_key(key), shapes, _rules(dtype, M))


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
    _expect(P, fpa_parameter_shapes(d, H, dk, dv), FPA_PARAMETER_SCHEMA)
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


def rope(x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on the last axis of x [B, T, N, R], R even; base 10000; at
    ``positions`` [T] (default 0..T-1). O(size)."""
    T, R = x.shape[1], x.shape[-1]
    freq = 10000.0 ** (-jnp.arange(R // 2) / (R // 2))
    positions = jnp.arange(T) if positions is None else positions
    angle = positions[:, None] * freq  # (T, R/2)
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
    P = _interdomain_params(x.shape[-1], params, readout, use_rope, gate, output_norm)
    return _interdomain_layer(x, P, readout, use_rope, gate, output_norm)


def _interdomain_params(
    d: int, params: object, readout: str, use_rope: bool, gate: bool, output_norm: bool
) -> dict[str, jax.Array]:
    """The checked parameter dict of the Interdomain layer for width d."""
    flags = {"gate": gate, "output_norm": output_norm}
    optional = tuple(name for name, flag in OPTIONAL_PARAMETERS.items() if not flags[flag])
    P = _params("PARAMETER_SCHEMA", params, PARAMETER_SCHEMA, optional=optional)
    if readout not in ("linear", "ratio"):
        raise ValueError(f"readout: expected 'linear' or 'ratio', got {readout!r}")
    if use_rope and P["norm_k_g"].shape[1] % 2:
        raise ValueError(f"use_rope: RoPE needs an even head dim, got {P['norm_k_g'].shape[1]}")
    H, R = P["norm_k_g"].shape
    dv = P["norm_v_g"].shape[1]
    M = P["a_log"].shape[1]
    # every parameter given is checked, the optional ones too when their flag is off
    shapes = interdomain_parameter_shapes(d, H, R, dv, M, output_norm=True, gate=True)
    _expect(P, shapes, PARAMETER_SCHEMA)
    return P


def _ssm(wide: dict[str, jax.Array], cc: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(I11) Lambda = exp(dt a), the zero-order hold b_bar = (Lambda - 1) / a (.) b, and C."""
    a = -jnp.exp(wide["a_log"]) + 1j * wide["a_im"]  # (I11)
    dt_a = jnp.exp(wide["log_dt"])[:, None] * a
    lam = jnp.exp(dt_a).astype(cc)  # (I11) Lambda = exp(dt a)
    b_bar = jnp.expm1(dt_a) / a * (wide["b_re"] + 1j * wide["b_im"])  # (I11) zero-order hold
    c = (wide["c_re"] + 1j * wide["c_im"]).astype(cc)
    return lam, b_bar.astype(cc), c


def _features(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    wide: dict[str, jax.Array],
    use_rope: bool,
    positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(I9), (I10) from the convolved q, k and v [B, T, N, .]: fq, kt, vt."""
    if use_rope:
        q, k = rope(q, positions), rope(k, positions)
    fq, fk = feature_map(q), feature_map(k)  # (I9)
    kt = rms_norm(fk, 1.0) * wide["norm_k_g"] + wide["norm_k_b"]  # (I10)
    vt = rms_norm(v, 1.0) * wide["norm_v_g"] + wide["norm_v_b"]
    return fq, kt, vt


def _readout(
    x: jax.Array, o: jax.Array, wide: dict[str, jax.Array], gate: bool, output_norm: bool
) -> jax.Array:
    """o [..., N, dv] -> y [..., d]: (I14) per head, heads concatenated, gate, projection."""
    ct = wide["wo"].dtype
    if output_norm:
        o = rms_norm(o.astype(ct), wide["norm_o_g"])  # (I14) per head
    o = o.reshape(*o.shape[:-2], o.shape[-2] * o.shape[-1]).astype(ct)  # concatenate heads
    if gate:
        o = jax.nn.silu(_project(x, wide["wg"], ct)) * o  # SiLU(W_g x) * o
    return _project(o, wide["wo"], ct)


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
    fq, kt, vt = _features(q, k, v, wide, use_rope)  # (I9), (I10)
    lam, b, c = _ssm(wide, cc)  # (I11)
    fq, kt, vt = fq.astype(x.dtype), kt.astype(x.dtype), vt.astype(x.dtype)
    o = interdomain_s4d(fq, kt, vt, lam, b, c, readout=readout, validate=False)  # [B, T, N, dv]
    return _readout(x, o, wide, gate, output_norm).astype(x.dtype)


# decoding, token by token


class FPALayerState(NamedTuple):
    """Decode state of :func:`fpa_layer_step`: the (F7) cache and the field phi of the last
    token [B, N] (zero before the first). A pytree: it passes through jit and scan."""

    cache: FPACache
    field: jax.Array


def fpa_layer_state(
    params: dict[str, Any], batch: int, capacity: int, *, dtype: DTypeLike = jnp.float32
) -> FPALayerState:
    """An empty decode state for ``batch`` sequences of up to ``capacity`` live keys per head
    (capacity = the longest sequence never overflows; see ``fpa_cache``); ``dtype`` float32 or
    float64, the compute dtype. Memory O(B N S (dk + dv))."""
    P = _params("FPA_PARAMETER_SCHEMA", params, FPA_PARAMETER_SCHEMA)
    H = P["b_delta"].shape[0]
    dk, dv = P["wq"].shape[1] // H, P["wv"].shape[1] // H
    cache = fpa_cache(batch, H, capacity, dk, dv, dtype=dtype)
    return FPALayerState(cache, jnp.zeros((batch, H), cache.levels.dtype))


def fpa_layer_step(
    x: ArrayLike,
    params: dict[str, Any],
    state: FPALayerState,
    *,
    increments: str = "signed",
    theta: ArrayLike = jnp.inf,
) -> tuple[jax.Array, FPALayerState]:
    """One token of :func:`fpa_layer`: x [B, d] -> (y [B, d] in x's dtype, the next state).

    phi_t = phi_{t-1} + delta_t, l_t = phi_t + lam_t, then one step of the (F7) cache, evicting
    keys at depth >= ``theta`` (inf: none, so the steps equal the parallel layer). A full
    cache (every slot live when a key must be added) is a ValueError naming the capacity when
    called eagerly; under jit the returned ``state.cache.overflowed`` is set instead, and the
    caller must read it (any True is a failure). Time and memory O(B N S (dk + dv) + B d N
    (dk + dv)) per token for S slots.
    """
    x = check.array("x", x, 2, meaning="[B, d]")
    P = _params("FPA_PARAMETER_SCHEMA", params, FPA_PARAMETER_SCHEMA)
    if increments not in ("signed", "logsigmoid"):
        raise ValueError(f"increments: expected 'signed' or 'logsigmoid', got {increments!r}")
    check.shape("state.field", state.field, (x.shape[0], P["b_delta"].shape[0]), "[B, N]")
    scale = check.scale(None, P["wq"].shape[1] // P["b_delta"].shape[0])
    y, new = _fpa_step(x, P, state, jnp.asarray(theta), increments, scale)
    raise_if_overflowed(new.cache.overflowed, new.cache.keys.shape[2])
    return y, new


def fpa_layer_prefill(
    x: ArrayLike,
    params: dict[str, Any],
    state: FPALayerState,
    *,
    increments: str = "signed",
    theta: ArrayLike = jnp.inf,
) -> tuple[jax.Array, FPALayerState]:
    """A prompt x [B, T, d] into ``state``: (y [B, T, d], the state after it), by a scan of
    :func:`fpa_layer_step`; equals T calls of it (a full cache as there: a ValueError eagerly,
    the ``overflowed`` flag under jit). Time O(T) steps of O(S) each."""
    x = check.array("x", x, 3, meaning="[B, T, d]")
    P = _params("FPA_PARAMETER_SCHEMA", params, FPA_PARAMETER_SCHEMA)
    if increments not in ("signed", "logsigmoid"):
        raise ValueError(f"increments: expected 'signed' or 'logsigmoid', got {increments!r}")
    scale = check.scale(None, P["wq"].shape[1] // P["b_delta"].shape[0])
    theta = jnp.asarray(theta)

    def step(xt: jax.Array, s: FPALayerState) -> tuple[jax.Array, FPALayerState]:
        return _fpa_step(xt, P, s, theta, increments, scale)

    y, new = _scan_steps(step, x, state)
    raise_if_overflowed(new.cache.overflowed, new.cache.keys.shape[2])
    return y, new


StateT = TypeVar("StateT")


def _scan_steps(
    step: Callable[[jax.Array, StateT], tuple[jax.Array, StateT]], x: jax.Array, state: StateT
) -> tuple[jax.Array, StateT]:
    """Run ``step`` over the tokens of x [B, T, d]: (the outputs [B, T, d], the last state)."""

    def body(s: StateT, xt: jax.Array) -> tuple[StateT, jax.Array]:
        y, s = step(xt, s)
        return s, y

    state, ys = lax.scan(body, state, jnp.swapaxes(x, 0, 1))
    return jnp.swapaxes(ys, 0, 1), state


@functools.partial(jax.jit, static_argnums=(4, 5))
def _fpa_step(
    x: jax.Array,
    P: dict[str, jax.Array],
    state: FPALayerState,
    theta: jax.Array,
    increments: str,
    scale: float,
) -> tuple[jax.Array, FPALayerState]:
    ct = state.cache.levels.dtype
    q, k, v, field, level = fpa_token_inputs(x, P, state.field, increments, ct)
    o, cache = _decode_step(state.cache, q, k, v, field, level, theta, scale)  # (F7)
    return fpa_token_output(o, P, ct).astype(x.dtype), FPALayerState(cache, field)


def fpa_token_inputs(
    x: jax.Array, P: dict[str, jax.Array], previous: jax.Array, increments: str, ct: jnp.dtype
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token's attention inputs in the FPA layer: x [B, d] and the field of the token
    before [B, N] -> q, k [B, N, dk], v [B, N, dv] in x's dtype, field phi_t and level l_t
    [B, N] in ``ct`` (spec/fpa.md section 3)."""
    B, H = previous.shape
    heads = lambda y: y.reshape(B, H, y.shape[-1] // H).astype(x.dtype)  # noqa: E731
    delta = _project(x, P["w_delta"], ct) + P["b_delta"].astype(ct)  # [B, N]
    if increments == "logsigmoid":
        delta = jax.nn.log_sigmoid(delta)
    field = previous + delta  # phi_t
    level = field + _project(x, P["w_lam"], ct) + P["b_lam"].astype(ct)  # l_t = phi_t + lam_t
    q, k, v = (heads(_project(x, P[w], ct)) for w in ("wq", "wk", "wv"))
    return q, k, v, field, level


def fpa_token_output(o: jax.Array, P: dict[str, jax.Array], ct: jnp.dtype) -> jax.Array:
    """The attention output o [B, N, dv] -> y [B, d] in ``ct``: heads concatenated, W_o."""
    return _project(o.reshape(o.shape[0], o.shape[1] * o.shape[2]), P["wo"], ct)


class InterdomainLayerState(NamedTuple):
    """Decode state of :func:`interdomain_layer_step`: the short-conv windows (the last K - 1
    projected queries and keys, [B, K - 1, N R]), the S4D state (H6) and the position (for
    RoPE). Its size does not grow with T. A pytree."""

    conv_q: jax.Array
    conv_k: jax.Array
    ssm: S4DState
    position: jax.Array


def interdomain_layer_state(
    params: dict[str, Any],
    batch: int,
    *,
    readout: str = "linear",
    dtype: DTypeLike = jnp.float32,
) -> InterdomainLayerState:
    """The zero state before the first token; ``dtype`` float32 or float64 (the S4D state is
    complex of that width). Memory O(B N (M (R + dv) + K R))."""
    H, R = jnp.shape(params["norm_k_g"])
    dv, M = jnp.shape(params["norm_v_g"])[1], jnp.shape(params["a_log"])[1]
    ct = jnp.result_type(jnp.float32, dtype)
    window = jnp.zeros((batch, jnp.shape(params["conv_q"])[0] - 1, H * R), ct)
    complex_dtype = jnp.result_type(ct, jnp.complex64)
    ssm = s4d_state(batch, H, M, R, dv, readout=readout, dtype=complex_dtype)
    return InterdomainLayerState(window, window, ssm, jnp.zeros((), jnp.int32))


def interdomain_layer_step(
    x: ArrayLike,
    params: dict[str, Any],
    state: InterdomainLayerState,
    *,
    readout: str = "linear",
    use_rope: bool = False,
    gate: bool = False,
    output_norm: bool = True,
) -> tuple[jax.Array, InterdomainLayerState]:
    """One token of :func:`interdomain_layer`: x [B, d] -> (y [B, d] in x's dtype, the next
    state); options as there. Steps from :func:`interdomain_layer_state` equal the parallel
    layer token by token (H6). Time O(B (d N (R + dv) + N M (M + R + dv))) per token."""
    x = check.array("x", x, 2, meaning="[B, d]")
    P = _interdomain_params(x.shape[-1], params, readout, use_rope, gate, output_norm)
    H, R = P["norm_k_g"].shape
    window = (x.shape[0], P["conv_q"].shape[0] - 1, H * R)
    check.shape("state.conv_q", state.conv_q, window, "[B, K - 1, N R]")
    return _interdomain_step(x, P, state, readout, use_rope, gate, output_norm)


def interdomain_layer_prefill(
    x: ArrayLike,
    params: dict[str, Any],
    state: InterdomainLayerState,
    *,
    readout: str = "linear",
    use_rope: bool = False,
    gate: bool = False,
    output_norm: bool = True,
) -> tuple[jax.Array, InterdomainLayerState]:
    """A prompt x [B, T, d] into ``state``: (y [B, T, d], the state after it), by a scan of
    :func:`interdomain_layer_step`; equals T calls of it. Time O(T) steps."""
    x = check.array("x", x, 3, meaning="[B, T, d]")
    P = _interdomain_params(x.shape[-1], params, readout, use_rope, gate, output_norm)

    def step(xt: jax.Array, s: InterdomainLayerState) -> tuple[jax.Array, InterdomainLayerState]:
        return _interdomain_step(xt, P, s, readout, use_rope, gate, output_norm)

    return _scan_steps(step, x, state)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _interdomain_step(
    x: jax.Array,
    P: dict[str, jax.Array],
    state: InterdomainLayerState,
    readout: str,
    use_rope: bool,
    gate: bool,
    output_norm: bool,
) -> tuple[jax.Array, InterdomainLayerState]:
    ct = jnp.result_type(jnp.float32, x.dtype)
    cc = jnp.result_type(ct, jnp.complex64)
    B = x.shape[0]
    H, R = P["norm_k_g"].shape
    dv = P["norm_v_g"].shape[1]
    wide = {key: value.astype(ct) for key, value in P.items()}

    def conv(window: jax.Array, w: jax.Array, new: jax.Array) -> tuple[jax.Array, jax.Array]:
        full = jnp.concatenate([window.astype(ct), new[:, None]], axis=1)  # oldest first
        return jnp.sum(full * w[::-1], axis=1), full[:, 1:]  # (I8) w_s multiplies x_{t-s}

    q, conv_q = conv(state.conv_q, wide["conv_q"], _project(x, P["wq"], ct))
    k, conv_k = conv(state.conv_k, wide["conv_k"], _project(x, P["wk"], ct))
    v = _project(x, P["wv"], ct)  # values are not convolved
    q, k, v = q.reshape(B, 1, H, R), k.reshape(B, 1, H, R), v.reshape(B, 1, H, dv)
    fq, kt, vt = _features(q, k, v, wide, use_rope, state.position[None])  # (I9), (I10)
    lam, b, c = _ssm(wide, cc)  # (I11)
    fq, kt, vt = (y[:, 0].astype(x.dtype) for y in (fq, kt, vt))
    o, ssm = interdomain_s4d_step(state.ssm, fq, kt, vt, lam, b, c, readout=readout)
    y = _readout(x, o, wide, gate, output_norm)
    return y.astype(x.dtype), InterdomainLayerState(conv_q, conv_k, ssm, state.position + 1)

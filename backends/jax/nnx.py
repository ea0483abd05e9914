"""Flax NNX modules of both layers: ``FirstPassageAttention`` and ``InterdomainAttention``.

Each holds the arrays of its parameter schema as ``nnx.Param`` (drawn by ``init_fpa_params`` /
``init_interdomain_params`` of :mod:`attnspec.backends.jax` from ``rngs.params()``) and calls
the functional layers (``fpa_layer``, ``interdomain_layer``), so its values are theirs on the
same parameters. Decoding follows ``nnx.MultiHeadAttention``: ``init_cache(batch, max_len)`` puts
the decode state into ``nnx.Cache`` variables and ``layer(x, decode=True)`` consumes the tokens
of x [B, T, d] one by one (by the layers' ``*_layer_prefill``), equal to the parallel call.
The modules compose with ``nnx.jit``, ``nnx.grad``, ``nnx.split`` / ``nnx.merge`` and
``nnx.vmap``; ``sharding="heads"`` annotates every parameter's head axis with that mesh axis
(``out_sharding``: the parameters are sharded when created under ``jax.set_mesh``). Needs the
``flax`` extra.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from attnspec.reference.fpa import fpa_parameter_shapes
from attnspec.reference.interdomain import interdomain_parameter_shapes

from . import validation as check
from .decode import FPACache
from .layers import (
    _sizes,
    fpa_layer,
    fpa_layer_prefill,
    fpa_layer_state,
    init_fpa_params,
    init_interdomain_params,
    interdomain_layer,
    interdomain_layer_prefill,
    interdomain_layer_state,
)

# the decode path compiled once per shape and option (the layers' prefill is a scan, which
# would be traced anew on every eager call)
_fpa_prefill = jax.jit(fpa_layer_prefill, static_argnames=("increments",))
_interdomain_prefill = jax.jit(
    interdomain_layer_prefill, static_argnames=("readout", "use_rope", "gate", "output_norm")
)
HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# the axis of each parameter that runs over heads: axis 1 of the matrices read from x (their
# columns are H blocks), axis 0 of everything else (wo's rows, the per-head vectors and tables)
_COLUMNS_BY_HEAD = ("wq", "wk", "wv", "wg", "w_delta", "w_lam", "conv_q", "conv_k")


def _partition(name: str, ndim: int, axis: str | None) -> dict[str, Any]:
    """The ``out_sharding`` metadata of a parameter: ``axis`` on its head axis, or none."""
    if axis is None:
        return {}
    head = 1 if name in _COLUMNS_BY_HEAD else 0
    return {"out_sharding": tuple(axis if i == head else None for i in range(ndim))}


class _Layer(nnx.Module):
    """What both layers share: parameters from a dict, x's checks, the decode cache."""

    d_model: int
    param_dtype: jnp.dtype

    def _set_params(self, params: dict[str, jax.Array], sharding: str | None) -> None:
        self._names = tuple(params)
        for name, value in params.items():
            setattr(self, name, nnx.Param(value, **_partition(name, value.ndim, sharding)))
        self._cache_names: tuple[str, ...] = ()
        self.max_len: int | None = None

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def load_params(self, params: dict[str, Any]) -> None:
        """Set the parameters from a dict of the schema (the functional layers' or the
        reference's, NumPy or JAX), cast to param_dtype; a missing or unknown name or a wrong
        shape is a ValueError naming it, the layer unchanged."""
        if not isinstance(params, dict):
            raise ValueError(f"params: expected a dict of arrays, got {type(params).__name__}")
        shapes = self.parameter_shapes()
        for problem, names in (
            ("missing", set(shapes) - set(params)),
            ("unknown", set(params) - set(shapes)),
        ):
            if names:
                raise ValueError(f"params: {problem} {sorted(names)} for this layer's schema")
        values = {}
        for name, shape in shapes.items():
            value = check.array(f"params[{name!r}]", params[name], len(shape))
            check.shape(f"params[{name!r}]", value, shape, "the layer's parameter_shapes()")
            values[name] = value.astype(self.param_dtype)
        for name, value in values.items():
            getattr(self, name).set_value(value)

    def param_dict(self) -> dict[str, jax.Array]:
        """The parameters as the functional layers take them: {schema name: array}."""
        return {name: getattr(self, name).get_value() for name in self._names}

    def _check_x(self, x: object) -> jax.Array:
        if self.param_dtype == jnp.float64 and _x64_off():
            raise ValueError(
                "x: the layer's param_dtype is float64 and JAX's 64-bit mode is off at this "
                f"call (it was on when the layer was built): {_X64_HOW}"
            )
        x = check.array("x", x, 3, meaning="[B, T, d_model]")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected width d_model = {self.d_model}, got shape {x.shape}")
        allowed = (self.param_dtype, *(HALF if self.param_dtype == jnp.float32 else ()))
        if x.dtype not in allowed:
            names = ", ".join(str(d) for d in allowed)
            raise ValueError(
                f"x: expected dtype {names} (the layer's param_dtype {self.param_dtype}"
                f"{' or half precision' if len(allowed) > 1 else ''}), got {x.dtype}"
            )
        return x

    def _store(self, state: Any) -> None:
        """Write a decode state pytree into the layer's ``nnx.Cache`` variables."""
        leaves = jax.tree.leaves(state)
        if not self._cache_names:
            self._cache_tree = jax.tree.structure(state)
            self._cache_names = tuple(
                f"cache_{n.removeprefix('cache_')}" for n in _leaf_names(state)
            )
            for name, leaf in zip(self._cache_names, leaves, strict=True):
                setattr(self, name, nnx.Cache(leaf))
            return
        for name, leaf in zip(self._cache_names, leaves, strict=True):
            getattr(self, name).set_value(leaf)

    @property
    def decode_state(self) -> Any:
        """The decode state held in the caches (``FPALayerState`` / ``InterdomainLayerState``),
        the pytree of the functional ``*_layer_step``; ValueError before :meth:`init_cache`."""
        if not self._cache_names:
            raise ValueError("cache: not initialised; call init_cache(batch, max_len) first")
        leaves = [getattr(self, name).get_value() for name in self._cache_names]
        return jax.tree.unflatten(self._cache_tree, leaves)

    @property
    def cache_length(self) -> jax.Array:
        """Tokens consumed since :meth:`init_cache` (int32 scalar)."""
        return self._position(self.decode_state)

    def _position(self, state: Any) -> jax.Array:
        raise NotImplementedError

    def _decode_checks(self, x: jax.Array) -> Any:
        """The state to decode x from: its batch and dtype checked, and the length it leaves."""
        state = self.decode_state
        batch = jax.tree.leaves(state)[0].shape[0]
        if x.shape[0] != batch:
            raise ValueError(f"x: expected batch {batch} (the cache's), got shape {x.shape}")
        wide = jnp.result_type(jnp.float32, x.dtype)
        if wide != self._cache_dtype(state):
            raise ValueError(
                f"x: expected a dtype computing in {self._cache_dtype(state)} (the cache's), "
                f"got {x.dtype}"
            )
        position = self._position(state)
        assert self.max_len is not None
        if check.concrete(position) and int(position) + x.shape[1] > self.max_len:
            raise ValueError(
                f"cache: full: {int(position)} of max_len = {self.max_len} tokens used, "
                f"{x.shape[1]} more given; call init_cache with a larger max_len"
            )
        return state

    def _cache_dtype(self, state: Any) -> jnp.dtype:
        raise NotImplementedError


def _leaf_names(state: Any) -> list[str]:
    """Attribute names of a NamedTuple pytree's leaves: their field paths joined by '_'."""
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    return ["_".join(str(getattr(k, "name", k)) for k in path) for path, _ in paths]


class FirstPassageAttention(_Layer):
    """Multi-head FPA layer (spec/fpa.md section 3) as an ``nnx.Module``: x [B, T, d] -> y.

    Args:
        d_model, n_heads, head_dim: width d, heads H, query/key width dk.
        value_dim: dv (default head_dim).
        increments: "signed" or "logsigmoid" (the FoX-initialised layer).
        theta: the decode cache's eviction threshold (F7; inf: none, decoding equals the
            parallel call). implementation: of the parallel op ("xla" or "pallas").
        decode: the default of ``__call__``'s ``decode``.
        param_dtype: the parameters' dtype (float32 or float64; x in it, or half precision
            with float32 parameters).
        sharding: a mesh axis name for the heads (``out_sharding`` of every parameter), or None.
        rngs: ``nnx.Rngs``; the parameters are drawn from ``rngs.params()``.

    Parameters (``nnx.Param``): the arrays of ``FPA_PARAMETER_SCHEMA``, as attributes of those
    names. Time and memory: those of :func:`attnspec.backends.jax.fpa_layer`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        increments: str = "signed",
        theta: float = math.inf,
        implementation: str = "xla",
        decode: bool = False,
        param_dtype: DTypeLike = jnp.float32,
        sharding: str | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        _sizes(d_model=d_model, n_heads=n_heads, head_dim=head_dim, value_dim=value_dim)
        if increments not in ("signed", "logsigmoid"):
            raise ValueError(f"increments: expected 'signed' or 'logsigmoid', got {increments!r}")
        if isinstance(theta, complex) or not float(theta) > 0:
            raise ValueError(f"theta: expected a positive threshold (or inf), got {theta!r}")
        self.param_dtype = _param_dtype(param_dtype)
        self.d_model, self.n_heads, self.head_dim, self.value_dim = (
            d_model,
            n_heads,
            head_dim,
            value_dim,
        )
        self.increments, self.theta, self.implementation = increments, float(theta), implementation
        self.decode = decode
        params = init_fpa_params(
            rngs.params(), d_model, n_heads, head_dim, value_dim, dtype=self.param_dtype
        )
        self._set_params(params, sharding)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The reference's shapes (``fpa_parameter_shapes``) for this layer's sizes."""
        return fpa_parameter_shapes(self.d_model, self.n_heads, self.head_dim, self.value_dim)

    def init_cache(self, batch: int, max_len: int, *, slots: int | None = None) -> None:
        """Empty decode caches (``nnx.Cache``) for ``batch`` sequences of up to ``max_len``
        tokens, with ``slots`` key slots per head (default max_len: never full; with eviction,
        theta < inf, fewer can do: size them from the bound T3). Memory
        O(B H slots (dk + dv))."""
        slots = max_len if slots is None else slots
        _sizes(batch=batch, max_len=max_len, slots=slots)
        self.max_len = max_len
        wide = jnp.result_type(jnp.float32, self.param_dtype)
        self._store(fpa_layer_state(self.param_dict(), batch, slots, dtype=wide))

    def __call__(self, x: jax.Array, *, decode: bool | None = None) -> jax.Array:
        """x [B, T, d] -> y [B, T, d] in x's dtype. With ``decode`` (default: the layer's),
        the T tokens extend the cache of :meth:`init_cache` one by one; the layer's caches
        then hold the state after them. A cache that cannot hold them is a ValueError (named
        ``cache``, the caches unchanged): eagerly before the call when max_len is reached,
        and after it when every slot is live (``overflowed``; under jit only the flag)."""
        x = self._check_x(x)
        P = self.param_dict()
        if not (self.decode if decode is None else decode):
            return fpa_layer(x, P, increments=self.increments, implementation=self.implementation)
        state = self._decode_checks(x)
        y, state = _fpa_prefill(x, P, state, increments=self.increments, theta=self.theta)
        if check.concrete(state.cache.overflowed) and bool(jnp.any(state.cache.overflowed)):
            raise ValueError(
                f"cache: full: every one of its {state.cache.live.shape[-1]} slots of a head "
                "was live when a key came; call init_cache with more slots (or a smaller theta)"
            )
        self._store(state)
        return y

    def _position(self, state: Any) -> jax.Array:
        return state.cache.steps

    def _cache_dtype(self, state: Any) -> jnp.dtype:
        return jnp.dtype(state.cache.levels.dtype)

    @property
    def kept_fraction(self) -> jax.Array:
        """Peak live keys over tokens consumed, per sequence and head [B, H] (1.0 without
        eviction): the eviction statistic of (F7), T3."""
        cache: FPACache = self.decode_state.cache
        return cache.kept_fraction

    @property
    def peak(self) -> jax.Array:
        """The most live keys seen per sequence and head [B, H] (int32)."""
        return self.decode_state.cache.peak

    @property
    def overflowed(self) -> jax.Array:
        """Whether a key found no free slot, per sequence and head [B, H] (bool)."""
        return self.decode_state.cache.overflowed


class InterdomainAttention(_Layer):
    """The Interdomain layer (I8)-(I14) as an ``nnx.Module``: x [B, T, d] -> y [B, T, d].

    Args:
        d_model, n_heads, head_dim: width d, heads H, feature size R.
        value_dim: dv (default head_dim). n_modes: M.
        readout: "linear" (I13) or "ratio". gate: SiLU output gate (wg). use_rope: RoPE on
            q, k. output_norm: the readout's RMSNorm (I14; norm_o_g).
        decode, param_dtype, sharding, rngs: as :class:`FirstPassageAttention`.

    Parameters (``nnx.Param``): the arrays of ``PARAMETER_SCHEMA`` the flags ask for. Time and
    memory: those of :func:`attnspec.backends.jax.interdomain_layer`; the decode state does
    not grow with T.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        n_modes: int = 64,
        *,
        readout: str = "linear",
        gate: bool = False,
        use_rope: bool = False,
        output_norm: bool = True,
        decode: bool = False,
        param_dtype: DTypeLike = jnp.float32,
        sharding: str | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        sizes = dict(d_model=d_model, n_heads=n_heads, head_dim=head_dim, value_dim=value_dim)
        _sizes(**sizes, n_modes=n_modes)
        if readout not in ("linear", "ratio"):
            raise ValueError(f"readout: expected 'linear' or 'ratio', got {readout!r}")
        if use_rope and head_dim % 2:
            raise ValueError(f"use_rope: RoPE needs an even head_dim, got {head_dim}")
        self.param_dtype = _param_dtype(param_dtype)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.value_dim, self.n_modes = value_dim, n_modes
        self.readout, self.gate, self.use_rope = readout, gate, use_rope
        self.output_norm, self.decode = output_norm, decode
        params = init_interdomain_params(
            rngs.params(),
            d_model,
            n_heads,
            head_dim,
            value_dim,
            n_modes,
            gate=gate,
            output_norm=output_norm,
            dtype=self.param_dtype,
        )
        self._set_params(params, sharding)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The reference's shapes (``interdomain_parameter_shapes``) for these sizes and flags."""
        return interdomain_parameter_shapes(
            self.d_model,
            self.n_heads,
            self.head_dim,
            self.value_dim,
            self.n_modes,
            output_norm=self.output_norm,
            gate=self.gate,
        )

    def _options(self) -> dict[str, Any]:
        return dict(
            readout=self.readout,
            use_rope=self.use_rope,
            gate=self.gate,
            output_norm=self.output_norm,
        )

    def init_cache(self, batch: int, max_len: int) -> None:
        """The zero decode state (``nnx.Cache``: short-conv windows, S4D state, position) for
        ``batch`` sequences of up to ``max_len`` tokens; its size does not depend on max_len
        (H6). Memory O(B H (M (R + dv) + K R))."""
        _sizes(batch=batch, max_len=max_len)
        self.max_len = max_len
        wide = jnp.result_type(jnp.float32, self.param_dtype)
        state = interdomain_layer_state(self.param_dict(), batch, readout=self.readout, dtype=wide)
        self._store(state)

    def __call__(self, x: jax.Array, *, decode: bool | None = None) -> jax.Array:
        """x [B, T, d] -> y [B, T, d] in x's dtype; with ``decode``, the tokens extend the
        state of :meth:`init_cache` (H6), equal to the parallel call; more than max_len tokens
        in all is a ValueError naming ``cache`` (eagerly; the caches unchanged)."""
        x = self._check_x(x)
        P = self.param_dict()
        if not (self.decode if decode is None else decode):
            return interdomain_layer(x, P, **self._options())
        state = self._decode_checks(x)
        y, state = _interdomain_prefill(x, P, state, **self._options())
        self._store(state)
        return y

    def _position(self, state: Any) -> jax.Array:
        return state.position

    def _cache_dtype(self, state: Any) -> jnp.dtype:
        return jnp.dtype(state.conv_q.dtype)


# JAX makes float32 arrays when asked for float64 while its 64-bit mode is off
_X64_HOW = (
    "turn it on with jax.config.update('jax_enable_x64', True) (or JAX_ENABLE_X64=1, or inside "
    "`with jax.enable_x64(True):`), or use param_dtype=float32"
)


def _x64_off() -> bool:
    """JAX's 64-bit mode is off here (process-wide or in the enclosing ``jax.enable_x64``)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64) != jnp.float64


def _param_dtype(dtype: DTypeLike) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in check.WIDE:
        raise ValueError(f"param_dtype: expected float32 or float64, got {dtype}")
    if dtype == jnp.float64 and _x64_off():
        raise ValueError(f"param_dtype: float64 needs JAX's 64-bit mode, which is off: {_X64_HOW}")
    return dtype


__all__ = ["FirstPassageAttention", "InterdomainAttention"]

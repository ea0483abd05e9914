"""Input checks at the public boundary of the JAX backend.

Shapes, ranks and dtypes are static: they are checked at trace time and raise ``ValueError``
naming the argument, what was expected and what arrived, also under ``jax.jit``. Values (NaN or
Inf in field, level and log_f; positive log gates) can only be checked on concrete arrays: they are
checked when the public function is called eagerly with ``validate=True`` (the default) and
skipped while tracing, where a check would need a host round trip. Under ``jit``, validate inputs
eagerly first (``check_values``) or wrap the call in ``jax.experimental.checkify``.
Nothing is broadcast or moved between devices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from attnspec.reference.packing import packing

WIDE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))
REAL = (
    jnp.dtype(jnp.float64),
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.bfloat16),
)


def array(
    name: str, x: object, ndim: int, dtypes: tuple[jnp.dtype, ...] = REAL, meaning: str = ""
) -> jax.Array:
    """``x`` as a JAX array of rank ``ndim`` and one of ``dtypes`` (NumPy input is accepted)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name}: expected an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype {names}, got {x.dtype}")
    if len(x.shape) != ndim:  # the rank, read from the attribute checked above
        what = f" {meaning}" if meaning else ""
        raise ValueError(f"{name}: expected {ndim} dimensions{what}, got shape {x.shape}")
    return jnp.asarray(x)


def shape(name: str, x: jax.Array, expected: tuple[int, ...], meaning: str) -> None:
    """Require ``x.shape == expected``; ``meaning`` spells the layout for the message."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({meaning}), got {x.shape}")


def same_dtype(name: str, x: jax.Array, like: jax.Array, like_name: str) -> None:
    if x.dtype != like.dtype:
        raise ValueError(f"{name}: expected dtype {like.dtype} (as {like_name}), got {x.dtype}")


def length(name: str, T: int) -> None:
    if T < 1:
        raise ValueError(f"{name}: expected a sequence of length T >= 1, got T = {T}")


def scale(value: float | None, head_dim: int) -> float:
    """The softmax scale as a Python float (static); default 1/sqrt(head_dim)."""
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            "scale must be a static Python number, got a traced array: pass it as a static "
            "argument (jax.jit(..., static_argnames=...)) or close over it; a learned "
            "temperature can scale q instead"
        )
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise ValueError(f"scale: expected a real number (a static Python float), got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite number, got {value}")
    return value


def offsets(cu_seqlens: object, batch: int, T: int) -> tuple[int, ...] | None:
    """Static packed-sequence offsets (0, ..., T) as a tuple of ints, checked by the one rule
    of :mod:`attnspec.reference.packing` (zero-length sequences allowed); B must be 1."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, jax.core.Tracer):
        raise ValueError(
            "cu_seqlens: expected static offsets (a tuple of Python ints), got a traced array; "
            "pass it as a static argument"
        )
    plan = packing(cu_seqlens, T, batch=batch)
    assert plan is not None
    return plan.offsets


def concrete(x: object) -> bool:
    """True when ``x`` holds values (not a tracer inside jit, grad or vmap)."""
    return not isinstance(x, jax.core.Tracer)


def widened(x: jax.Array) -> jax.Array:
    """A per-token scalar (field, level, log_f) in float32 or float64: float16 and bfloat16,
    as a drop-in call passes gates in the input's dtype, are widened to float32; they carry no
    more precision than they arrive with. Its gradient returns in the dtype it arrived in."""
    return x if jnp.dtype(x.dtype) in WIDE else x.astype(jnp.float32)


def check_values(name: str, x: jax.Array, *, nonpositive: bool = False) -> None:
    """ValueError when a concrete ``x`` holds NaN or Inf (or, with ``nonpositive``, a value > 0).

    Does nothing for tracers: see the module docstring.
    """
    if not concrete(x):
        return
    # the two verdicts on x's device, evaluated now (also inside a trace that closed over x),
    # and only they come to the host; x itself is copied only to name the first bad index
    with jax.ensure_compile_time_eval():
        verdicts = (jnp.all(jnp.isfinite(x)), jnp.all(x <= 0) if nonpositive else jnp.bool_(True))
    if all(bool(v) for v in jax.device_get(verdicts)):
        return
    values = np.asarray(x)
    if not np.issubdtype(values.dtype, np.inexact):  # bfloat16 (ml_dtypes)
        values = values.astype(np.float32)
    bad = ~np.isfinite(values)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: contains NaN or Inf (first at index {index})")
    if nonpositive and (values > 0).any():
        index = tuple(int(i) for i in np.argwhere(values > 0)[0])
        raise ValueError(
            f"{name}: expected log forget gates <= 0, got {values[index]:.6g} at index {index}"
        )

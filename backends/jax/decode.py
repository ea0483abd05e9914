"""FPA decoding with a KV cache and eviction (F7), as an explicit state pytree.

The cache has a fixed capacity (static shapes under jit). Each slot holds (k_j, v_j, l_j, m_j)
and a live flag; on token t: m_j <- min(m_j, phi_t) for live slots, slots with
pi_j = max(0, l_j - m_j) >= theta are freed (by (T2) for good), the new key takes the first free
slot with m = +inf, and the query attends over the live slots. With theta = inf, step-by-step
decoding equals the parallel op. Liveness is per query head (field and level are), so with GQA
each query head keeps its own copy of its kv head's keys.

When every slot is live and a key must be added, the cache overflows: the key is dropped and its
output is not the spec's. Called eagerly, the public functions then raise a ValueError naming the
capacity (the cache passed in is unchanged); under jit (a traced cache) they cannot raise, and
``overflowed`` is set for that head instead: a jitted decoding loop must read it (any True is a
failure). Size the capacity from the eviction bound (T3), or use capacity = T.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from . import validation as check
from .fpa import _check_qkv, _check_scalar, compute_dtype


class FPACache(NamedTuple):
    """The decode state of FPA (F7); a pytree, so it passes through jit, scan and vmap.

    keys [B, N, S, H]; values [B, N, S, Hv] (S slots, compute dtype); levels, mins [B, N, S]
    (float32 or float64); live [B, N, S] bool; peak [B, N] int32 the most live slots seen;
    steps int32 tokens consumed; overflowed [B, N] bool.
    """

    keys: jax.Array
    values: jax.Array
    levels: jax.Array
    mins: jax.Array
    live: jax.Array
    peak: jax.Array
    steps: jax.Array
    overflowed: jax.Array

    @property
    def kept_fraction(self) -> jax.Array:
        """Peak live slots over the tokens seen, per head [B, N] (1.0 without eviction)."""
        return self.peak / jnp.maximum(self.steps, 1)


def fpa_cache(
    batch: int, heads: int, capacity: int, H: int, Hv: int, *, dtype: DTypeLike = jnp.float32
) -> FPACache:
    """An empty cache of ``capacity`` slots per query head; ``dtype`` float32 or float64 (the
    compute dtype: half-precision keys are stored widened). Memory O(B N S (H + Hv))."""
    for name, value in dict(batch=batch, heads=heads, capacity=capacity, H=H, Hv=Hv).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    dtype = jnp.dtype(dtype)
    if dtype not in check.WIDE:
        raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
    slots = (batch, heads, capacity)
    return FPACache(
        keys=jnp.zeros((*slots, H), dtype),
        values=jnp.zeros((*slots, Hv), dtype),
        levels=jnp.zeros(slots, dtype),
        mins=jnp.full(slots, jnp.inf, dtype),
        live=jnp.zeros(slots, bool),
        peak=jnp.zeros((batch, heads), jnp.int32),
        steps=jnp.zeros((), jnp.int32),
        overflowed=jnp.zeros((batch, heads), bool),
    )


def _step(
    cache: FPACache,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    theta: ArrayLike,
    scale: float,
) -> tuple[jax.Array, FPACache]:
    """One token; q [B, N, H], k [B, N, H], v [B, N, Hv], field, level [B, N], theta scalar."""
    ct = cache.keys.dtype
    field, level = field.astype(ct), level.astype(ct)
    mins = jnp.where(cache.live, jnp.minimum(cache.mins, field[..., None]), cache.mins)  # (F7)
    depth = jnp.maximum(0.0, cache.levels - mins)  # (F2)
    live = cache.live & ~(depth >= theta)  # evict pi_j >= theta; by (T2) for good
    free = ~live
    has_free = jnp.any(free, axis=-1)
    slot = jnp.argmax(free, axis=-1)  # the first free slot
    put = (jnp.arange(live.shape[-1]) == slot[..., None]) & has_free[..., None]  # (B, N, S)

    def write(store: jax.Array, new: ArrayLike) -> jax.Array:
        return jnp.where(put.reshape(*put.shape, *([1] * (store.ndim - 3))), new, store)

    cache = FPACache(
        keys=write(cache.keys, k.astype(ct)[:, :, None]),
        values=write(cache.values, v.astype(ct)[:, :, None]),
        levels=write(cache.levels, level[..., None]),
        mins=write(mins, jnp.inf),  # an empty segment: pi_tt = 0
        live=live | put,
        peak=cache.peak,
        steps=cache.steps + 1,
        overflowed=cache.overflowed | ~has_free,
    )
    depth = jnp.maximum(0.0, cache.levels - cache.mins)  # (F2)
    logits = scale * jnp.einsum("bnsh,bnh->bns", cache.keys, q.astype(ct)) - depth  # (F3)
    logits = jnp.where(cache.live, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)  # (F4)
    o = jnp.einsum("bns,bnsd->bnd", p, cache.values)  # (F5)
    size = jnp.sum(cache.live, axis=-1, dtype=jnp.int32)
    return o, cache._replace(peak=jnp.maximum(cache.peak, size))


def raise_if_overflowed(overflowed: jax.Array, capacity: int) -> None:
    """The eager check of a fixed capacity: a ValueError naming it when ``overflowed`` holds
    values (not a tracer) and any is True; under jit nothing (the flag is the report)."""
    if check.concrete(overflowed) and bool(jnp.any(overflowed)):
        raise ValueError(
            f"capacity: the cache of {capacity} slots per head is full (every slot live when a "
            "key had to be added); allocate more slots (capacity = T never overflows) or evict "
            "(theta, spec/fpa.md T3)"
        )


def _expand_kv(x: jax.Array, heads: int) -> jax.Array:
    """[B, K, .] -> [B, N, .]: query head n reads kv head n // (N / K)."""
    return jnp.repeat(x, heads // x.shape[1], axis=1)


@functools.partial(jax.jit, static_argnums=(7,))
def _decode_step(
    cache: FPACache,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    theta: ArrayLike,
    scale: float,
) -> tuple[jax.Array, FPACache]:
    N = q.shape[1]
    return _step(cache, q, _expand_kv(k, N), _expand_kv(v, N), field, level, theta, scale)


def fpa_decode_step(
    cache: FPACache,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    theta: ArrayLike = jnp.inf,
    scale: float | None = None,
) -> tuple[jax.Array, FPACache]:
    """Consume one token (F7): q [B, N, H], k [B, K, H], v [B, K, Hv], field, level [B, N].

    Returns (o [B, N, Hv] in q's dtype, the next cache). ``theta`` may be traced. A full
    cache is a ValueError naming the capacity when called eagerly, the ``overflowed`` flag of
    the returned cache under jit. Time and memory O(B N S (H + Hv)) for S slots.
    """
    q = check.array("q", q, 3, meaning="[B, N, H]")
    B, N, H = q.shape
    k = check.array("k", k, 3, meaning="[B, K, H]")
    check.same_dtype("k", k, q, "q")
    if k.shape[1] < 1 or N % k.shape[1] or k.shape[::2] != (B, H):
        raise ValueError(f"k: expected shape ({B}, K, {H}) with K dividing N = {N}, got {k.shape}")
    v = check.array("v", v, 3, meaning="[B, K, Hv]")
    check.same_dtype("v", v, q, "q")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v: expected shape {k.shape[:2]} + (Hv,) (B, K of k), got {v.shape}")
    scalars = []
    for name, x in (("field", field), ("level", level)):
        x = check.array(name, x, 2, meaning="[B, N]")
        check.shape(name, x, (B, N), "[B, N]: B, N of q")
        scalars.append(check.widened(x))  # half precision: float32, as the parallel ops
    field, level = scalars
    expected = (B, N, cache.keys.shape[2])
    check.shape("cache", cache.live, expected, "live slots [B, N, S] for q's B and N")
    if cache.keys.shape[-1] != H or cache.values.shape[-1] != v.shape[-1]:
        raise ValueError(
            f"cache: expected keys of size {H} and values of size {v.shape[-1]}, got "
            f"{cache.keys.shape[-1]} and {cache.values.shape[-1]}"
        )
    s = check.scale(scale, H)
    o, cache = _decode_step(cache, q, k, v, field, level, theta, s)
    raise_if_overflowed(cache.overflowed, cache.keys.shape[2])
    return o.astype(q.dtype), cache


@functools.partial(jax.jit, static_argnums=(6, 7))
def _decode_all(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    field: jax.Array,
    level: jax.Array,
    theta: ArrayLike,
    scale: float,
    capacity: int,
) -> tuple[jax.Array, FPACache]:
    B, _, N, H = q.shape
    ct = compute_dtype(q, field, level)
    cache = fpa_cache(B, N, capacity, H, v.shape[-1], dtype=ct)
    k, v = _expand_kv(k.swapaxes(1, 2), N), _expand_kv(v.swapaxes(1, 2), N)  # [B, N, T, .]

    def token(
        cache: FPACache, inputs: tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]
    ) -> tuple[FPACache, jax.Array]:
        qt, kt, vt, ft, lt = inputs
        o, cache = _step(cache, qt, kt, vt, ft, lt, theta, scale)
        return cache, o

    steps = (
        q.swapaxes(0, 1),
        k.transpose(2, 0, 1, 3),
        v.transpose(2, 0, 1, 3),
        field.swapaxes(0, 1),
        level.swapaxes(0, 1),
    )
    cache, o = lax.scan(token, cache, steps)
    return o.swapaxes(0, 1).astype(q.dtype), cache


def fpa_decode(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    theta: ArrayLike = jnp.inf,
    scale: float | None = None,
    capacity: int | None = None,
) -> tuple[jax.Array, FPACache]:
    """Decode a whole sequence token by token (F7), by a scan of :func:`fpa_decode_step`.

    Args: as :func:`attnspec.backends.jax.fpa_attention` (q [B, T, N, H], k [B, T, K, H],
    v [B, T, K, Hv], field, level [B, T, N]); theta the eviction threshold (> 0, may be inf);
    capacity the cache slots per head (default T: never overflows; a full cache is a
    ValueError naming it when called eagerly, the ``overflowed`` flag under jit).

    Returns:
        o [B, T, N, Hv] in q's dtype and the final cache (``kept_fraction``, ``peak``,
        ``overflowed``). Time O(B N T S (H + Hv)); memory O(B N S (H + Hv)).
    """
    q, k, v = _check_qkv(q, k, v)
    field = _check_scalar("field", field, q, validate=True)
    level = _check_scalar("level", level, q, validate=True)
    # complex has no float(): refused here, with the argument named
    if check.concrete(theta) and (isinstance(theta, complex) or not float(theta) > 0):
        raise ValueError(f"theta: expected a positive threshold (or inf), got {theta!r}")
    capacity = q.shape[1] if capacity is None else capacity
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
    s = check.scale(scale, q.shape[-1])
    o, cache = _decode_all(q, k, v, field, level, theta, s, capacity)
    raise_if_overflowed(cache.overflowed, capacity)
    return o, cache

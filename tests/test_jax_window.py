"""The window of (F3w) in the JAX ops (the XLA loop): values and gradients against the float64
reference with small blocks (W = 1, inside a block, across blocks, W >= T, packed, GQA), the key
blocks wholly outside the window not visited, and the other implementations refusing it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drawers import gated
from jax_support import canonical, draw, x64  # noqa: F401  (x64: autouse fixture)

from attnspec.backends.jax import fox_attention, fpa_attention
from attnspec.conformance.metrics import relative_error as rel
from attnspec.conformance.numpy_backend import NumpyBackend

NUMPY = NumpyBackend()

# (B, T, N, K, window, cu_seqlens)
WINDOWED = [
    (1, 50, 2, 2, 1, None),
    (2, 70, 4, 2, 37, None),  # across blocks of 16, GQA 4/2
    (1, 60, 2, 2, 20, (0, 25, 26, 60)),  # packed, a length-1 sequence
    (1, 30, 2, 2, 64, None),  # W >= T
]
FOX_WINDOWED = [
    (1, 50, 2, 2, 7, None),  # inside a block of 16
    (1, 60, 2, 2, 20, (0, 25, 26, 60)),
]


def _close(got, want, name):
    if not want.any():  # W = 1: no pair off the diagonal, no field or level gradient
        assert not np.asarray(got).any(), name
    else:
        assert rel(canonical(got), want) <= 1e-12, name


@pytest.mark.parametrize(("B", "T", "N", "K", "window", "cu"), WINDOWED)
def test_windowed_fpa_matches_the_reference(B, T, N, K, window, cu):
    args = draw(B, T, N, K, 8, 5, seed=T + window)
    rng = np.random.default_rng(window)
    do, dlse = rng.standard_normal((B, T, N, 5)), rng.standard_normal((B, T, N))
    inputs = dict(zip(("q", "k", "v", "field", "level"), map(canonical, args), strict=True))
    params = {"scale": None, "cu_seqlens": cu, "window": window}
    o_ref, lse_ref = NUMPY.fpa_attention(**inputs, **params, return_lse=True)
    g_ref = NUMPY.vjp("fpa_attention", inputs, params, {"o": canonical(do), "lse": canonical(dlse)})

    def op(*a):
        return fpa_attention(*a, cu_seqlens=cu, window=window, block_size=16, return_lse=True)

    (o, lse), pullback = jax.vjp(op, *(jnp.asarray(x) for x in args))
    assert rel(canonical(o), o_ref) <= 1e-12 and rel(canonical(lse), lse_ref) <= 1e-12
    for name, g in zip(inputs, pullback((jnp.asarray(do), jnp.asarray(dlse))), strict=True):
        _close(g, g_ref[name], name)


@pytest.mark.parametrize(("B", "T", "N", "K", "window", "cu"), FOX_WINDOWED)
def test_windowed_fox_matches_the_reference(B, T, N, K, window, cu):
    q, k, v, log_f = gated(np.random.default_rng(T + window), B, T, N, K, 8, 5, unit=0.3)
    inputs = {"q": q, "k": k, "v": v, "log_f": log_f}
    do = np.random.default_rng(window).standard_normal((B, N, T, 5))
    params = {"cu_seqlens": cu, "window": window}
    o_ref = NUMPY.fox_attention(**inputs, **params)
    g_ref = NUMPY.vjp("fox_attention", inputs, params, {"o": do})

    def op(*a):
        return fox_attention(*a, cu_seqlens=cu, window=window, block_size=16)

    public = [jnp.asarray(np.swapaxes(x, 1, 2)) for x in inputs.values()]
    o, pullback = jax.vjp(op, *public)
    assert rel(canonical(o), o_ref) <= 1e-12
    for name, g in zip(inputs, pullback(jnp.asarray(np.swapaxes(do, 1, 2))), strict=True):
        _close(g, g_ref[name], name)


def test_blocks_wholly_outside_the_window_are_not_visited():
    # blocks of 16, W = 20: query block i visits key blocks i, i - 1 and i - 2 only, so NaN in
    # the values of key 0 reaches the query blocks 0-2 (rows 0-47, 0 * NaN in p @ v) and no other
    q, k, v, field, level = (jnp.asarray(x) for x in draw(1, 96, 1, 1, 8, 8, seed=1))
    v = v.at[0, 0].set(jnp.nan)
    o = fpa_attention(q, k, v, field, level, window=20, block_size=16)
    assert jnp.isnan(o[0, :48]).any() and not jnp.isnan(o[0, 48:]).any()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"window": 0}, "window: expected an integer >= 1 or None, got 0"),
        ({"window": 2.5}, "window: expected an integer >= 1 or None"),
        ({"window": 4, "implementation": "pallas"}, "window: the window of .F3w. runs on"),
    ],
)
def test_a_bad_window_is_named(kw, message):
    q, k, v, field, level = (jnp.asarray(x) for x in draw(1, 8, 1, 1, 4, 4))
    with pytest.raises(ValueError, match=message):
        fpa_attention(q, k, v, field, level, **kw)
    with pytest.raises(ValueError, match=message):
        fox_attention(q, k, v, -jnp.abs(field), **kw)

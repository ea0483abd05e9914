"""The JAX initialisers draw the reference's initialisation with jax.random: traceable under
jit and vmap (before, a NumPy seed read off the key failed on a tracer), with the reference's
shapes, constants and spreads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_support import x64  # noqa: F401  (autouse fixture)

from attnspec.backends.jax import init_fpa_params, init_interdomain_params
from attnspec.reference import fpa as ref_fpa
from attnspec.reference import interdomain as ref_idm

FPA_SIZES = (16, 2, 4, 3)  # d, H, dk, dv
IDM_SIZES = (16, 2, 4, 3, 5)  # d, H, R, dv, M


def initialisers():
    fpa = functools.partial(init_fpa_params, d=16, H=2, dk=4, dv=3)
    idm = functools.partial(init_interdomain_params, d=16, H=2, R=4, dv=3, M=5, gate=True)
    return {"fpa": fpa, "interdomain": idm}


@pytest.mark.parametrize("layer", ["fpa", "interdomain"])
def test_initialisers_trace_under_jit_and_vmap(layer):
    init = initialisers()[layer]
    keys = jax.random.split(jax.random.key(3), 3)
    eager = [init(k) for k in keys]
    jitted = jax.jit(init)(keys[0])
    batched = jax.vmap(init)(keys)
    for name, value in eager[0].items():
        np.testing.assert_array_equal(jitted[name], value)
        for e in range(3):
            np.testing.assert_array_equal(batched[name][e], eager[e][name])
    # each key draws its own weights; the constants are the same for every key
    assert not np.array_equal(batched["wq"][0], batched["wq"][1])
    assert np.array_equal(batched["wo"][1], init(keys[1])["wo"])


def test_an_int_seed_is_the_key_of_that_seed():
    a, b = init_fpa_params(7, *FPA_SIZES), init_fpa_params(jax.random.key(7), *FPA_SIZES)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    with pytest.raises(ValueError, match="key: expected"):
        init_fpa_params(0.5, *FPA_SIZES)
    with pytest.raises(ValueError, match="H: expected a positive int"):
        init_fpa_params(0, 16, 0, 4, 3)


def test_the_draws_follow_the_reference_initialisation():
    """Shapes and constants equal the reference's exactly; the random arrays have its spreads
    (normal / sqrt(fan-in), conv normal / 2, C normal / sqrt(2 M), log_dt uniform on
    [log 1e-3, log 1e-1]) within sampling error on large draws."""
    d, H, R, dv, M = 256, 8, 32, 32, 16
    p = init_interdomain_params(1, d, H, R, dv, M, gate=True, dtype=jnp.float64)
    want = ref_idm.init_interdomain_params(d, H, R, dv, M, seed=0, gate=True)
    assert {n: v.shape for n, v in p.items()} == {n: v.shape for n, v in want.items()}
    assert all(v.dtype == jnp.float64 for v in p.values())
    spread = {"wq": 1 / np.sqrt(d), "wo": 1 / np.sqrt(H * dv), "wg": 1 / np.sqrt(d)}
    spread |= {"conv_q": 0.5, "c_re": 1 / np.sqrt(2 * M), "c_im": 1 / np.sqrt(2 * M)}
    for name, value in want.items():
        got = np.asarray(p[name])
        if name in spread:
            n = got.size
            assert abs(got.std() / spread[name] - 1) < 5 / np.sqrt(2 * n), name  # 5 sigma
            assert abs(got.mean()) < 5 * spread[name] / np.sqrt(n), name
        elif name == "log_dt":
            assert np.log(1e-3) <= got.min() and got.max() <= np.log(1e-1)
        elif name not in ("wk", "wv", "conv_k"):  # the same draws as wq and conv_q
            np.testing.assert_array_equal(got, value, err_msg=name)  # the constants
    q = init_fpa_params(1, d, H, R, dv, dtype=jnp.float32)
    want = ref_fpa.init_fpa_params(d, H, R, dv)
    assert {n: v.shape for n, v in q.items()} == {n: v.shape for n, v in want.items()}
    assert abs(np.asarray(q["w_delta"]).std() * np.sqrt(d) - 1) < 5 / np.sqrt(2 * d * H)
    assert not np.any(np.asarray(q["b_lam"]))

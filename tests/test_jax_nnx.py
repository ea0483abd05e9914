"""The Flax NNX modules (attnspec.backends.jax.nnx): values equal the functional layers on the
same parameters and the reference (float64 and float32), the decode caches equal the parallel
call, the eviction statistics equal a literal count, and bad input is a ValueError naming the
argument with the layer unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_support import x64  # noqa: F401  (autouse fixture)

nnx = pytest.importorskip("flax.nnx")

from attnspec.backends.jax import (  # noqa: E402
    fpa_layer,
    init_fpa_params,
    init_interdomain_params,
    interdomain_layer,
)
from attnspec.backends.jax.nnx import FirstPassageAttention, InterdomainAttention  # noqa: E402
from attnspec.conformance.metrics import relative_error as rel  # noqa: E402
from attnspec.reference import fpa as ref_fpa  # noqa: E402
from attnspec.reference import interdomain as ref_idm  # noqa: E402

D, H, DK, DV, M = 8, 2, 4, 3, 5
B, T = 2, 7
TOL = {jnp.float64: 1e-12, jnp.float32: 2e-5}  # against the float64 reference


def inputs(dtype, T=T, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D)), dtype)


def as_numpy(params):
    return {name: np.asarray(value, np.float64) for name, value in params.items()}


@pytest.mark.parametrize(
    "dtype, increments",
    [(jnp.float64, "signed"), (jnp.float32, "signed"), (jnp.float64, "logsigmoid")],
)
def test_fpa_module_equals_the_functional_layer_and_the_reference(dtype, increments):
    layer = FirstPassageAttention(
        D, H, DK, DV, increments=increments, param_dtype=dtype, rngs=nnx.Rngs(3)
    )
    # the module's parameters are the functional initialiser's draw from the same rngs
    params = init_fpa_params(nnx.Rngs(3).params(), D, H, DK, DV, dtype=dtype)
    assert all(bool(jnp.array_equal(layer.param_dict()[n], params[n])) for n in params)
    assert isinstance(layer.wq, nnx.Param) and layer.wq.get_value().dtype == dtype
    x = inputs(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (B, T, D)
    assert bool(jnp.array_equal(y, fpa_layer(x, params, increments=increments)))
    expected = ref_fpa.fpa_layer(np.asarray(x, np.float64), as_numpy(params), increments=increments)
    assert rel(y, expected) < TOL[dtype]


# every option both ways: the readouts, the gate, RoPE, the output norm (I14)
IDM_CASES = [
    dict(readout="linear"),
    dict(readout="ratio", gate=True, use_rope=True, output_norm=False),
]


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("options", IDM_CASES, ids=["linear", "ratio-gate-rope-no-norm"])
def test_interdomain_module_equals_the_functional_layer_and_the_reference(dtype, options):
    layer = InterdomainAttention(D, H, 4, DV, M, **options, param_dtype=dtype, rngs=nnx.Rngs(1))
    flags = {k: options.get(k, k == "output_norm") for k in ("gate", "output_norm")}
    params = init_interdomain_params(nnx.Rngs(1).params(), D, H, 4, DV, M, **flags, dtype=dtype)
    assert set(layer.param_dict()) == set(params)
    assert all(bool(jnp.array_equal(layer.param_dict()[n], params[n])) for n in params)
    x = inputs(dtype)
    y = layer(x)
    assert y.dtype == dtype
    assert bool(jnp.array_equal(y, interdomain_layer(x, params, **options)))
    expected = ref_idm.interdomain_layer(np.asarray(x, np.float64), as_numpy(params), **options)
    assert rel(y, expected) < TOL[dtype]


def test_fpa_decode_equals_the_parallel_call_in_pieces():
    layer = FirstPassageAttention(D, H, DK, DV, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = inputs(jnp.float64)
    layer.init_cache(B, T)
    assert isinstance(layer.cache_keys, nnx.Cache)
    pieces = [layer(x[:, :3], decode=True), layer(x[:, 3:4], decode=True)]
    pieces.append(layer(x[:, 4:], decode=True))
    assert rel(jnp.concatenate(pieces, axis=1), layer(x)) < 1e-12
    assert int(layer.cache_length) == T
    np.testing.assert_array_equal(layer.kept_fraction, 1.0)  # theta = inf: nothing evicted
    assert not bool(jnp.any(layer.overflowed))


def test_interdomain_decode_under_nnx_jit_equals_the_parallel_call():
    layer = InterdomainAttention(
        D, H, 4, DV, M, readout="ratio", use_rope=True, param_dtype=jnp.float64, rngs=nnx.Rngs(2)
    )
    x = inputs(jnp.float64)
    layer.init_cache(B, T)
    step = nnx.jit(lambda layer, xt: layer(xt, decode=True))
    ys = [step(layer, x[:, t : t + 1]) for t in range(T)]
    assert rel(jnp.concatenate(ys, axis=1), layer(x)) < 1e-12
    assert int(layer.cache_length) == T


def test_fpa_eviction_statistics_equal_a_literal_count():
    """theta = 1: key j is live at step t while pi_tj = max(0, l_j - min phi_(j..t]) < theta
    (F2, F7: the segment after j, empty for j = t; T2: once evicted, for good); peak = the
    most live keys over t, counted by hand."""
    theta = 1.0
    layer = FirstPassageAttention(
        D, H, DK, DV, theta=theta, param_dtype=jnp.float64, rngs=nnx.Rngs(4)
    )
    x = inputs(jnp.float64, T=12, seed=5)
    layer.init_cache(B, 12)
    layer(x, decode=True)
    P, xs = as_numpy(layer.param_dict()), np.asarray(x)
    field = np.cumsum(xs @ P["w_delta"] + P["b_delta"], axis=1)  # [B, T, H]
    level = field + xs @ P["w_lam"] + P["b_lam"]
    peak = np.zeros((B, H), int)
    for t in range(12):
        after = np.concatenate([field[:, 1 : t + 1], np.full((B, 1, H), np.inf)], axis=1)
        floor = np.minimum.accumulate(after[:, ::-1], axis=1)[:, ::-1]  # min phi_(j..t]
        live = np.maximum(0.0, level[:, : t + 1] - floor) < theta
        peak = np.maximum(peak, live.sum(axis=1))
    np.testing.assert_array_equal(layer.peak, peak)
    np.testing.assert_allclose(layer.kept_fraction, peak / 12)
    assert peak.min() < 12  # the case evicts


def test_a_full_cache_is_a_value_error_naming_it_and_the_caches_stay():
    layer = FirstPassageAttention(D, H, DK, DV, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = inputs(jnp.float64)
    layer.init_cache(B, 4)
    with pytest.raises(ValueError, match="cache: full: 0 of max_len = 4"):
        layer(x[:, :5], decode=True)
    assert int(layer.cache_length) == 0
    layer.init_cache(B, T, slots=2)  # theta = inf keeps every key: the third finds no slot
    layer(x[:, :2], decode=True)
    before = layer.decode_state
    with pytest.raises(ValueError, match="cache: full: every one of its 2 slots"):
        layer(x[:, 2:3], decode=True)
    after = layer.decode_state
    assert all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )
    idm = InterdomainAttention(D, H, 4, DV, M, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    idm.init_cache(B, 3)
    with pytest.raises(ValueError, match="cache: full: 0 of max_len = 3"):
        idm(x[:, :4], decode=True)


@pytest.mark.parametrize("make", [FirstPassageAttention, InterdomainAttention])
def test_bad_input_is_a_value_error_naming_the_argument(make):
    layer = make(D, H, 4, DV, rngs=nnx.Rngs(0))  # float32 parameters
    good = inputs(jnp.float32)
    with pytest.raises(ValueError, match=r"x: expected width d_model = 8"):
        layer(good[..., :6])
    with pytest.raises(ValueError, match=r"x: expected dtype float32.*got float64"):
        layer(inputs(jnp.float64))
    with pytest.raises(ValueError, match=r"x: expected 3 dimensions"):
        layer(good[0])
    with pytest.raises(ValueError, match="cache: not initialised"):
        layer(good, decode=True)
    layer.init_cache(B + 1, T)
    with pytest.raises(ValueError, match=r"x: expected batch 3"):
        layer(good, decode=True)
    params = layer.param_dict()
    with pytest.raises(ValueError, match=r"params: unknown \['wq_typo'\]"):
        layer.load_params({**params, "wq_typo": params["wq"]})
    with pytest.raises(ValueError, match=r"params\['wq'\]: expected shape"):
        layer.load_params({**params, "wq": params["wq"][:, :-1]})
    assert all(bool(jnp.array_equal(layer.param_dict()[n], params[n])) for n in params)
    with pytest.raises(ValueError, match="n_heads: expected a positive int"):
        make(D, 0, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="param_dtype: expected float32 or float64"):
        make(D, H, 4, param_dtype=jnp.int32, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("make", [FirstPassageAttention, InterdomainAttention])
def test_float64_parameters_without_64_bit_mode_say_so(make):
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match=r"param_dtype: float64 needs JAX's 64-bit mode"):
            make(D, H, 4, param_dtype=jnp.float64, rngs=nnx.Rngs(0))


def test_a_float64_layer_called_without_64_bit_mode_says_so():
    layer = FirstPassageAttention(D, H, 4, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = np.asarray(inputs(jnp.float64))
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match=r"x: the layer's param_dtype is float64 and JAX's"):
            layer(x)


def test_load_params_takes_the_reference_dict():
    params = ref_fpa.init_fpa_params(D, H, DK, DV, seed=2)
    layer = FirstPassageAttention(D, H, DK, DV, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    layer.load_params(params)
    x = inputs(jnp.float64)
    assert rel(layer(x), ref_fpa.fpa_layer(np.asarray(x), params)) < 1e-12

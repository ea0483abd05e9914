"""The layers' errors on bad input name the layer's own argument (issue 40, point 5): torch's
FirstPassageAttention and InterdomainAttention, and the JAX layers' parameter dicts."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import FirstPassageAttention, InterdomainAttention  # noqa: E402
from attnspec.reference import fpa  # noqa: E402
from attnspec.reference import interdomain as idm  # noqa: E402

LAYERS = [FirstPassageAttention, InterdomainAttention]


@pytest.mark.parametrize("layer_type", LAYERS)
def test_bad_sizes_name_the_argument(layer_type):
    for args, name in [
        ((16, 2, -4), "head_dim"),
        ((16, 0, 4), "n_heads"),
        ((0, 2, 4), "d_model"),
        ((16, 2, 4, 0), "value_dim"),
        ((16, 2.5, 4), "n_heads"),
    ]:
        with pytest.raises(ValueError, match=rf"^{name}: expected an integer >= 1, got"):
            layer_type(*args)


@pytest.mark.parametrize("layer_type", LAYERS)
def test_bad_x_names_x(layer_type):
    torch.manual_seed(0)
    layer = layer_type(16, 2, 4)
    wide = torch.randn(1, 5, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^x: expected the layer's dtype torch.float32, got"):
        layer(wide)
    with pytest.raises(ValueError, match=r"^x: expected the layer's dtype torch.float32, got"):
        layer.step(wide[:, 0], layer.new_cache())
    nan = torch.randn(1, 5, 16)
    nan[0, 3, 7] = float("nan")
    with pytest.raises(ValueError, match=r"^x: contains NaN or Inf \(first at index \(0, 3, 7\)\)"):
        layer(nan)
    with pytest.raises(ValueError, match=r"^x: contains NaN or Inf"):
        layer.step(nan[:, 3], layer.new_cache())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts x: allowed
        assert layer(torch.randn(1, 5, 16)).shape == (1, 5, 16)


@pytest.mark.parametrize("layer_type", LAYERS)
def test_a_batch_that_changes_mid_decode_names_x(layer_type):
    torch.manual_seed(0)
    layer = layer_type(16, 2, 4)
    with torch.no_grad():
        for start in ("step", "prefill"):
            cache = layer.new_cache()
            if start == "step":
                layer.step(torch.randn(2, 16), cache)
            else:
                layer.prefill(torch.randn(2, 3, 16), cache)
            with pytest.raises(ValueError, match=r"^x: expected the batch of the decode cache, B"):
                layer.step(torch.randn(3, 16), cache)


def test_the_jax_layers_reject_unknown_parameter_keys():
    jnp = pytest.importorskip("jax.numpy")
    from attnspec.backends.jax import layers

    x = jnp.zeros((1, 3, 8))
    params = fpa.init_fpa_params(8, 2, 4, 4)
    assert layers.fpa_layer(x, params).shape == (1, 3, 8)  # the schema's keys: accepted
    typo = {**params, "w_lamb": params["w_lam"]}
    with pytest.raises(ValueError, match=r"params: unknown \['w_lamb'\]"):
        layers.fpa_layer(x, typo)
    with pytest.raises(ValueError, match=r"params: unknown \['w_lamb'\]"):
        layers.fpa_layer_step(x[:, 0], typo, layers.fpa_layer_state(params, 1, 4))
    params = idm.init_interdomain_params(8, 2, 4, 4, 4, seed=0)
    with pytest.raises(ValueError, match=r"params: unknown \['c_img'\]"):
        layers.interdomain_layer(x, {**params, "c_img": np.zeros(1)})

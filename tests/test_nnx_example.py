"""docs/examples/nnx_lm.py: the NNX language model trains under nnx.jit with optax (the loss
falls, the gradients are finite), decodes with its caches as the parallel forward predicts,
and goes through nnx.split / nnx.merge, nnx.vmap and sharding on a host-device mesh."""

import importlib.util
import itertools
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_support import run_on_host_devices

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs", "examples", "nnx_lm.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("nnx_lm_example", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(example):
    return example.train(steps=4)


def test_training_lowers_the_loss_with_finite_gradients(trained):
    _, losses, norms = trained
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[0] > 5.0 > losses[-1]  # from ~log(256) = 5.5 at initialisation
    assert all(0 < n < float("inf") for n in norms), norms  # finite, nonzero gradients


def test_cached_generation_equals_the_parallel_forward(example, trained):
    model, _, _ = trained
    prompt = b"first passage"
    cached = example.generate(model, prompt, 6)
    tokens = jnp.asarray(list(prompt + cached), jnp.int32)[None]
    parallel = bytes(np.asarray(jnp.argmax(model(tokens), -1)[0, len(prompt) - 1 : -1]).tolist())
    assert cached == parallel


def test_split_merge_and_an_ensemble_under_nnx_vmap(example, trained):
    model, _, _ = trained
    tokens = example.batch()[:, :16]
    _, state, forward = example.pure_forward(model)
    np.testing.assert_allclose(forward(state, tokens), model(tokens), rtol=1e-5, atol=1e-5)
    keys = jax.random.split(jax.random.key(7), 2)
    members, logits = example.ensemble(keys, tokens)
    assert logits.shape == (2, 1, 16, 256)
    assert members.fpa.wq.get_value().shape == (2, 32, 16)  # the ensemble axis first
    for e in range(2):
        alone = example.TinyLM(rngs=nnx.Rngs(keys[e]))
        np.testing.assert_allclose(logits[e], alone(tokens), rtol=1e-5, atol=1e-5)


SHARDED = textwrap.dedent(
    """
    import importlib.util, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    spec = importlib.util.spec_from_file_location("nnx_lm", sys.argv[1])
    ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)
    assert jax.device_count() == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("heads",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        sharded = ex.TinyLM(sharding="heads", rngs=nnx.Rngs(0))
    plain = ex.TinyLM(rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(sharded, nnx.Param))
    assert specs["fpa"]["wq"].get_value() == P(None, "heads"), specs["fpa"]["wq"]
    assert specs["idm"]["c_re"].get_value() == P("heads", None, None)
    wq = sharded.fpa.wq.get_value()
    assert wq.sharding.spec == P(None, "heads") and len(wq.sharding.device_set) == 2
    tokens = ex.batch()[:, :24]
    loss = nnx.jit(nnx.value_and_grad(ex.loss_fn))
    (a, ga), (b, gb) = loss(plain, tokens), loss(sharded, tokens)
    np.testing.assert_allclose(b, a, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(nnx.state(ga)), jax.tree.leaves(nnx.state(gb))):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6)
    print("sharded ok", gb.fpa.wq.get_value().sharding.spec)
    """
)


def test_sharded_by_partition_annotations_on_two_host_devices():
    out = run_on_host_devices(SHARDED.replace("sys.argv[1]", repr(PATH)), timeout=300, devices=2)
    assert "sharded ok" in out

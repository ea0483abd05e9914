"""The JAX ops compose with jit, grad, vmap and sharding the way JAX users expect.

Each result is compared with the reference (or, for sharding, with the same op on one device).
The sharding test runs in a subprocess: XLA's host device count must be set before JAX starts.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax_support import run_on_host_devices, x64  # noqa: F401  (x64: autouse fixture)

from attnspec.backends.jax import fox_attention, fpa_attention, interdomain_s4d
from attnspec.conformance.metrics import relative_error as rel
from attnspec.reference import fpa as ref
from attnspec.reference import interdomain as ref_idm


def canonical(x):
    return np.swapaxes(np.asarray(x, dtype=np.float64), -3, -2)


def test_per_example_gradients_by_vmap_of_grad_under_jit():
    """vmap over an extra leading axis of jit(grad(loss)): each example's gradients equal the
    reference VJP of that example alone."""
    E, B, T, N, H = 3, 1, 20, 2, 4
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, E, B, T, N, H))
    field = np.cumsum(rng.standard_normal((E, B, T, N)), axis=2)
    level = field + rng.standard_normal((E, B, T, N))
    w = rng.standard_normal((E, B, T, N, H))

    def loss(q, k, v, field, level, w):
        return jnp.vdot(fpa_attention(q, k, v, field, level, block_size=16), w)

    per_example = jax.vmap(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))))
    grads = per_example(*(jnp.asarray(x) for x in (q, k, v, field, level, w)))
    for e in range(E):
        args = [canonical(x[e]) for x in (q, k, v)]
        args += [np.swapaxes(x[e], 1, 2) for x in (field, level)]
        expected = ref.fpa_attention_vjp(*args, canonical(w[e]))
        for got, want in zip(grads, expected, strict=True):
            got = np.asarray(got[e])
            assert rel(canonical(got) if got.ndim == 4 else np.swapaxes(got, 1, 2), want) < 1e-12


def test_vmap_over_heads_of_fox_and_s4d():
    """vmap of the public functions over an extra axis equals the reference per slice."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 2, 1, 12, 2, 4))
    log_f = -rng.exponential(0.5, (2, 1, 12, 2))
    o = jax.vmap(fox_attention)(*(jnp.asarray(x) for x in (q, k, v, log_f)))
    for e in range(2):
        expected = ref.fox_attention(
            *(canonical(x[e]) for x in (q, k, v)), np.swapaxes(log_f[e], 1, 2)
        )
        assert rel(canonical(o[e]), expected) < 1e-12

    lam = np.exp(-0.1 + 1j * rng.uniform(0, 3, (2, 3)))
    b, c = rng.standard_normal((2, 3)) + 0j, rng.standard_normal((2, 3, 3)) + 0j
    fq, kt, vt = rng.standard_normal((3, 2, 1, 12, 2, 4))
    run = jax.vmap(lambda f, kk, vv: interdomain_s4d(f, kk, vv, lam, b, c, validate=False))
    o = run(*(jnp.asarray(x) for x in (fq, kt, vt)))
    for e in range(2):
        expected = ref_idm.interdomain_s4d(*(canonical(x[e]) for x in (fq, kt, vt)), lam, b, c)
        assert rel(canonical(o[e]), expected) < 1e-12


SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from attnspec.backends.jax import fpa_attention, fox_attention

    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("batch", "heads"))
    rng = np.random.default_rng(0)
    B, T, N, K, H = 2, 40, 4, 2, 8
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k, v = rng.standard_normal((2, B, T, K, H)).astype(np.float32)
    field = np.cumsum(rng.standard_normal((B, T, N)), 1).astype(np.float32)
    level = field + rng.standard_normal((B, T, N)).astype(np.float32)
    heads4, heads3 = P("batch", None, "heads", None), P("batch", None, "heads")
    specs = (heads4, heads4, heads4, heads3, heads3)
    arrays = (q, k, v, field, level)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]

    def loss(*a):
        return jnp.sum(jnp.sin(fpa_attention(*a, block_size=16)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    one_device = step(*(jnp.asarray(x) for x in arrays))
    on_mesh = step(*sharded)
    for a, b in zip(jax.tree.leaves(one_device), jax.tree.leaves(on_mesh)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-6, atol=2e-6)
    # the gradients stay laid out like their inputs: 4 shards, one per device
    for g, s in zip(on_mesh[1], specs):
        assert len({d for d in g.sharding.device_set}) == 4, g.sharding

    # shard_map: every device runs the op on its own batch row and kv-head group
    per_device = jax.jit(jax.shard_map(
        lambda q, k, v, f: fox_attention(q, k, v, f, block_size=16),
        mesh=mesh, in_specs=(heads4, heads4, heads4, heads3), out_specs=heads4))
    log_f = -np.abs(field)
    expected = fox_attention(*(jnp.asarray(x) for x in (q, k, v, log_f)), block_size=16)
    got = per_device(*sharded[:3], jax.device_put(log_f, NamedSharding(mesh, heads3)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-6, atol=2e-6)
    print("sharded ok")
    """
)


def test_sharded_over_batch_and_heads_on_four_host_devices():
    assert "sharded ok" in run_on_host_devices(SHARDED, timeout=600)

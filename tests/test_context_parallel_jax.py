"""Context parallelism in JAX under shard_map on 4 forced host devices: kit cases against the
float64 reference (float64 and float32), composition with jit, grad and head sharding, a wrong
sharded FPA caught, and bad input refused.

XLA reads the host device count once, when JAX starts, so everything runs in one child process
(bounded by a timeout) and reports JSON; the other tests of the session are unaffected.
"""

import json

from jax_support import run_on_host_devices

CHILD = r"""
import json
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from attnspec.backends.jax import context_parallel as cp
from attnspec.backends.jax import context_parallel_kit as cp_kit
from attnspec.conformance import context_parallel as kit
from attnspec.reference import fpa

report = {"devices": len(jax.devices())}

# kit cases: the hard borders of every op, both dtypes, on 4 devices (and one on 2)
PICK = {
    ("fpa/cp/global-min-between/P4", "float64"), ("fpa/cp/zigzag/P4", "float32"),
    ("fpa/cp/varlen/P4", "float64"), ("fox/cp/gqa-varlen/P4", "float64"),
    ("fox/cp/zigzag/P4", "float32"), ("interdomain/cp/varlen/P4", "float64"),
    ("interdomain/cp/ratio/P4", "float32"), ("fpa/cp/plateau-ties/P2", "float64"),
}
claimed = cp_kit.KitBackend().capabilities()
rows = []
for world in (4, 2):
    jobs, refs, _ = kit.prepare(world, kit.DTYPES, kit.CP_OPS, claimed)
    chosen = [n for n, j in enumerate(jobs) if (j.case_id, j.dtype) in PICK]
    got = cp_kit.run_jobs([jobs[n] for n in chosen], world)
    for r in kit.judge([jobs[n] for n in chosen], got, [refs[n] for n in chosen], world):
        rows.append([r.case_id, r.dtype, r.verdict, r.message])
    if world == 4:  # a wrong sharding: (CP1) without the gap minimum
        class NoGap(cp.Sharding):
            def gap(self, mu, argmu):
                mid, argmid = super().gap(mu, argmu)
                return jnp.full_like(mid, jnp.inf), argmid
        wrong = [n for n, j in enumerate(jobs)
                 if j.case_id == "fpa/cp/global-min-between/P4" and j.dtype == "float64"]
        res = cp_kit.run_jobs([jobs[n] for n in wrong], world, NoGap())
        report["no_gap"] = [r.verdict for r in kit.judge([jobs[n] for n in wrong], res,
                                                         [refs[n] for n in wrong], world)]
report["kit"] = rows

# composition: jit(grad) with the sequence on one mesh axis and the heads on another
with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    B, N, T, H = 2, 2, 8, 4
    q, k = rng.standard_normal((2, B, T, N, H))
    v = rng.standard_normal((B, T, N, 3))
    field = np.cumsum(rng.integers(-1, 2, (B, T, N)), axis=1).astype(float)
    level = field + rng.choice([0.0, 1.0], field.shape)
    d_out = rng.standard_normal(v.shape)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("seq", "heads"))

    def loss(q, k, v, field, level):
        o = cp.fpa_attention(q, k, v, field, level, mesh=mesh, head_axis="heads")
        return jnp.sum(o * d_out)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, field, level)
    t = lambda x: np.swapaxes(x, 1, 2)
    ref = fpa.fpa_attention_vjp(*(t(x) for x in (q, k, v, field, level)), t(d_out))
    report["composed"] = max(
        float(np.abs(t(np.asarray(g)) - r).max() / np.abs(r).max()) for g, r in zip(grads, ref)
    )

# bad input: a clear ValueError naming the argument
mesh4 = Mesh(np.array(jax.devices()), ("seq",))
x = jnp.zeros((1, 6, 2, 4))
s = jnp.zeros((1, 6, 2))
bad = {
    "T not divisible": lambda: cp.fpa_attention(x, x, x, s, s, mesh=mesh4),
    "zigzag needs 2P chunks": lambda: cp.fox_attention(
        jnp.zeros((1, 12, 2, 4)), jnp.zeros((1, 12, 2, 4)), jnp.zeros((1, 12, 2, 4)),
        jnp.zeros((1, 12, 2)), mesh=mesh4, layout="zigzag"),
    "cu_seqlens": lambda: cp.fpa_attention(
        *(jnp.zeros((1, 8, 2, 4)),) * 3, jnp.zeros((1, 8, 2)), jnp.zeros((1, 8, 2)),
        mesh=mesh4, cu_seqlens=(0, 3, 7)),
    "seq_axis": lambda: cp.fpa_attention(x, x, x, s, s, mesh=mesh4, seq_axis="time"),
    "layout": lambda: cp.fpa_attention(x, x, x, s, s, mesh=mesh4, layout="ring"),
}
messages = {}
for name, fn in bad.items():
    try:
        fn()
        messages[name] = "no error"
    except ValueError as exc:
        messages[name] = str(exc)
report["bad"] = messages
print("REPORT" + json.dumps(report))
"""


EXPECTED = {
    "T not divisible": "T: the sequence length 6 must be divisible by the 4 chunks",
    "zigzag needs 2P chunks": "T: the sequence length 12 must be divisible by the 8 chunks",
    "cu_seqlens": "cu_seqlens: expected global offsets from 0 to T = 8",
    "seq_axis": "seq_axis: 'time' is not an axis of the mesh",
    "layout": "layout: expected one of",
}


def test_sharded_ops_on_four_host_devices():
    """One child process (one test, so that parallel test workers start it once)."""
    stdout = run_on_host_devices(CHILD, timeout=900)
    line = next(ln for ln in stdout.splitlines() if ln.startswith("REPORT"))
    report = json.loads(line.removeprefix("REPORT"))
    assert report["devices"] == 4

    # kit cases against the reference, float64 and float32
    rows = report["kit"]
    assert len(rows) == 8
    assert {r[0].split("/")[0] for r in rows} == {"fpa", "fox", "interdomain"}
    assert {r[1] for r in rows} == {"float64", "float32"}
    assert not [r for r in rows if r[2] != "passed"], rows

    # a wrong gap minimum is caught
    assert report["no_gap"] == ["failed"]

    # jit(grad) with the heads on a second mesh axis
    assert report["composed"] < 1e-12

    # bad input: a ValueError naming the argument
    for name, expected in EXPECTED.items():
        assert expected in report["bad"][name], (name, report["bad"][name])

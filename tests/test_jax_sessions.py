"""The JAX decode sessions (pure functions of state pytrees, through the kit's stateful
wrapper) against replay: each row's outputs are the reference's parallel op, layer or
whole-stream (F7) decode on that row's tokens; select and rollback are checked by what follows
them; a full fixed capacity is a ValueError eagerly and the ``overflowed`` flag under jit."""

from __future__ import annotations

import numpy as np
import pytest
from drawers import s4d_parameters
from jax_support import x64  # noqa: F401  (x64: autouse fixture)
from session_replay import (
    DV,
    F,
    H,
    M,
    R,
    Replay,
    W,
    fpa_decode_reference,
    fpa_layer_reference,
    interdomain_layer_reference,
    legs_reference,
    program,
    run_program,
    s4d_reference,
)

from attnspec.reference import fpa as ref_fpa
from attnspec.reference import interdomain as ref_id

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from attnspec.backends.jax import sessions  # noqa: E402
from attnspec.backends.jax.kit import JaxBackend  # noqa: E402


def bad_present(shapes):
    def make(session):
        inputs = {n: jnp.zeros(shape, jnp.float64) for n, shape in shapes.items()}
        return inputs, np.ones((R, 2), np.int64)  # not bool

    return make


def fpa_shapes(HQ, Hkv, dk, dv):
    return {
        "q": (R, HQ, 2, dk),
        "k": (R, Hkv, 2, dk),
        "v": (R, Hkv, 2, dv),
        "field": (R, HQ, 2),
        "level": (R, HQ, 2),
    }


@pytest.mark.parametrize("theta, window", [(np.inf, None), (2.5, None), (np.inf, 3), (2.0, 4)])
def test_fpa_session_equals_the_decode_of_each_row(theta, window):
    """GQA (4 query heads on 2 kv heads); eviction, the window, both (F3w, F7, F8, F9)."""
    rng = np.random.default_rng(4)
    backend = JaxBackend()
    HQ, Hkv, dk, dv = 4, 2, 3, 2
    config = dict(
        heads=HQ, kv_heads=Hkv, dk=dk, dv=dv, scale=0.7, theta=theta, window=window, max_rollback=W
    )
    session = backend.open_session("fpa_decode", rows=R, dtype="float64", config=config)
    dims = {"heads": HQ, "kv_heads": Hkv, "dk": dk, "dv": dv}
    replay = Replay("fpa_decode", R, dims, fpa_decode_reference(0.7, theta, HQ // Hkv, window), rng)
    bad = bad_present(fpa_shapes(HQ, Hkv, dk, dv))
    run_program(backend, session, replay, program(R, bad), "float64", 1e-12)
    # live keys per query head: the reference decoder's cache after each row's last token
    counts = {n: np.asarray(c) for n, c in session.counts().items()}
    for r, history in enumerate(replay.history):
        decoders = [ref_fpa.FPADecoder(scale=0.7, theta=theta) for _ in range(HQ)]
        for i, token in enumerate(history):
            for h, dec in enumerate(decoders):
                kv = h // (HQ // Hkv)
                dec.step(
                    token["q"][h],
                    token["k"][kv],
                    token["v"][kv],
                    token["field"][h],
                    token["level"][h],
                )
                if window is not None:  # (F3w) entries older than the window evicted
                    keep = [j for j, p in enumerate(dec.positions) if i - p < window]
                    for store in (dec.keys, dec.values, dec.levels, dec.mins, dec.positions):
                        store[:] = [store[j] for j in keep]
        np.testing.assert_array_equal(counts["live"][r], [d.cache_size for d in decoders])
        # stored holds at least the union of the live entries of the kv head's query heads
        for kv in range(Hkv):
            group = decoders[kv * 2 : kv * 2 + 2]
            union = set().union(*(d.positions for d in group))
            assert counts["stored"][r, kv] >= len(union)
    assert not np.any(counts["overflowed"])


def test_fpa_session_stores_the_union_of_live_keys_without_rollback():
    """max_rollback = 0: an entry is freed when no query head of its kv head attends it."""
    rng = np.random.default_rng(5)
    backend = JaxBackend()
    config = dict(
        heads=2, kv_heads=1, dk=2, dv=2, scale=1.0, theta=1.5, window=None, max_rollback=0
    )
    session = backend.open_session("fpa_decode", rows=1, dtype="float64", config=config)
    replay = Replay(
        "fpa_decode",
        1,
        {"heads": 2, "kv_heads": 1, "dk": 2, "dv": 2},
        fpa_decode_reference(1.0, 1.5, 2),
        rng,
    )
    decoders = [ref_fpa.FPADecoder(scale=1.0, theta=1.5) for _ in range(2)]
    for _ in range(12):
        chunk = replay.draw(1)
        replay.advance(chunk, np.ones((1, 1), bool))
        session.advance(
            {n: backend.asarray(x, "float64") for n, x in chunk.items()}, jnp.ones((1, 1), bool)
        )
        for h, dec in enumerate(decoders):
            dec.step(
                chunk["q"][0, h, 0],
                chunk["k"][0, 0, 0],
                chunk["v"][0, 0, 0],
                chunk["field"][0, h, 0],
                chunk["level"][0, h, 0],
            )
        union = set(decoders[0].positions) | set(decoders[1].positions)
        assert int(session.counts()["stored"][0, 0]) == len(union)
    assert len(union) < 12  # eviction happened


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_s4d_session_equals_the_parallel_op_per_row(readout):
    rng = np.random.default_rng(0)
    backend = JaxBackend()
    lam, b, c = s4d_parameters(rng, H, M, readout)
    config = {
        f"{n}_{p}": backend.asarray(getattr(x, a), "float64")
        for n, x in (("lam", lam), ("b", b), ("c", c))
        for p, a in (("re", "real"), ("im", "imag"))
    }
    session = backend.open_session(
        "interdomain_s4d",
        rows=R,
        dtype="float64",
        config={**config, "readout": readout, "max_rollback": W},
    )
    replay = Replay(
        "interdomain_s4d",
        R,
        {"heads": H, "features": F, "dv": DV, "readout": readout},
        s4d_reference(lam, b, c, readout),
        rng,
    )
    shapes = {"fq": (R, H, 2, F), "kt": (R, H, 2, F), "vt": (R, H, 2, DV)}
    run_program(backend, session, replay, program(R, bad_present(shapes)), "float64", 1e-12)


def test_legs_session_equals_the_parallel_op_per_row():
    rng = np.random.default_rng(1)
    backend = JaxBackend()
    session = backend.open_session(
        "interdomain_legs",
        rows=R,
        dtype="float64",
        config={"M": M, "max_rollback": W, "capacity": 64},
    )
    replay = Replay(
        "interdomain_legs", R, {"heads": H, "features": F, "dv": DV}, legs_reference(M), rng
    )
    shapes = {"fq": (R, H, 2, F), "fk": (R, H, 2, F), "v": (R, H, 2, DV)}
    run_program(backend, session, replay, program(R, bad_present(shapes)), "float64", 1e-12)


def test_layer_sessions_equal_the_parallel_layers_per_row():
    rng = np.random.default_rng(2)
    backend = JaxBackend()
    d = 8
    options = {"use_rope": True, "gate": True}
    params = ref_id.init_interdomain_params(d, H, F, DV, M, seed=3, gate=True)
    native = {n: backend.asarray(p, "float64") for n, p in params.items()}
    session = backend.open_session(
        "interdomain_layer",
        rows=R,
        dtype="float64",
        config={"params": native, **options, "max_rollback": W},
    )
    replay = Replay(
        "interdomain_layer", R, {"d": d}, interdomain_layer_reference(params, **options), rng
    )
    run_program(
        backend, session, replay, program(R, bad_present({"x": (R, 2, d)})), "float64", 1e-12
    )

    params = ref_fpa.init_fpa_params(d, H, 4, 3, seed=4)
    native = {n: backend.asarray(p, "float64") for n, p in params.items()}
    config = {"params": native, "increments": "logsigmoid", "max_rollback": W, "capacity": 32}
    session = backend.open_session("fpa_layer", rows=R, dtype="float64", config=config)
    replay = Replay(
        "fpa_layer", R, {"d": d}, fpa_layer_reference(params, increments="logsigmoid"), rng
    )
    run_program(
        backend, session, replay, program(R, bad_present({"x": (R, 2, d)})), "float64", 1e-12
    )


def test_a_full_capacity_is_a_value_error_eagerly_and_a_flag_under_jit():
    backend = JaxBackend()
    config = dict(heads=1, kv_heads=1, dk=2, dv=2, scale=1.0, theta=np.inf, window=None, capacity=4)
    session = backend.open_session("fpa_decode", rows=2, dtype="float32", config=config)
    rng = np.random.default_rng(6)

    def chunk(n):
        x = {
            "q": (2, 1, n, 2),
            "k": (2, 1, n, 2),
            "v": (2, 1, n, 2),
            "field": (2, 1, n),
            "level": (2, 1, n),
        }
        return {k: backend.asarray(rng.standard_normal(s), "float32") for k, s in x.items()}

    session.advance(chunk(4), jnp.ones((2, 4), bool))
    session.advance(chunk(1), jnp.array([[False], [False]]))  # no token: nothing added
    with pytest.raises(ValueError, match="capacity: the session's fixed capacity of 4 slots"):
        session.advance(chunk(1), jnp.array([[False], [True]]))
    np.testing.assert_array_equal(np.asarray(session.counts()["tokens"]), [4, 4])  # unchanged
    assert not np.any(np.asarray(session.counts()["overflowed"]))
    # the pure function under jit: the row that overflowed is flagged, the other is not
    x = chunk(1)
    with jax.enable_x64(True):
        _, state = jax.jit(sessions.fpa_advance)(
            session.state,
            x["q"],
            x["k"],
            x["v"],
            x["field"],
            x["level"],
            jnp.array([[False], [True]]),
            jnp.float32(1.0),
            jnp.float32(np.inf),
            jnp.int32(sessions.NO_WINDOW),
        )
    np.testing.assert_array_equal(
        np.asarray(sessions.session_counts(state)["overflowed"]), [False, True]
    )
    # LegS: tokens past the step table
    legs = backend.open_session(
        "interdomain_legs", rows=1, dtype="float32", config={"M": 3, "capacity": 2}
    )
    f = {
        n: backend.asarray(rng.uniform(0.1, 1, (1, 1, 3, 2)), "float32") for n in ("fq", "fk", "v")
    }
    with pytest.raises(ValueError, match="capacity: the session's fixed capacity of 2 tokens"):
        legs.advance(f, jnp.ones((1, 3), bool))
    assert int(legs.counts()["tokens"][0]) == 0

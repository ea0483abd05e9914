"""The torch Interdomain sessions (spec/interdomain.md I15) against replay: after every call,
each row's outputs are the reference's parallel op (or layer) on that row's tokens, absent
positions output 0, select and rollback are checked by what follows them, and failed calls
leave the session as it was."""

from __future__ import annotations

import re

import numpy as np
import pytest
from drawers import s4d_parameters
from session_replay import (
    DV,
    F,
    H,
    M,
    R,
    Replay,
    W,
    interdomain_layer_reference,
    legs_reference,
    program,
    run_program,
    s4d_reference,
)

from attnspec.reference import interdomain as ref_id

torch = pytest.importorskip("torch")
from attnspec.backends.torch.kit import TorchBackend  # noqa: E402


def bad_present(backend, names_shapes):
    def make(session):
        inputs = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in names_shapes.items()}
        return inputs, torch.ones(R, 2, dtype=torch.int64)  # not bool

    return make


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_s4d_session_equals_the_parallel_op_per_row(readout):
    rng = np.random.default_rng(0)
    backend = TorchBackend()
    lam, b, c = s4d_parameters(rng, H, M, readout)
    config = {
        f"{n}_{part}": backend.asarray(getattr(x, part), "float64")
        for n, x in (("lam", lam), ("b", b), ("c", c))
        for part in ("real", "imag")
    }
    config = {k.replace("real", "re").replace("imag", "im"): v for k, v in config.items()}
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
    run_program(
        backend, session, replay, program(R, bad_present(backend, shapes)), "float64", 1e-12
    )


def test_legs_session_equals_the_parallel_op_per_row():
    rng = np.random.default_rng(1)
    backend = TorchBackend()
    session = backend.open_session(
        "interdomain_legs", rows=R, dtype="float64", config={"M": M, "max_rollback": W}
    )
    replay = Replay(
        "interdomain_legs", R, {"heads": H, "features": F, "dv": DV}, legs_reference(M), rng
    )
    shapes = {"fq": (R, H, 2, F), "fk": (R, H, 2, F), "v": (R, H, 2, DV)}
    run_program(
        backend, session, replay, program(R, bad_present(backend, shapes)), "float64", 1e-12
    )


@pytest.mark.parametrize(
    "options", [{"use_rope": True, "gate": True}, {"readout": "ratio", "output_norm": False}]
)
def test_interdomain_layer_session_equals_the_parallel_layer_per_row(options):
    rng = np.random.default_rng(2)
    backend = TorchBackend()
    d = 8
    params = ref_id.init_interdomain_params(
        d,
        H,
        F,
        DV,
        M,
        seed=3,
        gate=options.get("gate", False),
        output_norm=options.get("output_norm", True),
    )
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
        backend,
        session,
        replay,
        program(R, bad_present(backend, {"x": (R, 2, d)})),
        "float64",
        1e-12,
    )


def test_state_sessions_refuse_bad_chunks_and_stay_usable():
    backend = TorchBackend()
    session = backend.open_session("interdomain_legs", rows=2, dtype="float32", config={"M": 4})
    ok = {"fq": torch.rand(2, 1, 3, 2), "fk": torch.rand(2, 1, 3, 2), "v": torch.rand(2, 1, 3, 5)}
    present = torch.ones(2, 3, dtype=torch.bool)
    cases = [
        ({**ok, "fq": torch.rand(3, 1, 3, 2)}, present, "fq: expected shape (2,"),
        ({**ok, "fk": torch.rand(2, 1, 3, 3)}, present, "fk: expected shape"),
        ({**ok, "v": torch.rand(2, 1, 3, 5).double()}, present, "v: expected dtype float32"),
        ({"fq": ok["fq"]}, present, "inputs: expected the names"),
        (ok, torch.ones(2, 4, dtype=torch.bool), "present: expected shape (2, 3)"),
    ]
    for inputs, mask, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            session.advance(inputs, mask)
        assert session.counts()["tokens"].tolist() == [0, 0]
    session.advance(ok, present)
    with pytest.raises(ValueError, match="max_rollback: the session keeps W = 0"):
        session.rollback(0, 1)
    assert session.counts()["tokens"].tolist() == [3, 3]
    with pytest.raises(ValueError, match="fq, v: expected the"):
        session.advance({**ok, "v": torch.rand(2, 1, 3, 4)}, present)
    with pytest.raises(ValueError, match="config: missing"):
        backend.open_session("interdomain_legs", rows=2, dtype="float32", config={})

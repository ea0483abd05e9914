"""The conformance kit on the torch backend: every case of every op, outputs and VJPs, in
float32, and the first case of every family in float64, float16 and bfloat16 (CI budget
[decision]: every case in every dtype is ``make verify``, which runs the torch backend's full
kit); and the triton adapter's claims follow what is registered."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import dispatch, ops  # noqa: E402
from attnspec.conformance import calls, cases, runner  # noqa: E402
from attnspec.conformance.cli import smoke_cases  # noqa: E402
from attnspec.conformance.registry import get_backend  # noqa: E402
from attnspec.conformance.skips import SkipList  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def all_cases():
    # decode sessions ("<op>.session") are judged where a backend claims them (test_sessions.py)
    return [c for c in cases.generate_cases() if "session" not in c.params]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_the_kit_passes_every_case(dtype, all_cases):
    backend = get_backend("torch")
    assert dtype in backend.dtypes
    selected = all_cases if dtype == "float32" else smoke_cases(all_cases)
    report = runner.run(backend, selected, [dtype], skips=SkipList.load("torch", []))
    caps = backend.capabilities()
    requires = {case.id: set(case.requires) for case in selected}

    def unclaimed(r: runner.CaseResult) -> bool:  # a family needing what torch does not claim
        return r.verdict == "not implemented" and not requires[r.case_id] <= caps

    failed = [
        f"{r.case_id} {r.kind}: {r.message}"
        for r in report.results
        if r.verdict != "passed" and not unclaimed(r)
    ]
    assert not failed, "\n".join(failed[:20])
    vjps = {op for op in backend.OPS if f"{op}.vjp" in backend.capabilities()}
    assert {(op, "gradient") for op in vjps} <= {(r.op, r.kind) for r in report.results}


def test_adapter_returns_the_protocols_dtypes_and_leaves_inputs_alone():
    backend = get_backend("torch")
    case = cases.build_case("fpa/shapes/1")
    inputs = calls.native_inputs(backend, case, calls.rounded_inputs(case, "bfloat16"), "bfloat16")
    before = {n: x.clone() for n, x in inputs.items()}
    o, lse = backend.fpa_attention(**inputs, return_lse=True)
    assert (backend.dtype_name(o), backend.dtype_name(lse)) == ("bfloat16", "float32")
    assert backend.to_numpy(o).dtype == np.float32  # NumPy has no bfloat16: widened exactly
    cot = {"o": torch.ones_like(o), "lse": torch.ones_like(lse).bfloat16()}
    grads = backend.vjp("fpa_attention", inputs, case.params, cot)
    assert {n: backend.dtype_name(g) for n, g in grads.items()} == {
        "q": "bfloat16",
        "k": "bfloat16",
        "v": "bfloat16",
        "field": "float32",
        "level": "float32",
    }
    assert all(torch.equal(before[n], x) and not x.requires_grad for n, x in inputs.items())


def test_triton_adapter_claims_only_registered_kernels(monkeypatch):
    backend = get_backend("triton")
    ops.load_triton_kernels()  # registered now, not later into the patched registry
    registry = {name: dict(impls) for name, impls in dispatch._REGISTRY.items()}
    for kernel in registry.values():
        kernel.pop("triton", None)
    monkeypatch.setattr(dispatch, "_REGISTRY", registry)
    sessions = {"fpa_decode.session", "fpa_layer.session"}  # their kernel: not in the registry
    assert backend.capabilities() == sessions
    registry["fox_fwd"]["triton"] = registry["fox_fwd"]["eager"]
    fox = {"fox_attention", "fox_attention.varlen", "fox_attention.gqa", "fox_attention.window"}
    assert backend.capabilities() == fox | sessions
    registry["fox_bwd"]["triton"] = registry["fox_bwd"]["eager"]
    assert "fox_attention.vjp" in backend.capabilities()
    assert backend._impl("fox_attention") == "triton" and backend._impl("fpa_decode") == "eager"
    assert "float64" in backend.dtypes  # only under the interpreter (no CUDA here)

"""The kit's window family (spec (F3w)): the capability, the cases, and the WindowOffByOne mutant,
which every window case catches (tests/test_conformance_kit.py) and no case without a window."""

from attnspec.conformance import cases, mutants, runner
from attnspec.conformance.numpy_backend import NumpyBackend
from attnspec.conformance.protocol import op_claims


def test_the_window_is_an_optional_capability_of_the_attention_ops():
    claims = op_claims(["fpa_attention", "fox_attention", "fpa_decode"])
    assert {"fpa_attention.window", "fox_attention.window"} <= claims
    assert not any(c.startswith("fpa_decode.") for c in claims)
    assert {"fpa_attention.window", "fox_attention.window"} <= NumpyBackend().capabilities()


def test_window_cases_cover_the_edges_and_need_the_capability():
    built = [cases.build_case(i) for i in cases.case_ids() if "/window" in i]
    windows = {(c.op, c.inputs["q"].shape[-2], c.params["window"]) for c in built}
    for op in ("fpa_attention", "fox_attention"):
        ours = {(T, W) for o, T, W in windows if o == op}
        assert any(W == 1 for _, W in ours)  # each query its own key only
        assert any(W == T for T, W in ours)  # every causal pair
        assert any(64 < W < T for T, W in ours)  # across tiles of 64
    for case in built:
        assert f"{case.op}.window" in case.requires
        if "cu_seqlens" in case.params:
            assert f"{case.op}.varlen" in case.requires
        if case.inputs["k"].shape[1] < case.inputs["q"].shape[1]:
            assert f"{case.op}.gqa" in case.requires


def test_the_off_by_one_window_passes_every_case_without_a_window():
    ids = ["fpa/shapes/1", "fpa/tiles/0", "fpa/monotone/0", "fox/shapes/1", "fox/long/0"]
    report = runner.run(mutants.WindowOffByOne(), [cases.build_case(i) for i in ids], ["float64"])
    assert report.results and all(r.verdict == "passed" for r in report.results)

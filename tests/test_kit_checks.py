"""The kit's checks for optimised kernels: rows, gradient floors, dtypes, mutation, counts,
probes, and the optional varlen and GQA capabilities (spec/conformance.md)."""

from itertools import pairwise

import numpy as np
import pytest
from flash_emulation import FlashEmulation

from attnspec.conformance import cases, metrics, mutants, runner
from attnspec.conformance.numpy_backend import NumpyBackend
from attnspec.conformance.report import format_report
from attnspec.reference import fpa
from attnspec.reference import interdomain as idm


def run_one(backend, case_id, dtype, kind="output"):
    return runner.run_case(backend, cases.build_case(case_id), dtype, kind)


# optional features


def test_varlen_reference_is_each_segment_on_its_own():
    case = cases.build_case("fpa/varlen/1")
    x, offsets = case.inputs, case.params["cu_seqlens"]
    assert 1 in np.diff(offsets)  # a length-1 segment
    o, lse = NumpyBackend().fpa_attention(**x, cu_seqlens=offsets, return_lse=True)
    for a, b in pairwise(offsets):
        part = {n: v[..., a:b, :] if v.ndim == 4 else v[..., a:b] for n, v in x.items()}
        o_ref, lse_ref = fpa.fpa_attention(**part, return_lse=True)
        np.testing.assert_allclose(o[..., a:b, :], o_ref, rtol=0, atol=1e-14)
        np.testing.assert_allclose(lse[..., a:b], lse_ref, rtol=0, atol=1e-14)


def test_varlen_s4d_resets_the_state_at_each_border():
    case = cases.build_case("s4d/varlen/0")
    x, offsets = case.inputs, case.params["cu_seqlens"]
    o = NumpyBackend().interdomain_s4d(**x, readout="linear", cu_seqlens=offsets)
    lam, b, c = (x[f"{n}_re"] + 1j * x[f"{n}_im"] for n in ("lam", "b", "c"))
    a, e = offsets[1], offsets[2]  # the second segment, from scratch
    o_ref = idm.interdomain_s4d(
        x["fq"][..., a:e, :], x["kt"][..., a:e, :], x["vt"][..., a:e, :], lam, b, c
    )
    np.testing.assert_allclose(o[..., a:e, :], o_ref, rtol=0, atol=1e-13)


def test_gqa_reference_repeats_each_kv_head_for_its_group():
    case = cases.build_case("fpa/gqa/0")  # 8 query heads, 2 key/value heads
    x = case.inputs
    H, H_kv = x["q"].shape[1], x["k"].shape[1]
    o = NumpyBackend().fpa_attention(**x)
    for h in range(H):
        g = h // (H // H_kv)
        ref = fpa.fpa_attention(
            x["q"][:, h], x["k"][:, g], x["v"][:, g], x["field"][:, h], x["level"][:, h]
        )
        np.testing.assert_allclose(o[:, h], ref, rtol=0, atol=1e-14)
    # dk of a shared head sums the gradients of its query heads
    cot = {"o": np.ones_like(o), "lse": np.zeros(x["field"].shape)}
    dk = NumpyBackend().vjp("fpa_attention", x, {}, cot)["k"]
    g0 = sum(
        fpa.fpa_attention_vjp(
            x["q"][:, h],
            x["k"][:, 0],
            x["v"][:, 0],
            x["field"][:, h],
            x["level"][:, h],
            np.ones_like(o[:, h]),
        ).dk
        for h in range(H // H_kv)
    )
    np.testing.assert_allclose(dk[:, 0], g0, rtol=1e-12, atol=1e-12)


def test_optional_capabilities_are_reported_not_implemented():
    result = run_one(mutants.ClosedSegment(), "fpa/varlen/0", "float64")
    assert result.verdict == "not implemented"
    assert "fpa_attention.varlen not in the backend's capabilities()" in result.message


def test_bad_offsets_are_rejected():
    case = cases.build_case("fox/varlen/0")
    with pytest.raises(ValueError, match="cu_seqlens: expected offsets from 0 to T"):
        NumpyBackend().fox_attention(**case.inputs, cu_seqlens=(0, 15, 299))


# runner checks


def test_a_flash_style_low_precision_backend_passes():
    # The witness that the row factor and the gradient floors are not tighter than a correct
    # kernel needs: rounding where tensor-core kernels round, on every FPA and FoX case.
    selected = [
        c for c in cases.generate_cases(["fpa_attention", "fox_attention"]) if not c.requires
    ]
    for dtype in ("float32", "float16", "bfloat16"):
        report = runner.run(FlashEmulation(dtype), selected, [dtype])
        bad = [(r.case_id, r.kind, r.message) for r in report.results if r.verdict != "passed"]
        assert not bad, (dtype, bad[:3])


def test_the_row_check_catches_what_the_normwise_error_averages_away():
    selected = [c for c in cases.generate_cases(["fpa_attention"]) if not c.requires]
    report = runner.run(mutants.DiagonalDroppedInRaggedTail(), selected, ["float16"])
    only_rows = [
        r
        for r in report.results
        if r.verdict == "failed" and r.error <= r.tolerance  # normwise passed
    ]
    assert only_rows and all("worst row" in r.message for r in only_rows)


def test_gradient_floor_keeps_a_flushed_negligible_gradient_from_failing():
    # fpa/huge/1: dfield and dlevel are 1e-22 of the other gradients; a half-precision kernel
    # that flushes them to zero is correct.
    class Flushes(NumpyBackend):
        def vjp(self, op, inputs, params, cotangents):
            grads = super().vjp(op, inputs, params, cotangents)
            return {n: np.zeros_like(g) if n in ("field", "level") else g for n, g in grads.items()}

    assert run_one(Flushes(), "fpa/huge/1", "float16", "gradient").verdict == "passed"
    with pytest.MonkeyPatch.context() as patch:  # without the floor: relative error 1, failed
        patch.setattr(runner, "gradient_floors", lambda ref: dict.fromkeys(ref, 0.0))
        assert run_one(Flushes(), "fpa/huge/1", "float16", "gradient").verdict == "failed"
    # ... while a gradient that matters, left at zero, fails in every dtype
    for dtype in ("float64", "float32", "float16"):
        result = run_one(mutants.ZeroLevelGradient(), "fpa/walk/0", dtype, "gradient")
        assert result.verdict == "failed" and "level" in result.message


def test_returned_dtypes_are_checked():
    result = run_one(mutants.Float64Gradients(), "fpa/walk/0", "float16", "gradient")
    assert result.verdict == "failed"
    assert "q: wrong dtype float64, expected float16" in result.message
    assert "field: wrong dtype float64, expected float32" in result.message


def test_inputs_modified_in_place_are_reported():
    result = run_one(mutants.InPlaceCumsum(), "fox/shapes/1", "float32")
    assert result.verdict == "failed"
    assert "modified its inputs log_f in place" in result.message

    class ClobbersCotangent(NumpyBackend):
        def vjp(self, op, inputs, params, cotangents):
            grads = super().vjp(op, inputs, params, cotangents)
            cotangents["o"] *= 0
            return grads

    result = run_one(ClobbersCotangent(), "fox/shapes/1", "float32", "gradient")
    assert "modified its cotangents o in place" in result.message


def test_kept_fraction_is_compared_as_a_count():
    class Float32Fraction(NumpyBackend):
        def fpa_decode(self, *args, **kwargs):
            o, kept = super().fpa_decode(*args, **kwargs)
            return o, np.float32(kept)  # a correct device scalar

    for case_id in ("decode/walk/2", "decode/long/1"):
        assert run_one(Float32Fraction(), case_id, "float32").verdict == "passed"
    result = run_one(mutants.FinalNotPeak(), "decode/long/1", "float64")
    assert result.verdict == "failed" and "kept keys" in result.message


def test_half_only_backends_are_probed_in_float32():
    mutant = mutants.HalfOnlySlightScale()
    assert runner.probe_dtypes(mutant) == ["float32"]
    assert runner.probe_dtypes(NumpyBackend()) == []
    selected = cases.generate_cases(prefixes=["fpa/walk/"])
    report = runner.run(mutant, selected, list(mutant.dtypes), probes=["float32"])
    verdicts = {(r.dtype, r.verdict) for r in report.results}
    assert ("float16", "passed") in verdicts and ("bfloat16", "passed") in verdicts
    assert ("float32", "failed") in verdicts  # the 0.1% scale error shows only there
    assert "the float32 rows are the strongest check" in format_report(report)

    class RefusesFloat32(NumpyBackend):
        dtypes = ("float16",)

        def asarray(self, x, dtype):
            if dtype != "float16" and np.asarray(x).ndim > 3:
                raise TypeError("float16 kernels only")
            return super().asarray(x, dtype)

    report = runner.run(RefusesFloat32(), selected[:1], ["float16"], probes=["float32"])
    probe = [r for r in report.results if r.dtype == "float32"]
    assert probe and all(r.verdict == "not implemented" for r in probe)


def test_metric_row_error_and_floor():
    ref = np.ones((2, 50, 4))  # 100 rows of norm 2
    got = ref.copy()
    got[1, 3] += 0.5  # one row off by half its norm
    c = metrics.compare(got, ref, 0.06)
    assert c.rel == pytest.approx(1.0 / 20.0) and c.rel < 0.06  # normwise: averaged away
    assert c.row_rel == pytest.approx(0.5) and c.row_index == (1, 3)
    assert c.row_rel > metrics.ROW_FACTOR * 0.06
    assert not c.passed and "worst row (1, 3)" in c.describe()
    tiny = metrics.compare(np.array([1e-20]), np.array([1e-22]), 1e-2, floor=1.0)
    assert tiny.passed
    assert not metrics.compare(np.array([1e-20]), np.array([1e-22]), 1e-2).passed


class TileSkipping(NumpyBackend):
    """A correct float64 FPA backend that drops every key whose weight is below e^-40 of the
    diagonal key's (the tile skipping the spec allows; exact to float64 rounding of every
    output), with its own backward: (G1)-(G4) written out here, ties to the latest argmin."""

    def capabilities(self):
        return {"fpa_attention", "fpa_attention.vjp"}

    @staticmethod
    def _forward(q, k, v, field, level, scale):
        s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        a = s * q @ np.swapaxes(k, -1, -2) - fpa.descent_depth(field, level)
        T = a.shape[-1]
        diagonal = np.diagonal(a, axis1=-2, axis2=-1)[..., :, None]
        kept = np.tril(np.ones((T, T), dtype=bool)) & (a >= diagonal - 40.0)
        a = np.where(kept, a, -np.inf)
        lse = np.log(np.sum(np.exp(a - a.max(-1, keepdims=True)), -1)) + a.max(-1)
        P = np.exp(a - lse[..., None])
        return P, P @ v, lse, s, kept

    def fpa_attention(self, q, k, v, field, level, *, scale=None, return_lse=False):
        _, o, lse, _, _ = self._forward(q, k, v, field, level, scale)
        return (o, lse) if return_lse else o

    def vjp(self, op, inputs, params, cotangents):
        x = inputs
        P, o, _, s, kept = self._forward(
            x["q"], x["k"], x["v"], x["field"], x["level"], params.get("scale")
        )
        d_out, d_lse = cotangents["o"], cotangents["lse"]
        D = np.sum(d_out * o, axis=-1) - d_lse
        dS = P * (d_out @ np.swapaxes(x["v"], -1, -2) - D[..., None])  # dL/dlogit
        T = P.shape[-1]
        strict = np.tril(np.ones((T, T), dtype=bool), k=-1)
        # penalty pi_ij = max(0, l_j - m_ij): d/dl_j = 1 where l_j >= m_ij, d/dphi_t* = -1
        active = strict & (x["level"][..., None, :] >= fpa.segment_min(x["field"]))
        d_pen = np.where(active & kept, -dS, 0.0)
        tstar = fpa.segment_argmin(x["field"])
        d_field = np.zeros(x["field"].shape)
        for lead in np.ndindex(*x["field"].shape[:-1]):
            where = d_pen[lead] != 0
            d_field[lead] = -np.bincount(
                tstar[lead][where], weights=d_pen[lead][where], minlength=T
            )
        return {
            "q": s * dS @ x["k"],
            "k": s * np.swapaxes(dS, -1, -2) @ x["q"],
            "v": np.swapaxes(P, -1, -2) @ d_out,
            "field": d_field,
            "level": d_pen.sum(axis=-2),
        }


def test_a_correct_tile_skipping_float64_backend_passes():
    # fpa/huge/1: the field and level gradients are ~1e-22 of the q/k/v gradients; skipping
    # keys of weight < e^-40 changes them by ~3e-22, far below float64 rounding of the op.
    # The floor follows the op's gradient scale, so that passes; with the floor scaled down by
    # the tolerance once more (the earlier rule) the same backend fails there.
    selected = [c for c in cases.generate_cases(["fpa_attention"]) if not c.requires]
    report = runner.run(TileSkipping(), selected, ["float64"])
    bad = [(r.case_id, r.kind, r.message) for r in report.results if r.verdict != "passed"]
    assert not bad, bad[:3]
    assert {"output", "gradient"} <= {r.kind for r in report.results}
    case = cases.build_case("fpa/huge/1")
    with pytest.MonkeyPatch.context() as patch:
        floors = metrics.gradient_floors
        patch.setattr(
            runner, "gradient_floors", lambda ref: {n: 1e-12 * f for n, f in floors(ref).items()}
        )
        result = runner.run_case(TileSkipping(), case, "float64", "gradient")
    assert result.verdict == "failed" and "field" in result.message

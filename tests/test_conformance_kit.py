"""Tests of the conformance kit: it passes the reference, catches every mutant, and reports."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings

from attnspec.cli import main
from attnspec.conformance import cases, drawers, mutants, runner, strategies, vectors
from attnspec.conformance.cli import smoke_cases
from attnspec.conformance.metrics import compare, relative_error
from attnspec.conformance.numpy_backend import NumpyBackend
from attnspec.conformance.registry import get_backend
from attnspec.conformance.report import format_report
from attnspec.conformance.skips import SkipList
from attnspec.conformance.tolerances import DTYPES, QUANTITIES, TOLERANCES, round_to

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "minimal_backend.py")


@pytest.fixture(scope="module")
def all_cases():
    return cases.generate_cases()


# The families added with the combined-feature, packing, head-dim, long-row, call-order,
# layer, Lambda = 0, threshold, trained-parameter and strided cases. The mutants written before
# them are checked on the menu without them (they were caught there, and running every mutant
# on every long row would cost minutes); the newer mutants name the cases that catch them.
ATTENTION_FAMILIES = (
    "packings",
    "varlen_gqa",
    "gqa_batch",
    "headdim_big",
    "long_gradient",
    "call_order",
    "strided",
)
LATER_FAMILIES = (
    *(f"{prefix}/{family}/" for prefix in ("fpa", "fox") for family in ATTENTION_FAMILIES),
    "decode/theta_near/",
    "legs/strided/",
    "s4d/packings/",
    "s4d/zero_mode/",
    "s4d/call_order/",
    "s4d/strided/",
    "fpa_layer/trained/",
    "fpa_layer/long/",
    "fpa_layer/varlen/",
    "interdomain_layer/trained/",
    "interdomain_layer/long/",
    "interdomain_layer/varlen/",
    # the covering designs (conformance/covering_cases.py)
    *(
        f"{prefix}/covering/"
        for prefix in ("fpa", "fox", "s4d", "legs", "fpa_layer", "interdomain_layer")
    ),
)


def earlier(case_list):
    return [c for c in case_list if not c.id.startswith(LATER_FAMILIES)]


def test_later_families_exist():
    ids = cases.case_ids()
    assert all(any(i.startswith(f) for i in ids) for f in LATER_FAMILIES)


# cases


def test_case_ids_are_stable_and_deterministic():
    ids = cases.case_ids()
    assert len(ids) == len(set(ids))
    a, b = cases.build_case("fpa/ragged/2"), cases.build_case("fpa/ragged/2")
    assert a.seed == cases.case_seed("fpa/ragged/2")
    for name in a.inputs:
        np.testing.assert_array_equal(a.inputs[name], b.inputs[name])


def test_generator_has_not_drifted():
    # Changing what an id names must come with a new GENERATOR_VERSION and a new value here.
    case = cases.build_case("fox/shapes/1")
    digest = float(sum(np.sum(x * (i + 1)) for i, x in enumerate(case.inputs.values())))
    assert cases.GENERATOR_VERSION == "1"
    assert digest == pytest.approx(-71.61663441961386, abs=1e-8)  # recorded at version 1


def test_families_of_the_spec_are_present():
    ids = cases.case_ids()
    for family in [
        "shapes",
        "headdim",
        "ragged",
        "long",
        "walk",
        "monotone",
        "brackets",
        "constant",
        "huge",
        "cliff",
        "one_walk",
        "extreme_level",
        "near_uniform",
        "near_onehot",
    ]:
        assert any(i.startswith(f"fpa/{family}/") for i in ids), family
    legs = [i for i in ids if i.startswith("legs/") and "/session_" not in i]
    Ms = {cases.build_case(i).params["M"] for i in legs}
    assert {1, 64} <= Ms
    moduli = [
        np.abs(
            cases.build_case(f"s4d/{f}/0").inputs["lam_re"]
            + 1j * cases.build_case(f"s4d/{f}/0").inputs["lam_im"]
        )
        for f in ("long_memory", "short_memory")
    ]
    assert moduli[0].min() > 0.999 and moduli[1].max() < 0.62


def test_gradient_cases_are_away_from_kinks(all_cases):
    for case in all_cases:
        if case.op == "fpa_attention" and case.finite_difference:
            assert drawers.fpa_kink_margin(case.inputs["field"], case.inputs["level"]) > 1e-4


def test_ratio_cases_have_positive_denominators(all_cases):
    checked = 0
    for case in all_cases:
        if "session" in case.params:  # decode sessions: checked in tests/test_sessions.py
            continue
        if case.op == "interdomain_legs":
            assert (case.inputs["fq"] > 0).all() and (case.inputs["fk"] > 0).all()
            checked += 1
        elif case.op == "interdomain_s4d" and case.params["readout"] == "ratio":
            assert (case.inputs["fq"] > 0).all() and (case.inputs["kt"] > 0).all()
            checked += 1
    covering = sum(1 for i in cases.case_ids(["interdomain_legs"]) if "/covering/" in i) + sum(
        1
        for c in all_cases
        if c.op == "interdomain_s4d" and "/covering/" in c.id and c.params["readout"] == "ratio"
    )
    # LegS 13 (strided 2), S4D ratio 7 (packings, zero_mode, empty_segment 1), the covering ones
    assert checked == 20 + covering


def test_unknown_case_id():
    with pytest.raises(ValueError, match="case id: unknown case 'fpa/nosuch/0'"):
        cases.build_case("fpa/nosuch/0")
    with pytest.raises(ValueError, match="out of range"):
        cases.build_case("fpa/long/5")


# tolerances, metric


def test_tolerance_table_complete():
    for dtype in DTYPES:
        for quantity in QUANTITIES:
            assert TOLERANCES[(dtype, quantity)] > 0


def test_bfloat16_rounding_nearest_even():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -3.0])
    np.testing.assert_array_equal(round_to(x, "bfloat16"), [1.0, 1.0, 1 + 2**-6, 1.0, -3.0])


def test_metric_fails_on_nan_shape_and_reports_worst_index():
    ref = np.arange(6.0).reshape(2, 3)
    bad = ref.copy()
    bad[1, 2] = np.nan
    assert not compare(bad, ref, 1.0).passed
    assert "non-finite value nan at (1, 2)" in compare(bad, ref, 1.0).describe()
    assert not compare(ref[:1], ref, 1.0).passed
    off = ref.copy()
    off[0, 1] += 1e-3
    c = compare(off, ref, 1e-3)
    assert c.worst_index == (0, 1) and c.worst_abs == pytest.approx(1e-3)
    assert c.rel == pytest.approx(1e-3 / np.linalg.norm(ref))


def test_relative_error_against_a_literal_sum():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((3, 4))
    x = ref + 1e-3 * rng.standard_normal((3, 4))
    pairs = list(zip(x.ravel().tolist(), ref.ravel().tolist(), strict=True))
    error = sum((a - b) ** 2 for a, b in pairs) ** 0.5
    literal = error / sum(b**2 for _, b in pairs) ** 0.5
    assert relative_error(x, ref) == pytest.approx(literal, rel=1e-12)
    assert relative_error(x, ref) == compare(x, ref, 1.0).rel  # the kit's own number
    assert relative_error(x, ref, floor=1e3) == pytest.approx(error / 1e3, rel=1e-12)
    assert relative_error(x.tolist(), ref.astype(np.float32)) == pytest.approx(
        relative_error(x, ref.astype(np.float32).astype(np.float64))
    )
    assert relative_error([1.0 + 1.0j, 2.0], [1.0, 2.0]) == pytest.approx(5**-0.5)
    # a zero reference: 0 when equal, inf otherwise (no tiny floor hides a nonzero value)
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error([0.0, 1e-100, 0.0], np.zeros(3)) == np.inf
    assert np.isnan(relative_error([np.nan, 1.0], [1.0, 1.0]))
    assert relative_error([np.inf, 1.0], [np.inf, 1.0]) == 0.0  # matching infinities
    assert relative_error([-np.inf, 1.0], [np.inf, 1.0]) == np.inf
    with pytest.raises(ValueError, match=r"x: expected the shape of ref \(3, 1\), got \(3,\)"):
        relative_error(np.ones(3), np.ones((3, 1)))  # nothing broadcast


# the reference passes


def test_reference_backend_passes_everything(all_cases):
    """Every case in float64, with the central differences that witness the reference VJP;
    the first case of every family in float32 and float16 (CI budget [decision]: every case in
    every dtype is ``make verify``, which runs the numpy backend's full kit)."""
    results = runner.run(NumpyBackend(), all_cases, ["float64"], finite_differences=True).results
    results += runner.run(NumpyBackend(), smoke_cases(all_cases), ["float32", "float16"]).results
    bad = [(r.case_id, r.dtype, r.kind, r.message) for r in results if r.verdict != "passed"]
    assert not bad
    assert {r.kind for r in results} == {"output", "gradient", "finite_difference", "call_order"}
    assert {r.dtype for r in results} == {"float64", "float32", "float16"}


@settings(max_examples=25)
@given(case=strategies.cases())
def test_reference_passes_hypothesis_cases(case):
    # New seeds must still give well-posed cases: the float32 run stays within tolerance, and
    # the reference VJP agrees with central differences (an independent witness).
    kinds = [("float32", "output")]
    if case.finite_difference:
        kinds.append(("float64", "finite_difference"))
    for dtype, kind in kinds:
        result = runner.run_case(NumpyBackend(), case, dtype, kind)
        assert result.verdict == "passed", (case.id, case.seed, kind, result.message)


# mutants


@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_every_mutant_is_caught(name, all_cases):
    # A newer mutant names the cases that catch it: each of those must fail. An older one is
    # run on the cases of the ops it changes (of the earlier menu), in the dtype where its error
    # shows, until one catches it (`attnspec conformance --backend <its class>` runs them all).
    mutant = mutants.MUTANTS[name]()
    probes = runner.probe_dtypes(mutant)
    dtypes = [] if probes else [mutant.caught_in]
    if mutant.caught_by:
        selected = [c for c in all_cases if c.id.startswith(mutant.caught_by)]
        report = runner.run(
            mutant, selected, dtypes, backend_name=name, probes=probes, name_bugs=False
        )
        caught = sorted({r.case_id for r in report.results if r.verdict == "failed"})
        assert caught == sorted(c.id for c in selected)
        return
    selected = [c for c in earlier(all_cases) if c.op in mutant.ops]
    for case, dtype, kind in runner.plan(selected, [*dtypes, *probes]).items:
        probe = dtype in probes and dtype not in dtypes
        result = runner.run_case(mutant, case, dtype, kind, backend_name=name, probe=probe)
        if result.verdict == "failed":
            print(f"\n{name}: caught by {case.id} ({dtype} {kind}): {result.message[:200]}")
            return
    pytest.fail(f"{name}: no case of {sorted(mutant.ops)} catches it")


def test_spec_mutants_are_all_there():
    assert {
        "ClosedSegment",
        "SumNotMax",
        "NoClamp",
        "EarliestArgmin",
        "NoScale",
        "TransposePairing",
        "RecurrenceOffByOne",
        "DroppedDenominator",
    } <= set(mutants.MUTANTS)


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        (
            "EarliestArgmin",
            {"brackets", "constant", "near_uniform", "extreme_level", "tiles", "ties_tiles"},
        ),
        ("TieAcrossTiles", {"ties_tiles", "tiles"}),  # ties in two tiles need T > 64
    ],
)
def test_tie_mutants_are_caught_only_by_tie_cases(name, allowed, all_cases):
    selected = [c for c in earlier(all_cases) if c.op == "fpa_attention"]
    report = runner.run(mutants.MUTANTS[name](), selected, ["float64"])
    caught = {r.case_id for r in report.results if r.verdict == "failed"}
    assert caught and {c.split("/")[1] for c in caught} <= allowed


def test_a_lost_gap_minimum_shows_only_past_two_tiles(all_cases):
    # ForgottenGap imitates tiles of 64: the gap between key and query tile needs T > 128.
    selected = [c for c in earlier(all_cases) if c.op == "fpa_attention"]
    report = runner.run(mutants.ForgottenGap(), selected, ["float64"], gradients=False)
    caught = {r.case_id for r in report.results if r.verdict == "failed"}
    lengths = {cases.build_case(c).inputs["q"].shape[-2] for c in caught}
    assert caught and min(lengths) > 128


# faults of a backend


class Faulty(NumpyBackend):
    def fox_attention(self, q, k, v, log_f, *, scale=None):
        raise RuntimeError("kernel exploded")

    def fpa_decode(self, q, k, v, field, level, *, theta, scale=None):
        o, kept = super().fpa_decode(q, k, v, field, level, theta=theta, scale=scale)
        return o[..., :-1, :], kept  # wrong shape

    def interdomain_legs(self, fq, fk, v, *, M):
        return super().interdomain_legs(fq, fk, v, M=M).astype(np.float64)  # wrong dtype

    def interdomain_s4d(self, *args, **kwargs):
        o = super().interdomain_s4d(*args, **kwargs)
        o[..., -1, 0] = np.nan
        return o

    def capabilities(self):
        return super().capabilities() - {"fpa_layer"} | {"interdomain_layer.vjp"}


def test_backend_faults_are_reported_per_case():
    selected = cases.generate_cases(
        prefixes=[
            "fox/shapes/1",
            "decode/brackets/1",
            "legs/shapes/1",
            "s4d/shapes/1",
            "fpa_layer/",
        ]
    )
    report = runner.run(Faulty(), selected, ["float32"], backend_name="faulty")
    by = {(r.case_id, r.kind): r for r in report.results}
    assert "RuntimeError raised: kernel exploded" in by[("fox/shapes/1", "output")].message
    assert f"at {__file__}:" in by[("fox/shapes/1", "output")].message  # the backend's line
    assert "wrong shape" in by[("decode/brackets/1", "output")].message
    assert "wrong dtype float64, expected float32" in by[("legs/shapes/1", "output")].message
    assert "non-finite value nan" in by[("s4d/shapes/1", "output")].message
    assert by[("fpa_layer/shapes/0", "output")].verdict == "not implemented"
    assert not report.ok
    r = by[("fox/shapes/1", "output")]
    assert r.repro == "attnspec conformance --backend faulty --cases fox/shapes/1 --dtypes float32"


def test_missing_attribute_and_missing_gradient():
    class Claims(NumpyBackend):
        def capabilities(self):
            return {"fox_attention", "fox_attention.vjp"}

        fox_attention = property(lambda self: None)  # claimed but not callable

        def vjp(self, op, inputs, params, cotangents):
            grads = super().vjp(op, inputs, params, cotangents)
            del grads["log_f"]
            return grads

    case = cases.build_case("fox/shapes/1")
    out = runner.run_case(Claims(), case, "float64", "output")
    assert out.verdict == "failed" and "TypeError" in out.message
    grad = runner.run_case(Claims(), case, "float64", "gradient")
    assert grad.verdict == "failed" and "log_f: missing from the backend's vjp" in grad.message


# CLI and reports


def test_cli_reports_json_junit_and_exit_codes(tmp_path, capsys):
    js, xml = tmp_path / "r.json", tmp_path / "r.xml"
    assert (
        main(
            [
                "conformance",
                "--backend",
                "numpy",
                "--cases",  # an op's families and a session's (not every family: seconds)
                "fox/shapes/",
                "fox/gqa/",
                "decode/walk/",
                "decode/session_rollback/",
                "--json",
                str(js),
                "--junit",
                str(xml),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fox_attention      float32  output" in out and "0 failed" in out
    data = json.loads(js.read_text())
    assert {c["verdict"] for c in data["cases"]} == {"passed"}
    assert data["cases"][0]["seed"] == cases.case_seed(data["cases"][0]["case_id"])
    suite = ET.parse(xml).getroot()
    assert int(suite.get("failures")) == 0
    assert len(suite) == len(data["cases"]) + len(data["unclaimed"])

    mutant = "attnspec.conformance.mutants:SumNotMax"
    assert (
        main(
            [
                "conformance",
                "--backend",
                mutant,
                "--cases",
                "fpa/walk/0",
                "--no-gradients",
                "--dtypes",
                "float64",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    repro = next(line.split("repro: ")[1] for line in out.splitlines() if "repro: " in line)
    assert repro == f"attnspec conformance --backend {mutant} --cases fpa/walk/0 --dtypes float64"
    assert main(repro.split()[1:]) == 1  # the repro line reproduces the failure

    assert main(["conformance", "--backend", "nosuch"]) == 2
    assert "unknown name 'nosuch'" in capsys.readouterr().err


def test_missing_framework_names_the_extra(monkeypatch, capsys):
    from attnspec.conformance import registry

    real = registry.importlib.util.find_spec
    monkeypatch.setattr(
        registry.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "jax" else real(name, *a),
    )
    assert main(["conformance", "--backend", "pallas"]) == 2
    assert "install the 'jax' extra" in capsys.readouterr().err


def test_example_backend_from_the_docs(capsys):
    assert main(["conformance", "--backend", f"{EXAMPLE}:MinimalFoX"]) == 0
    out = capsys.readouterr().out
    assert "fox_attention      float32  gradient" in out
    assert "not implemented" in out


def test_skip_files(tmp_path):
    skip = tmp_path / "skips.txt"
    skip.write_text("fox/shapes float32  # known float32 issue\nfpa/nosuch  # stale entry\n")
    skips = SkipList.load("numpy", [str(skip)])
    report = runner.run(
        NumpyBackend(),
        cases.generate_cases(prefixes=["fox/shapes/0"]),
        ["float32", "float64"],
        skips=skips,
    )
    verdicts = {(r.dtype, r.kind): r.verdict for r in report.results}
    assert verdicts[("float32", "output")] == "skipped"
    assert verdicts[("float64", "output")] == "passed"
    assert report.unmatched_skips == [f"{skip}:2: 'fpa/nosuch' matched no case"]
    bad = tmp_path / "bad.txt"
    bad.write_text("fox/shapes\n")
    with pytest.raises(ValueError, match="needs a reason"):
        SkipList.load("numpy", [str(bad)])


def test_registry_loads_module_attribute_and_files():
    assert get_backend("attnspec.conformance.mutants:NoScale").name == "mutant-NoScale"
    assert get_backend(f"{EXAMPLE}:MinimalFoX").name == "minimal-fox"
    with pytest.raises(ValueError, match="no attribute 'Nope'"):
        get_backend("attnspec.conformance.mutants:Nope")
    with pytest.raises(ValueError, match="device: the numpy backend runs on 'cpu' only"):
        get_backend("numpy", "cuda")


# golden vectors


def test_vectors_round_trip(tmp_path):
    vec, res = tmp_path / "vec", tmp_path / "res"
    assert (
        main(
            [
                "vectors",
                "export",
                str(vec),
                "--cases",
                "fpa/ragged/0",
                "decode/brackets/1",
                "s4d/ratio/1",
            ]
        )
        == 0
    )
    manifest = json.loads((vec / "manifest.json").read_text())
    assert len(manifest["cases"]) == 6 and manifest["generator_version"] == "1"
    entry = next(e for e in manifest["cases"] if e["id"] == "decode/brackets/1")
    assert entry["params"] == {"theta": 6.0}
    vectors.write_results_from_backend(str(vec), str(res), NumpyBackend())
    assert {v.verdict for v in vectors.check(str(vec), str(res))} == {"passed"}
    assert main(["vectors", "check", str(vec), "--results", str(res)]) == 0

    bad = tmp_path / "bad"
    vectors.write_results_from_backend(str(vec), str(bad), mutants.NoClamp())
    verdicts = {(v.id, v.dtype): v.verdict for v in vectors.check(str(vec), str(bad))}
    assert verdicts[("fpa/ragged/0", "float64")] == "failed"
    os.remove(bad / entry["file"])
    verdicts = {(v.id, v.dtype): v.verdict for v in vectors.check(str(vec), str(bad))}
    assert verdicts[("decode/brackets/1", entry["dtype"])] == "not implemented"

    with open(vec / entry["file"], "ab") as fh:
        fh.write(b"tampered")
    tampered = {v.id: v.message for v in vectors.check(str(vec), str(res)) if v.verdict == "failed"}
    assert "checksum mismatch" in tampered["decode/brackets/1"]


# pytest plugin


def run_pytest(*args):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_pytest_plugin_runs_the_cases(tmp_path):
    ok = run_pytest(
        "--pyargs",
        "attnspec.conformance",
        "--backend",
        "numpy",
        "--conformance-cases",
        "fox/unit_gates,decode/brackets/0",
        "-q",
    )
    assert ok.returncode == 0, ok.stdout
    assert "18 passed" in ok.stdout  # 3 + 3 + 2 x 3 dtypes (T = 1: no gradient), decode 3
    skip = tmp_path / "s.txt"
    skip.write_text("legs/nosuch  # stale\n")
    bad = run_pytest(
        "--pyargs",
        "attnspec.conformance",
        "--backend",
        "attnspec.conformance.mutants:EagerEviction",
        "--conformance-cases",
        "decode/brackets",
        "--conformance-skips",
        str(skip),
        "-q",
    )
    assert bad.returncode == 1
    assert (
        "repro: attnspec conformance --backend attnspec.conformance.mutants:EagerEviction"
        in bad.stdout
    )
    assert "skip entry" in bad.stdout and "'legs/nosuch' matched no case" in bad.stdout


def test_decode_thresholds_are_far_from_every_depth():
    from attnspec.reference import fpa

    for case_id in cases.case_ids(["fpa_decode"]):
        if "/session_" in case_id:  # sessions: thresholds off the grid (tests/test_sessions.py)
            continue
        case = cases.build_case(case_id)
        theta = case.params["theta"]
        if np.isfinite(theta) and case.family not in ("boundary", "theta_near"):  # near depths
            depths = fpa.descent_depth(case.inputs["field"], case.inputs["level"])
            # The penalty of a float32 backend is off by < 1e-5 here (|field| < 40, ulp 4e-6);
            # a margin of 1e-3 keeps every eviction decision identical (measured: >= 0.083).
            assert np.abs(depths - theta).min() > 1e-3, case_id


# later families


def test_drawn_packings_vary_order_lengths_and_borders():
    packings = [cases.build_case(i).params.get("cu_seqlens") for i in cases.case_ids()]
    packings = [p for p in packings if p is not None and len(p) > 5]  # drawn ones
    lengths = [np.diff(p) for p in packings]
    assert all(ls[-1] != ls.max() for ls in lengths)  # the longest segment is never last
    assert {0, len(lengths[0]) - 1} <= {int(np.argmin(ls)) for ls in lengths if ls.min() == 1}
    assert any(ls.min() == 1 and 0 < np.argmin(ls) < len(ls) - 1 for ls in lengths)
    assert {64, 128, 256} <= {int(x) for ls in lengths for x in ls}  # tile multiples ...
    assert any(int(x) % 64 for ls in lengths for x in ls)  # ... and others
    s4d = [cases.build_case(f"s4d/packings/{n}") for n in range(3)]
    assert {c.params["readout"] for c in s4d} == {"linear", "ratio"}
    late = [b for c in s4d for b in c.params["cu_seqlens"][1:-1] if b > 128 and b % 128]
    assert late  # a border inside a later chunk of 128


def test_combined_and_big_cases_have_their_shapes():
    for op in ("fpa", "fox"):
        for n in range(2):
            x = cases.build_case(f"{op}/varlen_gqa/{n}").inputs
            assert x["k"].shape[1] < x["q"].shape[1] and x["q"].shape[0] == 1
            x = cases.build_case(f"{op}/gqa_batch/{n}").inputs
            assert x["q"].shape[0] > 1 and 1 < x["k"].shape[1] < x["q"].shape[1]
        dims = [cases.build_case(f"{op}/headdim_big/{n}").inputs for n in range(3)]
        assert {192, 256} <= {x["q"].shape[-1] for x in dims} | {x["v"].shape[-1] for x in dims}
        assert all(x["q"].shape[-1] != x["v"].shape[-1] for x in dims)
        long = [cases.build_case(f"{op}/long_gradient/{n}") for n in range(2)]
        assert all(c.gradient and c.inputs["q"].shape[-2] >= 1024 for c in long)
    for op in ("fpa_layer", "interdomain_layer"):
        assert cases.build_case(f"{op}/long/0").inputs["x"].shape[1] >= 130


def test_zero_mode_and_near_threshold_cases():
    for n in range(2):
        x = cases.build_case(f"s4d/zero_mode/{n}").inputs
        assert ((x["lam_re"] == 0) & (x["lam_im"] == 0)).sum() == x["lam_re"].shape[0]
    from attnspec.reference import fpa

    for n in range(3):
        case = cases.build_case(f"decode/theta_near/{n}")
        theta = case.params["theta"]
        depths = fpa.descent_depth(case.inputs["field"], case.inputs["level"])
        nearest = depths.ravel()[np.argmin(np.abs(depths - theta).ravel())]
        assert nearest == np.round(nearest) and 0 < abs(theta - nearest) < 0.5
        assert float(np.float16(theta)) != theta  # not representable in half precision


def test_trained_parameters_move_every_entry_of_any_dict():
    rng = np.random.default_rng(0)
    init = {"g": np.ones((2, 3)), "b": np.zeros(4), "added_later": np.full((2, 2), 5.0)}
    moved = drawers.trained(init, rng)
    assert moved.keys() == init.keys()
    for name, p in init.items():
        assert (moved[name] != p).all(), name  # every entry, distinct per entry
        assert len(np.unique(moved[name])) == p.size
    for case_id in cases.case_ids(["fpa_layer", "interdomain_layer"]):
        case = cases.build_case(case_id)
        if case.family == "trained":  # gains off 1, biases off 0, entry by entry
            x = case.inputs
            gains = [v for k, v in x.items() if k.endswith("_g")]
            biases = [v for k, v in x.items() if k.endswith(("_b", "b_delta", "b_lam"))]
            assert biases and all((b != 0).all() for b in biases)
            assert all((g != 1).all() for g in gains)
            assert gains or case.op == "fpa_layer"


def test_call_sequences_interleave_both_inputs():
    for seed in range(20):
        order = runner.call_sequence(seed)
        assert sorted(order) == sorted([(k, w) for k in ("output", "gradient") for w in (0, 1)] * 2)
        follows_other = {w for (_, a), (k, w) in pairwise(order) if k == "gradient" and a != w}
        assert follows_other == {0, 1}
    case = cases.build_case("fpa/call_order/0")
    other = cases.partner(case)
    assert other.shapes() == case.shapes() and not np.array_equal(
        other.inputs["q"], case.inputs["q"]
    )


def test_strided_inputs_are_views_or_not_implemented():
    case = cases.build_case("fpa/strided/1")
    assert case.layout == "transpose"
    for layout in ("slice", "transpose"):
        x = NumpyBackend().asarray_strided(case.inputs["q"], "float32", layout)
        assert not x.flags.c_contiguous and x.base is not None
        np.testing.assert_array_equal(x, case.inputs["q"].astype(np.float32))

    class Plain(NumpyBackend):
        asarray_strided = None

    result = runner.run_case(Plain(), case, "float64", "output")
    assert result.verdict == "not implemented" and "asarray_strided" in result.message


def test_a_raise_points_at_the_backends_own_line():
    class Raises(NumpyBackend):
        def fox_attention(self, q, k, v, log_f, *, scale=None):
            return np.linalg.cholesky(-np.eye(2))  # raises inside NumPy

    report = runner.run(Raises(), cases.generate_cases(prefixes=["fox/shapes/1"]), ["float32"])
    result = report.results[0]
    assert result.verdict == "failed" and result.raised.startswith("LinAlgError")
    assert f"at {__file__}:" in result.message and "in fox_attention, via numpy/" in result.message
    assert "protocol.py" not in result.message
    row = next(line for line in format_report(report).splitlines() if " output " in line)
    assert "raised LinAlgError" in row and "FAILED" not in row and "e-" not in row

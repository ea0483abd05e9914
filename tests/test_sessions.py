"""Decode sessions: the reference sessions, the kit's session families and their mutants.

The theory checks F8, F3w, F9 and I15 (tests/test_theory.py) hold the reference sessions to the
whole-stream ops; here the kit is held to its promises: every family fails its mutant and passes
the others, the programs have the properties their notes claim, and errors are judged.
"""

import math
import os

import numpy as np
import pytest

from attnspec.conformance import cases, runner, session_programs, sessions
from attnspec.conformance.numpy_backend import NumpyBackend
from attnspec.conformance.registry import get_backend
from attnspec.conformance.session_mutants import SESSION_MUTANTS
from attnspec.reference import sessions as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "minimal_session.py")


@pytest.fixture(scope="module")
def first_cases():
    """The first case of every session family, by op (the CI subset)."""
    by_op = {}
    for case in cases.generate_cases(list(session_programs.OPS)):
        if sessions.is_session(case) and case.id.endswith("/0"):
            by_op.setdefault(case.op, []).append(case)
    return by_op


def _family(case_id):
    return case_id.split("/")[1].removeprefix("session_")


def test_every_op_has_the_families_of_the_spec():
    common = set(session_programs.COMMON)
    for op in session_programs.OPS:
        names = set(session_programs.FAMILIES[op])
        assert common <= names, op
    assert {"gqa", "theta_exact", "dense", "window"} <= set(session_programs.FAMILIES["fpa_decode"])
    assert {"dense", "window"} <= set(session_programs.FAMILIES["fpa_layer"])
    ids = cases.case_ids()
    assert "decode/session_gqa/0" in ids and "interdomain_layer/session_rollback/1" in ids


@pytest.mark.parametrize("name", sorted(SESSION_MUTANTS))
def test_every_session_mutant_fails_its_family_and_passes_the_others(name, first_cases):
    mutant = SESSION_MUTANTS[name]()
    # the 2,048-token families run only for the mutant written for them (seconds each)
    long = set(session_programs.LONG_SESSIONS) - {mutant.family}
    selected = [c for c in first_cases[mutant.op] if _family(c.id) not in long]
    report = runner.run(mutant, selected, ["float64"], name_bugs=False)
    # the covering programs combine every feature: they may catch any wrong session
    failed = {_family(r.case_id) for r in report.results if r.verdict == "failed"} - {"covering"}
    assert mutant.family in failed
    assert failed <= {mutant.family, *mutant.also}, failed
    families = {_family(c.id) for c in selected}
    assert mutant.family in families and set(mutant.also) <= families


def test_every_family_of_fpa_decode_has_a_mutant():
    caught = {m.family for m in SESSION_MUTANTS.values() if m.op == "fpa_decode"}
    assert caught == set(session_programs.FAMILIES["fpa_decode"])


def test_programs_do_what_their_notes_say():
    _, trace = sessions.reference_for(cases.build_case("decode/session_long/0"), "float64")
    assert trace[-1].counts["tokens"].min() > 300 and trace[-1].counts["live"].min() > 128
    _, trace = sessions.reference_for(cases.build_case("fpa_layer/session_long/0"), "float64")
    assert trace[-1].counts["tokens"].min() > 300 and trace[-1].counts["live"].min() > 128
    # finite thresholds lie 1/16 off the 1/8 grid of fields and levels but in theta_exact
    for case_id in cases.case_ids(["fpa_decode"]):
        if "/session_" in case_id:
            program = cases.build_case(case_id).params["session"]
            theta = program.config["theta"]
            exact = "theta_exact" in case_id
            assert math.isinf(theta) or (theta * 16 % 2 == (0 if exact else 1)), case_id
    # GQA: the union rule stores entries some query head of the group evicted
    _, trace = sessions.reference_for(cases.build_case("decode/session_gqa/0"), "float64")
    live = trace[-1].counts["live"].reshape(2, 2, 2)
    assert (trace[-1].counts["stored"] >= live.max(axis=-1)).all()
    assert (trace[-1].counts["stored"] < live.sum(axis=-1)).any()


def test_the_reference_session_rejects_bad_calls_and_stays_usable():
    s = ref.FPASession(2, heads=2, kv_heads=1, dk=4, dv=4, scale=0.5, theta=1.0, max_rollback=2)
    rng = np.random.default_rng(0)

    def chunk(n):
        f = np.cumsum(rng.standard_normal((2, 2, n)), axis=-1)
        return {
            "q": rng.standard_normal((2, 2, n, 4)),
            "k": rng.standard_normal((2, 1, n, 4)),
            "v": rng.standard_normal((2, 1, n, 4)),
            "field": f,
            "level": f,
        }

    s.advance(chunk(3), np.ones((2, 3), bool))
    before = s.counts()
    for call, match in [
        (lambda: s.rollback(0, 3), "max_rollback"),
        (lambda: s.rollback(2, 1), "row"),
        (lambda: s.select([]), "rows"),
        (lambda: s.select([0, 2]), "rows"),
        (lambda: s.advance(chunk(2), np.ones((2, 2))), "present"),
        (lambda: s.advance(chunk(2), np.ones((2, 3), bool)), "present"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
        for key, value in s.counts().items():
            np.testing.assert_array_equal(value, before[key])
    s.rollback(0, 2)
    with pytest.raises(ValueError, match="n: row 0 can undo only 0 tokens"):
        s.rollback(0, 1)
    out = s.advance(chunk(2), np.array([[True, False], [False, False]]))["o"]
    assert (out[0, :, 1] == 0).all() and (out[1] == 0).all()
    assert s.counts()["tokens"].tolist() == [2, 3]


def test_a_failure_lists_the_program_and_replays(capsys):
    mutant = SESSION_MUTANTS["PartialRollback"]()
    case = cases.build_case("decode/session_rollback_past/0")
    result = runner.run_case(mutant, case, "float64", "output")
    assert result.verdict == "failed" and "expected a ValueError naming 'n'" in result.message
    assert "program up to the failing call:" in result.message
    assert "python -m attnspec.conformance.sessions" in result.repro
    assert sessions.main(["--backend", "numpy", "--case", case.id, "--dtype", "float32"]) == 0
    assert "rollback(row=1, n=1)  -> ValueError naming 'n'" in capsys.readouterr().out


def test_the_kit_judges_errors_and_counts():
    class NoValueError(NumpyBackend):
        def open_session(self, op, **kw):
            session = super().open_session(op, **kw)
            select = session.select

            def strict(rows):
                if not rows:
                    raise IndexError("empty")
                select(rows)

            session.select = strict
            return session

    class FloatCounts(NumpyBackend):
        def open_session(self, op, **kw):
            session = super().open_session(op, **kw)
            counts = session.counts
            session.counts = lambda: {k: v.astype(float) for k, v in counts().items()}
            return session

    class Overflowed(NumpyBackend):
        def open_session(self, op, **kw):
            session = super().open_session(op, **kw)
            counts = session.counts
            session.counts = lambda: {**counts(), "overflowed": counts()["tokens"] > 3}
            return session

    class ScalesItsInputs(NumpyBackend):
        def open_session(self, op, **kw):
            session = super().open_session(op, **kw)
            advance = session.advance

            def scaled(inputs, present):
                inputs["q"] *= 1.0  # touches nothing...
                inputs["v"][..., :1] = 0.0  # ...but this is a write into the caller's array
                return advance(inputs, present)

            session.advance = scaled
            return session

    bad = cases.build_case("decode/session_bad/0")
    result = runner.run_case(NoValueError(), bad, "float64", "output")
    assert "expected a ValueError naming 'rows', got IndexError: empty" in result.message
    result = runner.run_case(FloatCounts(), bad, "float64", "output")
    assert "expected an integer dtype" in result.message
    result = runner.run_case(Overflowed(), bad, "float64", "output")
    assert "call 0 advance: counts: overflowed [1, 1]" in result.message
    result = runner.run_case(ScalesItsInputs(), bad, "float64", "output")
    assert "modified its inputs v in place" in result.message
    assert runner.run_case(NumpyBackend(), bad, "float64", "output").verdict == "passed"


def test_the_minimal_session_backend_of_the_docs_passes():
    backend = get_backend(f"{EXAMPLE}:MinimalSession")
    selected = [c for c in cases.generate_cases(["fpa_decode"]) if sessions.is_session(c)]
    report = runner.run(backend, selected, ["float32"])
    assert {r.verdict for r in report.results} == {"passed"}, [
        (r.case_id, r.message[:300]) for r in report.results if r.verdict != "passed"
    ]

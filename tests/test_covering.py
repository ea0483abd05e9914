"""Covering designs (conformance/covering.py, covering_cases.py), the results held across the
call sequence, the wrong backends where features meet, and the context-parallel command run
with -m."""

import itertools
import os
import subprocess
import sys
import textwrap

import pytest

from attnspec.conformance import cases, coverage_report, covering, covering_cases, mutants, runner

AXES = (("a", (0, 1, 2)), ("b", ("x", "y")), ("c", (0, 1, 2, 3)), ("d", (True, False)))


def _brute_pairs(rows, axes, forbid):
    """Every allowed pair, and those the rows miss, by enumeration."""
    want = set()
    for (a, xs), (b, ys) in itertools.combinations(axes, 2):
        want |= {(a, x, b, y) for x in xs for y in ys if not forbid(a, x, b, y)}
    got = set()
    for row in rows:
        for (a, _), (b, _) in itertools.combinations(axes, 2):
            got.add((a, row[a], b, row[b]))
    return want, want - got


def test_all_pairs_covers_every_allowed_pair_and_respects_the_constraints():
    def forbid(a, x, b, y):
        return (a, x, b, y) == ("a", 2, "b", "y") or (a, x, b, y) == ("b", "y", "a", 2)

    rows = covering.all_pairs(AXES, seed=3, budget=50, forbid=forbid)
    want, missing = _brute_pairs(rows, AXES, forbid)
    assert not missing and len(want) == 3 * 2 + 3 * 4 + 3 * 2 + 2 * 4 + 2 * 2 + 4 * 2 - 1
    assert 12 <= len(rows) <= 16  # 3 x 4 values need 12 rows; greedy stays near it
    assert not any(r["a"] == 2 and r["b"] == "y" for r in rows)
    assert covering.all_pairs(AXES, 3, 50, forbid) == rows  # deterministic from the seed
    assert len(covering.all_pairs(AXES, 3, 5, forbid)) == 5  # the budget


def test_each_covering_family_alone_covers_every_pair_of_its_axes():
    for op, design in covering_cases.DESIGNS.items():
        built = [
            covering_cases.case_axes(cases.build_case(i))
            for i in cases.case_ids([op])
            if "/session_" not in i
        ]
        family = [
            covering_cases.case_axes(cases.build_case(i))
            for i in cases.case_ids([op])
            if "/covering/" in i
        ]
        assert len(family) <= max(design.budget, 1)
        _, missing = covering.coverage(design, family)
        assert not missing, (op, sorted(missing, key=repr)[:5])
        # the rows read back from the built cases are the design's rows (what was promised)
        assert [{a: r[a] for a, _ in design.axes} for r in family] == list(
            covering_cases.rows(op)
        ), op
        assert len(built) > len(family)


def test_the_menu_coverage_before_and_after():
    before = coverage_report.menu_coverage(with_covering=False)
    after = coverage_report.menu_coverage(with_covering=True)
    for op in covering_cases.DESIGNS:
        assert before[op][0] < before[op][1] == after[op][0] == after[op][1], op
    lines = coverage_report.coverage_lines({"fpa_attention.varlen"})
    assert lines[0].startswith("pair coverage, fpa_attention: 480/480 pairs")
    assert "the backend lacks fpa_attention.gqa, strided" in lines[0]


def test_the_held_results_catch_a_persistent_output_buffer_and_only_them():
    case = cases.build_case("fox/call_order/0")
    result = runner.run_case(mutants.PersistentOutputs(), case, "float64", "call_order")
    assert result.verdict == "failed"
    failed = [n for n, d in result.details.items() if "reused output buffer" in d]
    assert failed and all(" held: " in n for n in failed)
    assert all(" held: " in part for part in result.message.split("; ") if part)
    # the reference passes the same check, held results included
    ok = runner.run_case(mutants.NumpyBackend(), case, "float64", "call_order")
    assert ok.verdict == "passed" and any(" held: " in n for n in ok.details)


# The wrong backends of this round, each with the first case that catches it and the families of
# the earlier menu that it passes (the axis it breaks on, varied alone there).
ROUND_FOUR = {
    "ModesRoundedDown": ("s4d/covering/0", ("s4d/modes/", "s4d/shapes/", "s4d/ratio/")),
    "LegsModesRoundedDown": ("legs/covering/3", ("legs/basis_size/", "legs/shapes/")),
    "EqualPackingUnmasked": ("fox/covering/6", ("fpa/packings/", "fox/varlen/", "fox/packings/")),
    "StridedGQAQueryHeads": ("fpa/covering/4", ("fpa/strided/", "fox/strided/", "fpa/gqa/")),
    "PersistentOutputs": ("fpa/call_order/0", ()),
    "PackedRopePositions": (
        "interdomain_layer/covering/3",
        ("interdomain_layer/trained/", "interdomain_layer/varlen/", "interdomain_layer/long/"),
    ),
}


@pytest.mark.parametrize("name", sorted(ROUND_FOUR))
def test_round_four_mutants_pass_the_earlier_families_and_fail_their_case(name):
    first, earlier = ROUND_FOUR[name]
    mutant = mutants.MUTANTS[name]()
    assert first.startswith(mutant.caught_by)
    caught = runner.run(mutant, [cases.build_case(first)], ["float64"], backend_name=name)
    assert any(r.verdict == "failed" for r in caught.results)
    if earlier:
        picked = [cases.build_case(i) for i in cases.case_ids() if i.startswith(earlier)][:6]
        report = runner.run(mutant, picked, ["float64"], backend_name=name, gradients=False)
        assert all(r.verdict in ("passed", "not implemented") for r in report.results)


def test_the_context_parallel_command_runs_with_dash_m(tmp_path):
    """`python -m attnspec.conformance.context_parallel BACKEND` with a backend that pickles the
    jobs into a `python -c` child (as the JAX one does): the jobs must unpickle there."""
    (tmp_path / "childcp.py").write_text(
        textwrap.dedent(
            """
            import pickle, subprocess, sys
            from attnspec.conformance.context_parallel import JobResult, REFERENCE
            from attnspec.conformance.protocol import call_op

            class Backend:
                name = "child"
                def capabilities(self):
                    return {"interdomain_s4d.context_parallel"}
                def run_sharded(self, jobs, world):
                    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
                    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(jobs),
                                          capture_output=True)
                    if done.returncode:
                        raise RuntimeError(done.stderr.decode()[-500:])
                    return [JobResult({k: v for k, v in call_op(REFERENCE, j.op, j.inputs,
                            j.params).items()}, REFERENCE.vjp(j.op, j.inputs, j.params,
                            j.cotangents)) for j in jobs]
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "attnspec.conformance.context_parallel", "childcp:Backend"]
    command += ["--worlds", "2", "--dtypes", "float64", "--ops", "interdomain_s4d"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "0 not passed" in done.stdout

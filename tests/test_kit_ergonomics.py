"""What a backend author meets in the kit: shape limits, expected failures, tie notes, sibling
imports, a vjp returning None, a dtype fault with right values, the repro's environment; and the
pytest plugin beside a project's own ``--backend`` (issue 40, points 3 and 4)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from attnspec.conformance import cases, mutants, runner
from attnspec.conformance.protocol import UnsupportedShape
from attnspec.conformance.registry import get_backend
from attnspec.conformance.report import format_report, summary_rows
from attnspec.conformance.skips import XfailList

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "minimal_backend.py")
FOX = "fox/shapes/1"  # a FoX case with gradients


def minimal() -> type:
    return get_backend(f"{EXAMPLE}:MinimalFoX").__class__


def run_fox(backend: object, kind: str = "output", case_id: str = FOX) -> runner.CaseResult:
    return runner.run_case(backend, cases.build_case(case_id), "float32", kind)


def test_a_backend_declares_or_raises_a_shape_limit():
    class Declares(minimal()):
        def unsupported(self, op, shapes):
            K = shapes["q"][-1]
            return None if K in (32, 64, 128) else f"head dim {K} not in {{32, 64, 128}}"

    class Raises(minimal()):
        def fox_attention(self, q, k, v, log_f, *, scale=None):
            raise UnsupportedShape(f"head dim {q.shape[-1]} not in {{32, 64, 128}}")

    K = cases.build_case(FOX).inputs["q"].shape[-1]
    assert K not in (32, 64, 128)
    for backend in (Declares(), Raises()):
        result = run_fox(backend)
        assert result.verdict == "not implemented", result.message
        assert f"not supported for this shape: head dim {K}" in result.message


def test_an_expected_failure_that_starts_passing_is_reported(tmp_path):
    listed = tmp_path / "x.txt"
    listed.write_text(f"{FOX} float32  # known bug\nfox/nosuch  # stale\n")
    xfails = XfailList.load("minimal-fox", [str(listed)])

    class Wrong(minimal()):
        def fox_attention(self, q, k, v, log_f, *, scale=None):
            return super().fox_attention(q, k, v, log_f, scale=scale) * 1.01

    failing = xfails.judge(run_fox(Wrong()))
    assert failing.verdict == "xfailed" and "known bug" in failing.message
    passing = xfails.judge(run_fox(minimal()()))
    assert passing.verdict == "failed"
    assert (
        "listed as an expected failure" in passing.message and "remove the entry" in passing.message
    )
    report = runner.run(
        minimal()(), [cases.build_case(FOX)], ["float32"], gradients=False, xfails=xfails
    )
    assert [r.verdict for r in report.results] == ["failed"]
    assert any("xfail entry" in w and "fox/nosuch" in w for w in report.unmatched_skips)
    assert "warning: xfail entry" in format_report(report)


def test_a_failing_tie_case_says_it_is_one():
    case = cases.build_case("fpa/brackets/0")
    result = runner.run_case(mutants.EarliestArgmin(), case, "float64", "gradient")
    assert result.verdict == "failed"
    assert "tie case" in result.note and result.as_dict()["note"] == case.note
    report = runner.RunReport("m", "cpu", [result], [], {}, 0.0)
    assert f"    case: {case.note}" in format_report(report)


def test_a_file_backend_imports_its_sibling_module(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "attnspec_sibling_helper.py").write_text("NAME = 'sibling'\n")
    (tmp_path / "sibling_backend.py").write_text(
        "from attnspec_sibling_helper import NAME\n"
        "class B:\n"
        "    name = NAME\n"
        "    def __init__(self, device='cpu'):\n"
        "        pass\n"
    )
    monkeypatch.chdir("/")
    backend = get_backend(f"{tmp_path / 'sibling_backend.py'}:B")
    assert backend.name == "sibling"


def test_a_vjp_returning_none_names_the_input():
    class NoneForGates(minimal()):
        def vjp(self, op, inputs, params, cotangents):
            return {**super().vjp(op, inputs, params, cotangents), "log_f": None}

    result = run_fox(NoneForGates(), "gradient")
    assert result.verdict == "failed" and not result.raised
    assert "log_f: vjp returned None for log_f" in result.message


def test_a_dtype_fault_with_right_values_shows_the_error_apart():
    class Widened(minimal()):
        def fox_attention(self, q, k, v, log_f, *, scale=None):
            return self._forward(q, k, v, log_f, scale)[1].astype(np.float64)

    result = run_fox(Widened())
    assert result.verdict == "failed"
    assert "wrong dtype float64, expected float32" in result.message
    assert "(the values pass: rel" in result.message
    assert np.isfinite(result.error) and result.error < result.tolerance
    report = runner.RunReport("w", "cpu", [result], [], {}, 0.0)
    (row,) = summary_rows(report)
    assert row["worst_error"] == result.error
    assert "FAILED (wrong dtype, values pass)" in format_report(report)


def test_the_repro_line_sets_the_backend_environment():
    class NeedsEnv(minimal()):
        def environment(self):
            return {"MY_KERNELS": "interpret"}

        def fox_attention(self, q, k, v, log_f, *, scale=None):
            return super().fox_attention(q, k, v, log_f, scale=scale) * 1.01

    result = run_fox(NeedsEnv())
    assert result.verdict == "failed"
    assert result.repro.startswith("MY_KERNELS=interpret attnspec conformance --backend")


def run_pytest(cwd: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
    )


def test_a_project_with_its_own_backend_option_runs_beside_the_plugin(tmp_path):
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            def pytest_addoption(parser):
                parser.addoption("--backend", default="cpu")

            def pytest_report_header(config):
                return "project backend: " + config.getoption("--backend")
            """
        )
    )
    (tmp_path / "test_mine.py").write_text(
        "def test_backend(request):\n    assert request.config.getoption('--backend') == 'gpu'\n"
    )
    mine = run_pytest(str(tmp_path), "--backend", "gpu", "-q")
    assert mine.returncode == 0, mine.stdout + mine.stderr
    assert "1 passed" in mine.stdout
    help_text = run_pytest(str(tmp_path), "--help").stdout
    assert "--attnspec-backend" in help_text  # the plugin is loaded, under its own names


@pytest.mark.parametrize(
    "spelling",
    [
        ("--pyargs", "attnspec.conformance", "--backend", "numpy", "--conformance-cases"),
        ("--pyargs", "attnspec.conformance", "--attnspec-backend", "numpy", "--attnspec-cases"),
        (
            *("-p", "attnspec.conformance.pytest_plugin", "--pyargs", "attnspec.conformance"),
            *("--backend", "numpy", "--conformance-cases"),
        ),
    ],
)
def test_the_plugin_runs_the_cases_under_both_spellings(tmp_path, spelling):
    ran = run_pytest(str(tmp_path), *spelling, "fox/unit_gates/0", "-q")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "3 passed" in ran.stdout  # float64, float32, bfloat16 outputs (T = 1: no gradient)

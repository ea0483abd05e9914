"""``bench/gpu_check.sh --dry-run``: the GPU check's own script path on CPU (Triton interpreter,
tiny shapes, one timing repetition): the sections of the Triton FPA kernels, and the Pallas
section on its own (so the two run in parallel); the S4D section's dry run has its own test
(tests/test_triton_interdomain.py)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = ("fpa", "kit")  # the script's order


def test_gpu_check_dry_run(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    pytest.importorskip("fla")
    if importlib.util.find_spec("attnspec.backends.torch.kit") is None:
        pytest.skip("the kit adapter 'triton' comes with the torch backend (issue 9)")
    env = os.environ | {"PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run", "--sections", " ".join(SECTIONS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result.stdout.rstrip().endswith(summary["summary"][-1])  # the table comes last
    assert (tmp_path / "gpu_check.md").read_text().startswith("```")
    assert [(s["name"], s["exit"]) for s in summary["sections"]] == [(s, 0) for s in SECTIONS]

    kit = json.loads((tmp_path / "kit.json").read_text())
    assert {c["op"] for c in kit["cases"]} == {"fpa_attention", "fox_attention"}
    assert all(c["verdict"] == "passed" for c in kit["cases"])

    fpa = summary["fpa"]
    assert fpa["long_check_passed"] and fpa["dry_run"]
    assert fpa["failures"] == [] and fpa["compile_failures"] == [] and fpa["skipped"] == []
    impls = {(r["impl"], r["mode"]) for r in fpa["rows"]}
    assert impls == {(i, m) for i in ("FPA", "FoX", "fla", "SDPA") for m in ("fwd", "fwd+bwd")}
    assert all(r["ms"] > 0 for r in fpa["rows"])


def test_gpu_check_dry_run_of_the_pallas_section(tmp_path):
    pytest.importorskip("jax")
    env = os.environ | {"PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run", "--sections", "pallas"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "sections.txt").read_text().split()[:2] == ["pallas", "0"]
    pallas = json.loads((tmp_path / "pallas.json").read_text())
    assert {c["line"].split()[0] for c in pallas["checks"]} == {"fpa", "fox"}
    assert all(c["passed"] for c in pallas["checks"])
    assert {r["impl"] for r in pallas["timings"]} >= {"fpa pallas", "fox pallas"}
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in pallas["timings"])


def test_goals_are_judged_at_d128_long_sequences_and_failures_are_listed():
    """fpa_table: a slow row at T = 2048 or D = 64 misses no goal; one at D = 128, T = 8192
    does; a failed row and a failed compile are listed (a literal report, no GPU)."""
    sys.path.insert(0, str(ROOT))
    from bench import gpu_bench

    rows = []
    for D, T, fpa_ms in ((128, 2048, 9.0), (64, 8192, 9.0), (128, 8192, 1.5)):
        for impl, ms in (("FPA", fpa_ms), ("FoX", 1.0), ("fla", 1.0), ("SDPA", 0.5)):
            rows.append({"D": D, "T": T, "impl": impl, "mode": "fwd", "ms": ms, "tflops": 1.0})
    report = {
        "dtype": "bfloat16", "B": 1, "H": 16, "peer": "fla", "matmul_peak_tflops": 100.0,
        "dry_run": False, "rows": rows, "sweep": [],
        "failures": [{"D": 128, "T": 16384, "impl": "FPA", "mode": "fwd+bwd", "error": "OOM"}],
        "compile_failures": [{"variant": [False, "bfloat16"], "exit": 1}], "skipped": [],
    }  # fmt: skip
    lines = gpu_bench.fpa_table(report)
    assert "goal FPA fwd <= 1.2x fla: MISSED (worst 1.50)" in lines
    assert "goal FoX fwd <= 1.05x fla: met (worst 1.00)" in lines
    assert [m for m in lines if m.strip().startswith("missed:")] == [
        "  missed: FPA fwd D=128 T=8192: 1.50 > 1.2"
    ]
    assert any("FAILED FPA fwd+bwd D=128 T=16384: OOM" in m for m in lines)
    assert any("compile FAILED" in m for m in lines)

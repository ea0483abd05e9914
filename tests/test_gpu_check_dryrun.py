"""``bench/gpu_check.sh --dry-run``: the GPU check's own script path on CPU (Triton interpreter,
tiny shapes, one timing repetition): the sections of the Triton FPA kernels, and the Pallas
section on its own (so the two run in parallel); the S4D section's dry run has its own test
(tests/test_triton_interdomain.py).

The check as the GPU machine runs it (every default section, attnspec not installed, only the
image's packages and the carried wheels) runs in the matrix leg gpu-image (bench/matrix.py),
which sets GPU_IMAGE_PYTHON to that image's interpreter: test_gpu_check_dry_run_with_the_image.
"""

import collections
import contextlib
import importlib.util
import io
import itertools
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

    assert len("\n".join(summary["summary"])) < 4000
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


DEFAULT_SECTIONS = ("fpa", "kit", "s4d", "decode")  # the script's default, in its order
FILES = {"fpa": "fpa.json", "kit": "kit.json", "s4d": "s4d.json", "decode": "decode.json"}


def test_gpu_check_dry_run_with_the_image(tmp_path):
    """The default run under the GPU machine's Python (the matrix leg gpu-image: Python 3.12,
    torch 2.11, triton 3.6, jax 0.11.2, transformers 5.17, safetensors 0.8, numpy 2.5; no
    attnspec, no fla), with the wheels of `make wheels` in .whl/: every section exits 0 and
    writes its file into the one results folder, every ratio to a peer is there, and the
    summary (under 4,000 characters) comes last."""
    python = os.environ.get("GPU_IMAGE_PYTHON")
    if not python:
        pytest.skip("GPU_IMAGE_PYTHON names the image's interpreter (bench/matrix.py gpu-image)")
    assert list(ROOT.glob(".whl/fla_core-*.whl")), "make wheels first"
    for module, absent in (("attnspec", True), ("fla", True), ("torch", False)):
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True)
        assert (found.returncode != 0) == absent, module
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PYTHON": python, "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-4000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    text = "\n".join(summary["summary"])
    assert result.stdout.rstrip().endswith(text) and len(text) < 4000
    assert [(s["name"], s["exit"]) for s in summary["sections"]] == [
        (s, 0) for s in DEFAULT_SECTIONS
    ]
    assert all((tmp_path / FILES[s]).is_file() for s in DEFAULT_SECTIONS)
    assert "decode peer flash_attn kvcache: skipped, flash-attn not installed" in result.stdout
    have = {(r["section"], r["ours"], r["peer"], r.get("mode")) for r in summary["ratios"]}
    want = {("fpa", o, "fla parallel", m) for o in ("FPA", "FoX") for m in ("fwd", "fwd+bwd")}
    want |= {("decode", "fpa inf", p, None) for p in ("sdpa", "fla one-step")}
    want |= {("decode", "fpa inf compiled", "sdpa", None)}
    want |= {("s4d", "S4D", "chunk_gla", m) for m in ("fwd", "fwd+bwd")}
    assert want <= have, want - have
    assert all(r.get("time_ratio", r.get("speed_ratio", 0)) > 0 for r in summary["ratios"])


def test_the_summary_of_a_full_gpu_run_fits_4000_characters(tmp_path):
    """The summary at the GPU run's sizes (every row of fpa, the gpu decode grid with every
    peer and the trained layers, S4D's table, a kit with failures), from literal files: under
    4,000 characters, with every ratio counted."""
    pytest.importorskip("torch")  # (bench.decode imports it)
    sys.path.insert(0, str(ROOT))
    from bench import decode, gpu_bench, gpu_s4d

    versions = {"python": "3.12.9", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
                "fla": "0.6.0"}  # fmt: skip
    rows = [
        {"D": D, "T": T, "impl": i, "mode": m, "ms": 1.5, "tflops": 300.0}
        for D in (128, 64) for T in (2048, 8192, 16384) for i in gpu_bench.IMPLS
        for m in ("fwd", "fwd+bwd")
    ]  # fmt: skip
    fpa = {"device": "NVIDIA H200", "versions": versions, "dry_run": False, "dtype": "bfloat16",
           "B": 1, "H": 16, "peer": "parallel_forgetting_attn", "matmul_peak_tflops": 750.0,
           "long_check_passed": True, "compile_failures": [], "rows": rows,
           "failures": [{"D": 64, "T": 16384, "impl": "FoX", "mode": "fwd", "error": "x" * 300}],
           "skipped": [], "sweep": [{"D": 128, "T": 8192, "mode": m, "tiles": [128, 64, 8],
                                     "ms": 1.0} for m in ("fwd", "fwd+bwd")]}  # fmt: skip
    g = decode.GRIDS["gpu"]
    drows = []
    for B, T, (HQ, H), dt in itertools.product(g["B"], g["T"], g["gqa"], g["dtype"]):
        names = ["sdpa", "fpa inf", "fpa kept=0.25 indep", "fpa kept=0.25 shared",
                 "fpa inf compiled", *decode.PEERS]  # fmt: skip
        drows += [{"B": B, "T": T, "HQ": HQ, "H": H, "dtype": dt, "variant": n,
                   "speed_vs_sdpa": 0.9} for n in names]  # fmt: skip
        drows += [{"B": B, "T": T, "HQ": 2, "H": 2, "dtype": dt, "variant": n,
                   "speed_vs_sdpa": 1.1}
                  for n in ("sdpa", "fpa inf", "fpa trained L1 theta=16",
                            "fpa trained L2 theta=16")]  # fmt: skip
    dec = {"attention": "triton", "device": "NVIDIA H200", "rows": drows, "skipped": [{}] * 3,
           "peers_skipped": {}, "failures": [{"variant": "compiled", "B": 8, "T": 8192,
                                              "error": "y" * 300}]}  # fmt: skip
    s4d_rows = [
        {"T": T, "dv": dv, "mode": m, "ms": 2.0, "peer_ms": 1.0, "rows16_ms": 3.0}
        for T in (2048, 8192, 32768)
        for dv in (64, 128)
        for m in ("fwd", "fwd+bwd")
    ]
    s4d_summary = gpu_s4d.summary(s4d_rows, (2048, 8192, 32768), "bf16")
    s4d = {"check_passed": True, "rows": s4d_rows, "summary": s4d_summary}
    kit = {"backend": "triton", "device": "cuda (NVIDIA H200)", "seconds": 120.0,
           "summary": [{"op": f"op{i}", "dtype": d, "passed": 40, "failed": 1,
                        "not implemented": 0} for i in range(8)
                       for d in ("float32", "bfloat16", "float16")]}  # fmt: skip
    for name, report in (("fpa", fpa), ("decode", dec), ("s4d", s4d), ("kit", kit)):
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    (tmp_path / "sections.txt").write_text("fpa 0 150\nkit 1 120\ns4d 0 90\ndecode 0 100\n")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert gpu_bench.summary(str(tmp_path)) == 1
    text = printed.getvalue().rstrip()
    assert len(text) < 4000, len(text)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    counts = collections.Counter(r["section"] for r in data["ratios"])
    assert counts == {"fpa": 24, "decode": 18 * 4 + 9, "s4d": 12}  # (9: the trained groups)

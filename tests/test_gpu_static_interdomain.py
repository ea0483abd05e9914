"""The static Hopper gate of the Interdomain kernels (bench/gpu_static_interdomain.py): every
Triton kernel compiled for sm_90 as the launcher on an H100/H200 would launch it, with the
asserted budgets (no mma.sync, no spill, FLOPs and state bytes per token against chunk_gla);
and its FLOP and state-byte model checked against what each launch executes under the
interpreter."""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_static_interdomain  # noqa: E402

KERNELS = {
    "_s4d_state_pass",
    "_s4d_query",
    "_s4d_output",
    "_s4d_bwd_query",
    "_s4d_bwd_values",
    "_s4d_bwd_readout",
    "_s4d_reverse_state_pass",
    "_s4d_chunk_grads",
    "_s4d_bwd_inputs",
    "_s4d_step",
    "_legs_state_pass",
    *gpu_static_interdomain.LEGS_CHUNK,  # one name per binary
    "_legs_reverse_state_pass",
    "_legs_step",
}


def gate(*args: str, interpret: bool, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_static_interdomain", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_plan_model_equals_the_interpreter_counts(tmp_path, capsys):
    """FLOPs (2 m n k per tl.dot) and state bytes (masked loads and stores of the chunk states)
    of every launch (S4D both readouts at the Hopper blocks and the three tilings beside it:
    chunk-wide loop form, 16-row loop and lag forms; each S4D backward with the forward's saved
    tensors and recomputing them; LegS),
    counted by the interpreter, equal the model the gate's per-token table is built from. In
    this process when it interprets (tests/conftest.py's quicker interpreter), else in one."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        status, out = gpu_static_interdomain.check_plan(), capsys.readouterr().out
    else:
        run = gate("--check-plan", interpret=True, tmp_path=tmp_path)
        status, out = run.returncode, run.stdout + run.stderr
    assert status == 0, out[-4000:]
    rows = [line for line in out.splitlines() if line.endswith((" ok", "DIFFERS"))]
    assert len(rows) == 141 and all(r.endswith(" ok") for r in rows)


def test_hopper_gate(tmp_path):
    """Every Interdomain kernel compiles for sm_90 within the shared-memory limit, and the
    asserted budgets hold (the table and every budget's measured value are in the output)."""
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("fla")
    out = tmp_path / "gate.json"
    run = gate("--no-peer", "--no-variant", "--json", str(out), interpret=False, tmp_path=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = {r["kernel"]: r for r in report["rows"] if r["impl"] in ("S4D", "LegS")}
    assert set(rows) == KERNELS and not any(r["error"] for r in report["rows"])
    assert all(r["shared"] <= 232_448 for r in rows.values())
    # every S4D and LegS kernel runs on wgmma (64-row chunk programs; LegS's tables with the
    # heads as columns), every binary of each
    for name in (k for k in KERNELS if k != "_s4d_step"):
        assert rows[name]["hgmma"] > 0 and rows[name]["hmma"] == 0, name
    cost = report["per_token"]
    # state bytes (bf16 chunk states; S4D one read per chunk) of the chunk-wide tilings and of
    # LegS; the FLOPs of LegS, of the 16-row programs and of the S4D forward (the tokens as
    # columns skip the causal triangle's lags; S4D forward + backward: 2.21x, reported)
    for impl, p in itertools.product(("S4D", "S4D chunk-wide", "LegS"), ("fwd", "fwd+bwd")):
        got = cost[impl][p]["state_bytes"]
        assert got <= 2.0 * cost["chunk_gla"][p]["state_bytes"], (impl, p)
    for impl, p in [*itertools.product(("S4D 16-row", "LegS"), ("fwd", "fwd+bwd")), ("S4D", "fwd")]:
        assert cost[impl][p]["flops"] <= 2.0 * cost["chunk_gla"][p]["flops"], (impl, p)
    assert not any(r["stack"] for r in rows.values())  # no spill in the default tiling

"""The static Hopper gate of the paged decode kernel (bench/gpu_static_decode.py): compiled for
sm_90 at the launcher's tiles beside fla's attn_decoding_one_step, its budgets asserted, and the
decode benchmark's dry run (bench/decode.py --dry-run, the kernel interpreted)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_static_gate_of_the_decode_kernel(tmp_path):
    """Compiles, no spill in the key loop, bf16 dots on mma.sync, bytes per token per kv head
    at most fla's (the gate exits 1 otherwise)."""
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("fla")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    out = tmp_path / "gpu_static_decode.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu_static_decode", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["kernel"]: r for r in report["rows"]}
    ours = rows["_paged_decode_kernel"]
    assert ours["hmma"] > 0 and ours["loop"]["spills"] == 0 and ours["loop"]["mma"] > 0
    assert rows["_combine_kernel"]["loop"]["spills"] == 0
    bytes_ = report["bytes_per_token"]
    assert bytes_["ours"] < bytes_["fla"] and report["failures"] == []


def test_decode_section_of_the_gpu_check_dry_run(tmp_path):
    """``bench/gpu_check.sh --dry-run --sections decode``: bench/decode.py on tiny shapes with
    the decode kernel interpreted."""
    pytest.importorskip("triton")
    env = os.environ | {"PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run", "--sections", "decode"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "decode.json").read_text())
    assert report["grid"] == "dry" and report["attention"] == "triton"
    rows = report["rows"]
    # fla's one-step decode is a peer where flash-linear-attention is installed (its kernel
    # interpreted in the dry run); FlashAttention's needs CUDA
    peers = {"fla one-step"} if importlib.util.find_spec("fla") else set()
    assert {r["variant"] for r in rows} == {
        "sdpa", "fpa inf", "fpa inf compiled", "fpa kept=0.25 indep", "fpa kept=0.25 shared",
        "fpa trained L1 theta=16", "fpa trained L2 theta=16", *peers,
    }  # fmt: skip
    trained = [r for r in rows if "trained" in r["variant"]]
    assert {(r["HQ"], r["H"], r["d"]) for r in trained} == {(2, 2, 32)}  # E4's layer
    assert all(0 < r["kept"] < 1 for r in trained)  # theta = 16 evicts on its field
    for r in rows:  # pages within one page (16 tokens) of the stored entries
        assert r["tokens_per_s"] > 0 and r["paged"] <= r["stored"] + 16 / r["T"]

"""The static Hopper gate (bench/gpu_static.py, bench/sm90.py): the FPA/FoX Triton kernels
compiled for sm_90 as an H100/H200 launch would compile them, at D = 128 bf16 (the full sweep is
``python -m bench.gpu_static --full``), and the SASS reader on literal SASS."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from bench import sm90  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;  /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0030*/                   STL [R1], R4 ;
        /*0040*/                   FMNMX R5, R5, R6, PT ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   LDL R4, [R1] ;
        /*0070*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0080*/              @!P1 BRA 0x70 ;
        /*0090*/                   BRA 0x10 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
"""


def test_sass_loops_are_backward_branches():
    lines = [
        (int(m.group(1), 16), m.group(2)) for m in map(sm90._SASS.match, SASS.splitlines()) if m
    ]
    opcodes, loops = sm90.parse_sass(lines)
    assert opcodes["HGMMA"] == 1 and opcodes["HMMA"] == 1 and opcodes["BRA"] == 4
    spans = [(lp.start, lp.end, lp.instructions, lp.depth) for lp in loops]
    # 0x10..0x90 encloses 0x20..0x50 and 0x70..0x80; 0xb0 is the trap after EXIT.
    assert spans == [(0x10, 0x90, 9, 0), (0x20, 0x50, 4, 1), (0x70, 0x80, 2, 1), (0xB0, 0xB0, 1, 0)]
    inner = loops[1]
    assert (inner.opcodes["STL"], inner.opcodes["LDL"], inner.mma) == (1, 0, 1)
    report = sm90.Report("k", 0, 0, 0, len(lines), opcodes, loops)
    assert [lp.start for lp in sm90.mma_loops(report)] == [0x10]


def test_static_gate_sm90_d128_bf16(tmp_path):
    """Every FPA/FoX kernel at the launcher's Hopper tiles within the shared-memory limit, its
    dots on wgmma, the asserted budgets against fla's kernels met (the gate exits 1 otherwise):
    instructions per off-diagonal iteration, and no more spill instructions (STL + LDL) per
    visited row in any loop than fla's matching loop."""
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("fla")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    out = tmp_path / "gpu_static.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu_static", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["impl"], r["role"]): r for r in report["rows"]}
    for impl in ("FPA", "FoX"):
        for role in ("fwd", "dq", "dkv"):
            row = rows[impl, role]
            assert row["shared"] <= sm90.SHARED_LIMIT and row["hgmma"] > 0 and row["hmma"] == 0
            assert row["off"]["instructions"] > 0 and row["diag"]["instructions"] > 0
            peer = rows["fla", role]
            for loop in ("off", "diag"):  # the diagonal of dq and dk/dv steps BD rows
                step = row.get("BD", row["BS"]) if loop == "diag" else row["BS"]
                mine = (row[loop]["stl"] + row[loop]["ldl"]) * peer["BS"]
                theirs = (peer[loop]["stl"] + peer[loop]["ldl"]) * step
                assert mine <= theirs, (impl, role, loop, row[loop], peer[loop])
    assert {("fla", r) for r in ("fwd", "dq", "dkv")} <= rows.keys()
    assert report["failures"] == []

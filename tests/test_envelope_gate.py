"""The envelope (backends/envelope.py): the ops route the corners no Triton kernel serves to the
eager twin on CUDA (checked on fake CUDA tensors: no GPU needed), the docs print the table, and
the static gate (bench/gpu_static_envelope.py) compiles the kernels at its corners for sm_90:
the representative set here, every corner with ``ATTNSPEC_ENVELOPE_FULL=1`` (the Triton matrix
legs). The TTIR reader of the gate on literal TTIR."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from attnspec.backends import envelope
from attnspec.backends.torch import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_static_envelope as gate  # noqa: E402

FULL = os.environ.get("ATTNSPEC_ENVELOPE_FULL", "") not in ("", "0")


def _recorded(monkeypatch, name):
    """Replace the custom op ``name`` of ops.py by a recorder of the impl it is given."""
    seen = []

    def record(*args):
        seen.append(args[-2] if name != "_legs_fwd" else args[-1])
        q = args[0]
        if name == "_legs_fwd":
            return torch.empty_like(args[2])
        return q.new_empty(*q.shape[:3], args[2].shape[3]), q.new_empty(q.shape[:3])

    monkeypatch.setattr(ops, name, record)
    return seen


def _fpa(q_dtype, field_dtype, impl=None, D=8, cu=None):
    q = torch.empty(1, 32, 4, D, dtype=q_dtype, device="cuda")
    k = v = torch.empty(1, 32, 2, D, dtype=q_dtype, device="cuda")
    field = torch.empty(1, 32, 4, dtype=field_dtype, device="cuda")
    return ops.fpa_attention(q, k, v, field, field, cu_seqlens=cu, impl=impl)


@pytest.mark.parametrize(
    ("q_dtype", "field_dtype", "D", "want"),
    [
        (torch.bfloat16, torch.float32, 64, "triton"),
        (torch.float32, torch.float32, 256, "triton"),
        (torch.float64, torch.float64, 64, "eager"),  # defect 2
        (torch.bfloat16, torch.float64, 64, "eager"),  # defect 3
        (torch.float16, torch.float64, 64, "eager"),
        (torch.float32, torch.float64, 64, "eager"),
        (torch.bfloat16, torch.float32, 512, "eager"),  # wider than the kernels' 256
    ],
)
def test_fpa_routes_the_corners_no_kernel_serves_on_cuda(
    monkeypatch, q_dtype, field_dtype, D, want
):
    seen = _recorded(monkeypatch, "_fpa_fwd")
    with FakeTensorMode():
        _fpa(q_dtype, field_dtype, D=D)
    assert seen == [want]


def test_fox_routes_a_float64_gate_with_bf16_q_to_the_eager_twin(monkeypatch):
    seen = _recorded(monkeypatch, "_fox_fwd")
    with FakeTensorMode():
        for log_f in (torch.float32, torch.float64):
            q = torch.empty(1, 16, 2, 32, dtype=torch.bfloat16, device="cuda")
            g = torch.empty(1, 16, 2, dtype=log_f, device="cuda")
            ops.fox_attention(q, q, q, g)
    assert seen == ["triton", "eager"]


def test_an_explicit_triton_impl_at_an_eager_corner_names_impl(monkeypatch):
    _recorded(monkeypatch, "_fpa_fwd")
    with FakeTensorMode(), pytest.raises(ValueError, match=r"^impl: .*float64"):
        _fpa(torch.float64, torch.float64, impl="triton")


def test_legs_routes_more_packed_sequence_heads_than_its_grid_takes(monkeypatch):
    seen = _recorded(monkeypatch, "_legs_fwd")
    H = 64
    with FakeTensorMode():
        for N in (envelope.MAX_SEQUENCE_HEADS // H, envelope.MAX_SEQUENCE_HEADS // H + 1):
            x = torch.empty(1, N, H, 4, device="cuda")
            cu = torch.empty(N + 1, dtype=torch.int32, device="cuda")
            ops.interdomain_legs(x, x, x, M=4, cu_seqlens=cu)
    assert seen == ["triton", "eager"]


def test_the_cpu_and_the_interpreter_are_not_routed():
    """Off CUDA the envelope does not apply: the interpreter runs every corner."""
    x = torch.empty(1, 4, 2, 8, dtype=torch.float64)
    assert ops._served("fpa", "triton", "triton", x, torch.float64) == "triton"


def test_route_names_an_unknown_family():
    with pytest.raises(ValueError, match=r"^family: "):
        envelope.route("gla", "bfloat16")


def test_the_docs_print_the_table():
    page = (ROOT / "docs" / "api" / "envelope.md").read_text()
    assert envelope.markdown() in page


def test_every_defect_corner_of_the_gate_is_in_the_envelope():
    """Each defect of issue 55 (2-6) has a corner, and each corner routed to the eager twin
    matches an EAGER_ON_CUDA row (float64 q, or a float64 field with narrower q)."""
    assert {c.defect for c in gate.CORNERS} >= {2, 3, 4, 5, 6}
    for c in gate.CORNERS:
        impl, reason = gate.routed(c)
        assert (impl == "eager") == (c.family in ("fpa", "fox") and c.scalars == "fp64"), c
        assert (impl == "eager") == bool(reason)


TTIR = """
module {
  tt.func public @k(%o: !tt.ptr<bf16> loc("o"(#loc)), %n: i32 loc("n"(#loc))) attributes {} {
    %c = arith.constant dense<128> : tensor<64xi32> loc(#loc1)
    %pid = tt.get_program_id x : i32 loc(#loc2)
    %r = tt.make_range {end = 64 : i32, start = 0 : i32} : tensor<64xi32> loc(#loc3)
    %a = tt.splat %pid : i32 -> tensor<64xi32> loc(#loc4)
    %b = arith.muli %a, %c : tensor<64xi32> loc(#loc4)
    %p = tt.splat %o : !tt.ptr<bf16> -> tensor<64x!tt.ptr<bf16>> loc(#loc5)
    %p_1 = tt.addptr %p, %b : tensor<64x!tt.ptr<bf16>>, tensor<64xi32> loc(#loc5)
    %p_2 = tt.addptr %p, %r : tensor<64x!tt.ptr<bf16>>, tensor<64xi32> loc(#loc5)
    %m = arith.muli %pid, %n : i32 loc(#loc6)
    %w = arith.extsi %m : i32 to i64 loc(#loc6)
    %p_3 = tt.addptr %o, %w : !tt.ptr<bf16>, i64 loc(#loc6)
    %x = arith.extsi %pid : i32 to i64 loc(#loc7)
    %y = arith.extsi %n : i32 to i64 loc(#loc7)
    %z = arith.muli %x, %y : i64 loc(#loc7)
    %p_4 = tt.addptr %o, %z : !tt.ptr<bf16>, i64 loc(#loc7)
    %p_5 = tt.addptr %p_4, %m : !tt.ptr<bf16>, i32 loc(#loc7)
    tt.return loc(#loc)
  } loc(#loc)
}
"""


def test_the_ttir_reader_finds_32_bit_offsets_of_large_tensors():
    """A 32-bit runtime offset on the bare argument (p_1) and a 64-bit offset of a 32-bit
    product of two runtime values (p_3) are found; a range (p_2), a 64-bit product (p_4) and an
    offset of an offset pointer (p_5) are not; nothing for a tensor that cannot pass 2^31."""
    found = gate.offsets_32bit(TTIR, {"o"})
    assert [f.split(": ", 2)[:2] for f in found] == [
        ["o", "32-bit offset"],
        ["o", "64-bit offset of a 32-bit product"],
    ]
    assert "%p_1 " in found[0] and "%p_3 " in found[1]
    assert gate.offsets_32bit(TTIR, set()) == []


def test_static_envelope_gate_sm90(tmp_path):
    """Every corner of the set compiles for sm_90 within 232,448 B of shared memory, its grids
    within CUDA's limits, no 32-bit offset on a tensor that can pass 2^31 elements; the corners
    routed to the eager twin compile nothing (the gate exits 1 otherwise)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    out = tmp_path / "envelope.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu_static_envelope", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["corner"]: r for r in report["rows"]}
    assert report["full"] == FULL
    want = {c.name for c in gate.CORNERS if FULL or c.ci is not None}
    assert set(rows) == want
    assert {rows[n]["defect"] for n in want} >= {2, 3, 4, 5, 6}
    for name, row in rows.items():
        assert row["failures"] == [], name
        if row["impl"] == "eager":
            assert row["kernels"] == [] and row["reason"], name
            continue
        corner = next(c for c in gate.CORNERS if c.name == name)
        launched = {k["kernel"] for k in row["kernels"]}
        compiled = [k for k in row["kernels"] if "shared" in k]
        want_compiled = launched if FULL else launched & set(corner.ci or ())
        assert {k["kernel"] for k in compiled} == want_compiled, name
        assert all(k["offsets_32bit"] == 0 for k in compiled), name

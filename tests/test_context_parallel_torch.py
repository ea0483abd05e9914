"""Context parallelism on torch.distributed (gloo processes on this machine): the kit's sharded
cases on 2 and 4 ranks against the float64 reference, the shipped wrong sharded implementations
caught, and bad input refused on every rank without a hang.

Each group of checks is one launch of processes (bounded by a timeout), so the whole file costs
three launches.
"""

import json
import os

import numpy as np
import pytest
import torch

from attnspec.backends.torch import context_parallel as cp
from attnspec.backends.torch.context_parallel_kit import KitBackend
from attnspec.backends.torch.context_parallel_launch import spawn
from attnspec.backends.torch.context_parallel_mutants import CAUGHT_BY, MUTANTS
from attnspec.conformance import context_parallel as kit

TIMEOUT = 240.0  # seconds per launch: a deadlock fails the test instead of hanging it


def test_sharded_ops_on_two_ranks_equal_the_reference():
    jobs, refs, _ = kit.prepare(2, kit.DTYPES, kit.CP_OPS, KitBackend().capabilities())
    results = kit.judge(jobs, KitBackend(timeout=TIMEOUT).run_sharded(jobs, 2), refs, 2)
    _check_all_passed(results, 2)


def test_four_ranks_equal_the_reference_and_the_kit_catches_wrong_shardings():
    """The cases on 4 ranks under the correct sharding, and each wrong sharding on the float64
    cases of the op it breaks plus the length-1 shards of every op, in one launch (one test, so
    that parallel test workers launch it once)."""
    jobs, refs, _ = kit.prepare(4, kit.DTYPES, kit.CP_OPS, KitBackend().capabilities())
    variants = {"correct": (cp.DEFAULT, jobs)}
    picked = {}
    for name, sharding in MUTANTS.items():
        op, world = CAUGHT_BY[name]
        assert world <= 4
        picked[name] = [
            n
            for n, job in enumerate(jobs)
            if job.dtype == "float64" and (job.op == op or "shard-length-1" in job.case_id)
        ]
        variants[name] = (sharding, [jobs[n] for n in picked[name]])
    got = KitBackend(timeout=TIMEOUT).run_variants(4, variants)
    _check_all_passed(kit.judge(jobs, got["correct"], refs, 4), 4)
    for name, chosen in picked.items():
        op, _ = CAUGHT_BY[name]
        results = kit.judge([jobs[n] for n in chosen], got[name], [refs[n] for n in chosen], 4)
        caught = [r for r in results if r.op == op and r.verdict == "failed"]
        assert caught, f"{name}: every {op} case passed"
        # the mistake is specific: the other ops stay correct
        others = [r for r in results if r.op != op]
        assert others and all(r.verdict == "passed" for r in others), (name, others)


def _check_all_passed(results, world):
    bad = [(r.case_id, r.dtype, r.message) for r in results if r.verdict != "passed"]
    assert not bad, bad
    assert {r.op for r in results} == set(kit.CP_OPS)
    assert {r.dtype for r in results} == {"float64", "float32"}
    assert len(results) == sum(len(c.dtypes or kit.DTYPES) for c in kit.cases(world))


# bad input


def _inputs(T, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, 2, 4, generator=g, dtype=dtype)
    k = torch.randn(1, T, 2, 4, generator=g, dtype=dtype)
    v = torch.randn(1, T, 2, 3, generator=g, dtype=dtype)
    field = torch.randn(1, T, 2, generator=g, dtype=torch.float64).cumsum(1)
    return q, k, v, field, field + 0.5


def _bad_input_worker(rank, world, path):
    """Each scenario must raise the same ValueError on every rank; after it the group must
    still work (an all-reduce), which shows no rank was left waiting."""
    scenarios = {
        "unequal shards": lambda: cp.fpa_attention(*_inputs(4 if rank == 0 else 3)),
        "dtype across ranks": lambda: cp.fpa_attention(
            *_inputs(4, torch.float64 if rank == 0 else torch.float32)
        ),
        "cu_seqlens across ranks": lambda: cp.fpa_attention(
            *_inputs(4), cu_seqlens=(0, 3 + rank, 8)
        ),
        "cu_seqlens not the gathered sequence": lambda: cp.fpa_attention(
            *_inputs(4), cu_seqlens=torch.tensor([0, 2, 4])
        ),
        "nan on one rank": lambda: cp.fpa_attention(
            *[x * (np.nan if rank == 1 and x.dim() == 3 else 1.0) for x in _inputs(4)]
        ),
        "positive gate on one rank": lambda: cp.fox_attention(
            *_inputs(4)[:3], torch.full((1, 4, 2), 0.1 if rank == 1 else -0.1)
        ),
        "zigzag with an odd shard": lambda: cp.fpa_attention(*_inputs(3), layout="zigzag"),
        "world size does not divide T": lambda: cp.shard_sequence(
            torch.zeros(1, 7, 2), rank, world
        ),
        "unknown layout": lambda: cp.fox_attention(
            *_inputs(4)[:3], -torch.ones(1, 4, 2), layout="ring"
        ),
        "s4d features of unequal length": lambda: cp.interdomain_s4d(
            torch.randn(1, 4 + rank, 2, 3),
            torch.randn(1, 4 + rank, 2, 3),
            torch.randn(1, 4 + rank, 2, 2),
            torch.full((2, 4), 0.5 + 0.1j),
            torch.ones(2, 4, dtype=torch.complex64),
            torch.ones(2, 4, 4, dtype=torch.complex64),
        ),
    }
    record = {}
    for name, fn in scenarios.items():
        try:
            fn()
            record[name] = "no error"
        except ValueError as exc:
            record[name] = str(exc)
        ok = torch.ones(1)
        torch.distributed.all_reduce(ok)
        assert ok.item() == world
    with open(os.path.join(path, f"rank{rank}.json"), "w") as fh:
        json.dump(record, fh)


EXPECTED = {
    "unequal shards": "T: every rank must hold a shard of the same length",
    "dtype across ranks": "q: must agree across ranks",
    "cu_seqlens across ranks": "cu_seqlens: must agree across ranks",
    "cu_seqlens not the gathered sequence": "cu_seqlens: expected global offsets from 0 to",
    "nan on one rank": "rank 1: field: contains NaN",
    "positive gate on one rank": "rank 1: log_f: expected log forget gates <= 0",
    "zigzag with an odd shard": "q: a zigzag shard holds two chunks",
    "world size does not divide T": "x: the sequence length T = 7 must be divisible",
    "unknown layout": "layout: expected one of",
    "s4d features of unequal length": "T: every rank must hold a shard of the same length",
}


def test_bad_input_raises_the_same_error_on_every_rank(tmp_path):
    spawn(_bad_input_worker, 2, str(tmp_path), timeout=TIMEOUT)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert records[0] == records[1]  # the same message on every rank
    for name, expected in EXPECTED.items():
        assert expected in records[0][name], (name, records[0][name])


def test_spawn_kills_a_hung_launch():
    with pytest.raises(TimeoutError, match="still running"):
        spawn(_hung_worker, 2, timeout=5.0)


def _hung_worker(rank, world):
    import time

    time.sleep(120)  # as a rank waiting for a peer that never comes


def test_shard_and_unshard_are_inverse():
    x = torch.arange(2 * 16 * 3).reshape(2, 16, 3)
    for layout in cp.LAYOUTS:
        parts = [cp.shard_sequence(x, r, 4, layout=layout) for r in range(4)]
        assert torch.equal(cp.unshard_sequence(parts, layout=layout), x)
    zig = [cp.shard_sequence(x, r, 4, layout="zigzag")[0, :, 0] // 3 for r in range(4)]
    assert zig[0].tolist() == [0, 1, 14, 15]  # chunks 0 and 7 of 8 (length 2)


def test_the_triton_kernels_underneath_under_the_interpreter(monkeypatch):
    """impl="triton": the diagonal chunk on the Triton kernels (run by the Triton interpreter
    on CPU; the children inherit TRITON_INTERPRET), the cross-chunk tiles as with eager."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    picked = {("fpa/cp/varlen/P2", "float32"), ("fox/cp/zigzag/P2", "float32")}
    jobs, refs, _ = kit.prepare(2, ("float32",), kit.CP_OPS, KitBackend().capabilities())
    chosen = [n for n, job in enumerate(jobs) if (job.case_id, job.dtype) in picked]
    jobs, refs = [jobs[n] for n in chosen], [refs[n] for n in chosen]
    got = KitBackend(timeout=TIMEOUT, impl="triton").run_sharded(jobs, 2)
    results = kit.judge(jobs, got, refs, 2)
    assert len(results) == 2
    assert all(r.verdict == "passed" for r in results), [(r.case_id, r.message) for r in results]


def _triton_worker(rank, world, path):
    """impl="triton" against impl="eager" on a batch of two rows with bfloat16 gates, zigzag
    (two chunks per rank): the op widens the gates (as the single-device op does) and hands the
    kernels contiguous chunks."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 8, 2, 4, generator=g) for _ in range(3))
    field = torch.randn(2, 8, 2, generator=g).cumsum(1).bfloat16()
    log_f = -torch.rand(2, 8, 2, generator=g).bfloat16()
    errors = {}
    for name, op, gates in (
        ("fpa", cp.fpa_attention, (field, field + 0.5)),
        ("fox", cp.fox_attention, (log_f,)),
    ):
        got = {}
        for impl in ("triton", "eager"):
            leaves = [
                cp.shard_sequence(x, rank, world, layout="zigzag").clone().requires_grad_()
                for x in (q, k, v, *gates)
            ]
            o = op(*leaves, layout="zigzag", impl=impl)
            o.backward(torch.ones_like(o))
            got[impl] = [o.detach(), *(x.grad.float() for x in leaves)]
        errors[name] = max(
            float((a - b).norm() / b.norm()) for a, b in zip(*got.values(), strict=True)
        )
    with open(os.path.join(path, f"rank{rank}.json"), "w") as fh:
        json.dump(errors, fh)


def test_the_triton_kernels_take_a_batch_and_half_precision_gates(monkeypatch, tmp_path):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawn(_triton_worker, 2, str(tmp_path), timeout=TIMEOUT)
    for r in range(2):
        errors = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert max(errors.values()) < 1e-4, (r, errors)

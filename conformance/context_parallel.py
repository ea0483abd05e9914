"""The kit's context-parallel capability: a sharded implementation checked against the reference.

A backend that shards the sequence claims ``"<op>.context_parallel"`` (for fpa_attention,
fox_attention, interdomain_s4d) and provides

    run_sharded(jobs: list[Job], world: int) -> list[JobResult]

which runs every job with the sequence split over ``world`` ranks (processes, devices) in the
job's ``layout`` and returns the FULL outputs and input gradients, gathered from the ranks, in
the canonical layout (B, H, T, ...) as NumPy arrays. Replicated inputs (the S4D parameters)
return the sum of the ranks' gradient shares. One call runs many jobs, so a backend starts its
processes once per world size.

The cases put shard borders on ties, plateaus and the field's global minimum (also inside an
intermediate shard, which only the gap term of (CP1) sees), on packed-sequence starts, and use
shards of length 1; each output and gradient is compared with the float64 reference at the
kit's tolerances. ``python -m attnspec.conformance.context_parallel BACKEND`` runs it from the
command line; :func:`run` from Python.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from attnspec.reference import hippo
from attnspec.reference import interdomain as idm

from .cases import case_seed
from .metrics import compare, gradient_floors, row_ndim
from .numpy_backend import NumpyBackend
from .protocol import OPS, call_op
from .runner import CaseResult
from .tolerances import round_to, tolerance, wide_dtype

CP_OPS = ("fpa_attention", "fox_attention", "interdomain_s4d")
WORLDS = (2, 4)
FULL_WORLDS = (2, 3, 4)
DTYPES = ("float64", "float32")
REFERENCE = NumpyBackend()

Arrays = dict[str, NDArray[np.float64]]


@dataclass
class Job:
    """One sharded run: inputs rounded to ``dtype`` (wide inputs to float32 or wider), params
    as for the op, cotangents of the differentiable outputs, and the shard layout."""

    case_id: str
    op: str
    dtype: str
    layout: str
    inputs: Arrays
    params: dict[str, Any]
    cotangents: Arrays


@dataclass
class JobResult:
    """Full outputs and input gradients (canonical layout), or the error message."""

    outputs: Arrays = field(default_factory=dict)
    grads: Arrays = field(default_factory=dict)
    error: str = ""


class ContextParallelBackend(Protocol):
    @property
    def name(self) -> str: ...

    def capabilities(self) -> set[str]: ...

    def run_sharded(self, jobs: list[Job], world: int) -> list[JobResult]: ...


# Cases


@dataclass(frozen=True)
class CPCase:
    case_id: str
    op: str
    layout: str
    inputs: Arrays
    params: dict[str, Any]
    dtypes: tuple[str, ...] = ()  # the dtypes it runs in (empty: every dtype of the run)


def _walk(rng: np.random.Generator, shape: tuple[int, ...]) -> NDArray[np.float64]:
    return np.cumsum(rng.integers(-1, 2, size=shape), axis=-1).astype(float)


def _fpa(
    rng: np.random.Generator,
    B: int,
    H: int,
    T: int,
    field_: NDArray[np.float64],
    H_kv: int | None = None,
) -> Arrays:
    q = rng.standard_normal((B, H, T, 8))
    k = rng.standard_normal((B, H_kv or H, T, 8))
    v = rng.standard_normal((B, H_kv or H, T, 4))
    level = field_ + rng.choice([0.0, 1.0, 2.5], size=field_.shape)  # on ties and above them
    return {"q": q, "k": k, "v": v, "field": field_, "level": level}


def _fox(
    rng: np.random.Generator, B: int, H: int, T: int, unit: float, H_kv: int | None = None
) -> Arrays:
    log_f = -rng.exponential(0.5, (B, H, T))
    log_f[rng.random(log_f.shape) < unit] = 0.0  # gates f = 1: ties of the walk
    return {
        "q": rng.standard_normal((B, H, T, 8)),
        "k": rng.standard_normal((B, H_kv or H, T, 8)),
        "v": rng.standard_normal((B, H_kv or H, T, 4)),
        "log_f": log_f,
    }


def _s4d(rng: np.random.Generator, B: int, H: int, T: int, readout: str = "linear") -> Arrays:
    M, R, dv = 4, 4, 3
    a_log, a_im = hippo.s4d_init(M)
    lam = idm.s4d_lambda(
        np.log(rng.uniform(0.01, 0.3, H)), np.tile(a_log, (H, 1)), np.tile(a_im, (H, 1))
    )
    b = rng.standard_normal((H, M)) + 1j * rng.standard_normal((H, M))
    c = (rng.standard_normal((H, M, M)) + 1j * rng.standard_normal((H, M, M))) / np.sqrt(2 * M)
    if readout == "ratio":
        fq, kt, b = (np.abs(rng.standard_normal((2, B, H, T, R))) + 0.1), None, np.abs(b)
        fq, kt = fq[0], fq[1]
        c = np.eye(M) + 0.1 * c
    else:
        fq, kt = rng.standard_normal((2, B, H, T, R))
    return {
        "fq": fq,
        "kt": kt,
        "vt": rng.standard_normal((B, H, T, dv)),
        "lam_re": lam.real,
        "lam_im": lam.imag,
        "b_re": b.real,
        "b_im": b.imag,
        "c_re": c.real,
        "c_im": c.imag,
    }


def cases(world: int) -> list[CPCase]:
    """The cases for ``world`` ranks: T = 4 * world (chunks of 4, or 2 in zigzag) unless said."""
    rng = np.random.default_rng(2400 + world)
    T = 4 * world
    L = T // world
    out: list[CPCase] = []

    def add(
        case_id: str,
        op: str,
        inputs: Arrays,
        layout: str = "contiguous",
        dtypes: tuple[str, ...] = (),
        **params: Any,
    ) -> None:
        name = f"{op.split('_')[0]}/cp/{case_id}/P{world}"
        out.append(CPCase(name, op, layout, inputs, params, dtypes))

    add("walk", "fpa_attention", _fpa(rng, 2, 2, T, _walk(rng, (2, 2, T))))
    plateau = np.zeros((1, 2, T))
    plateau[..., L - 1 : L + 1] = -1.0  # a tie on either side of the first border
    add("plateau-ties", "fpa_attention", _fpa(rng, 1, 2, T, plateau))
    deep = rng.uniform(0, 1, (1, 2, T))
    deep[..., L + L // 2] = -4.0  # the global minimum inside shard 1: between shards 0 and 2+
    deep[..., 2 * L - 1] = -4.0  # and tied on its right border
    add("global-min-between", "fpa_attention", _fpa(rng, 1, 2, T, deep))
    add("zigzag", "fpa_attention", _fpa(rng, 1, 2, T, _walk(rng, (1, 2, T))), "zigzag")
    add("gqa", "fpa_attention", _fpa(rng, 1, 4, T, _walk(rng, (1, 4, T)), H_kv=2))
    offsets = (0, L, L + 1, 2 * L - 1, T) if world > 1 else (0, T)  # starts on a border, and a
    add(
        "varlen",
        "fpa_attention",
        _fpa(rng, 1, 2, T, _walk(rng, (1, 2, T))),  # length-1 tail
        cu_seqlens=tuple(sorted(set(offsets))),
    )
    # a zero-length sequence on the first shard border (reference/packing.py: contributes nothing)
    with_empty = tuple(sorted((*set(offsets), L)))
    add(
        "zigzag-varlen",
        "fpa_attention",
        _fpa(rng, 1, 2, T, _walk(rng, (1, 2, T))),
        "zigzag",
        cu_seqlens=with_empty,
    )
    one = world  # shards of length 1
    add("shard-length-1", "fpa_attention", _fpa(rng, 1, 2, one, _walk(rng, (1, 2, one))))

    add("gates", "fox_attention", _fox(rng, 2, 2, T, 0.0))
    add("unit-gates", "fox_attention", _fox(rng, 1, 2, T, 0.5))
    add("zigzag", "fox_attention", _fox(rng, 1, 2, T, 0.2), "zigzag")
    add(
        "gqa-varlen",
        "fox_attention",
        _fox(rng, 1, 4, T, 0.2, H_kv=2),
        cu_seqlens=tuple(sorted(set(offsets))),
    )
    add("shard-length-1", "fox_attention", _fox(rng, 1, 2, one, 0.0))

    add("linear", "interdomain_s4d", _s4d(rng, 2, 2, T), readout="linear")
    add("ratio", "interdomain_s4d", _s4d(rng, 1, 2, T, "ratio"), readout="ratio")
    add(
        "varlen",
        "interdomain_s4d",
        _s4d(rng, 1, 2, T),
        readout="linear",
        cu_seqlens=with_empty,
    )
    add("shard-length-1", "interdomain_s4d", _s4d(rng, 1, 2, one), readout="linear")
    # logits in the hundreds, drawn where a merge of the partials by weights exp(lse_b - lse)
    # from float32 lse failed the float32 dq (kit ratio 9.4 on 2 ranks, 2.3 on 4; the
    # single-device op 0.07 and 0.07): o must stay the convex combination of the partials. In
    # float64 only: near-one-hot rows put the single-device op's own float64 error past 1e-12.
    big = np.random.default_rng({2: 14, 4: 8}.get(world, 14))
    add("large-logits", "fox_attention", _fox(big, 1, 2, T, 0.2), dtypes=("float32",), scale=40.0)
    add("large-logits", "fpa_attention", _fpa(big, 1, 2, T, _walk(big, (1, 2, T))), scale=40.0)
    return out


# Shards at the sizes context parallelism runs at: every rank's shard (every zigzag chunk) spans
# two query blocks of the cross-chunk tiles (CONTEXT_PARALLEL_QUERY_BLOCK = 128) and a ragged
# third, and several S4D chunks (64); the heavy part of the check (``full``).
REAL_CHUNK = 132


def _real_offsets(world: int, S: int) -> tuple[int, ...]:
    """cu_seqlens with a start inside every shard of length S, one on a shard border, several
    sequences in shard 0 (a length-1 one among them)."""
    starts = {0, 5, 6, 70, S - 1}  # lengths 5, 1, 64, ... inside shard 0
    for r in range(1, world):
        starts.add(r * S + (37 * r) % (S - 1) + 1)  # a start inside shard r
    if world > 2:
        starts.add(2 * S)  # a start on a border
    return tuple(sorted(starts | {world * S}))


def real_cases(world: int) -> list[CPCase]:
    """The cases at the real shape for ``world`` ranks: shard length 2 * REAL_CHUNK (264, two
    query blocks and a ragged tail), packed sequences with starts in every shard and several in
    one shard, logits in the hundreds, both layouts; S4D's entering state across shards of
    several chunks with both readouts and packings."""
    rng = np.random.default_rng(2500 + world)
    S = 2 * REAL_CHUNK
    T = S * world
    offsets = _real_offsets(world, S)
    out: list[CPCase] = []

    def add(
        case_id: str, op: str, inputs: Arrays, layout: str = "contiguous", **params: Any
    ) -> None:
        out.append(
            CPCase(f"{op.split('_')[0]}/cp-real/{case_id}/P{world}", op, layout, inputs, params)
        )

    for layout in ("contiguous", "zigzag"):
        add(f"walk-{layout}", "fpa_attention", _fpa(rng, 1, 2, T, _walk(rng, (1, 2, T))), layout)
        add(
            f"varlen-large-{layout}",
            "fpa_attention",
            _fpa(rng, 1, 4, T, _walk(rng, (1, 4, T)), H_kv=2),
            layout,
            cu_seqlens=offsets,
            scale=40.0,
        )
        add(f"gates-{layout}", "fox_attention", _fox(rng, 1, 2, T, 0.1), layout)
        add(
            f"varlen-large-{layout}",
            "fox_attention",
            _fox(rng, 1, 4, T, 0.1, H_kv=2),
            layout,
            cu_seqlens=offsets,
            scale=40.0,
        )
    add("linear", "interdomain_s4d", _s4d(rng, 1, 2, T), readout="linear")
    add(
        "varlen-ratio",
        "interdomain_s4d",
        _s4d(rng, 1, 2, T, "ratio"),
        readout="ratio",
        cu_seqlens=offsets,
    )
    return out


def _job(case: CPCase, dtype: str) -> tuple[Job, Arrays, Arrays]:
    """The job of ``case`` at ``dtype`` with the reference's outputs and gradients on the same
    rounded inputs and cotangents."""
    spec = OPS[case.op]
    inputs = {
        n: round_to(x, wide_dtype(dtype) if n in spec.wide else dtype)
        for n, x in case.inputs.items()
    }
    ref_out = {
        k: np.asarray(v, np.float64)
        for k, v in call_op(REFERENCE, case.op, inputs, case.params).items()
    }
    rng = np.random.default_rng(case_seed(case.case_id))
    cot = {n: round_to(rng.standard_normal(ref_out[n].shape), dtype) for n in spec.cotangents}
    ref_grads = {
        k: np.asarray(v, np.float64)
        for k, v in REFERENCE.vjp(case.op, inputs, case.params, cot).items()
    }
    return (
        Job(case.case_id, case.op, dtype, case.layout, inputs, dict(case.params), cot),
        ref_out,
        ref_grads,
    )


def _verdict(
    job: Job, result: JobResult, ref_out: Arrays, ref_grads: Arrays, world: int
) -> CaseResult:
    base: dict[str, Any] = dict(
        case_id=job.case_id, op=job.op, dtype=job.dtype, kind="context_parallel"
    )
    if result.error:
        return CaseResult(**base, verdict="failed", message=result.error[-2000:])
    worst, message, ratio = 0.0, "", 0.0
    floors = gradient_floors(ref_grads)
    for kind, got, ref in (
        ("output", result.outputs, ref_out),
        ("gradient", result.grads, ref_grads),
    ):
        for name, want in ref.items():
            quantity = "lse" if name == "lse" else kind
            tol = tolerance(job.op, job.dtype, quantity)
            if name not in got:
                return CaseResult(**base, verdict="failed", message=f"{name}: not returned")
            floor = floors.get(name, 0.0) if kind == "gradient" else 0.0
            cmp = compare(got[name], want, tol, row_ndim=row_ndim(name), floor=floor)
            r = cmp.rel / tol if tol else (0.0 if cmp.rel == 0 else np.inf)
            if not cmp.passed:
                return CaseResult(
                    **base,
                    verdict="failed",
                    error=cmp.rel,
                    tolerance=tol,
                    ratio=r,
                    message=f"{name}: {cmp.describe()} (P = {world}, {job.layout})",
                )
            if r >= ratio:
                worst, ratio, message = cmp.rel, r, f"worst {name}"
    return CaseResult(**base, verdict="passed", error=worst, ratio=ratio, message=message)


def prepare(
    world: int,
    dtypes: Sequence[str],
    ops: Sequence[str],
    claimed: set[str],
    *,
    real: bool = False,
) -> tuple[list[Job], list[tuple[Arrays, Arrays]], list[CaseResult]]:
    """The jobs of the claimed ops at ``world`` ranks with their reference (outputs, gradients),
    and a "not implemented" result for each case of an op not claimed; ``real``: the
    :func:`real_cases` too."""
    jobs, refs, missing = [], [], []
    for case in cases(world) + (real_cases(world) if real else []):
        if case.op not in ops:
            continue
        for dtype in dtypes:
            if case.dtypes and dtype not in case.dtypes:
                continue
            if f"{case.op}.context_parallel" not in claimed:
                missing.append(
                    CaseResult(case.case_id, case.op, dtype, "context_parallel", "not implemented")
                )
                continue
            job, ref_out, ref_grads = _job(case, dtype)
            jobs.append(job)
            refs.append((ref_out, ref_grads))
    return jobs, refs, missing


def judge(
    jobs: Sequence[Job], got: Sequence[JobResult], refs: Sequence[tuple[Arrays, Arrays]], world: int
) -> list[CaseResult]:
    """The verdict of each job's result against its reference."""
    return [
        _verdict(job, res, ref_out, ref_grads, world)
        for job, res, (ref_out, ref_grads) in zip(jobs, got, refs, strict=True)
    ]


def run(
    backend: ContextParallelBackend,
    *,
    worlds: Sequence[int] = WORLDS,
    dtypes: Sequence[str] = DTYPES,
    ops: Sequence[str] = CP_OPS,
    full: bool = False,
) -> list[CaseResult]:
    """Every context-parallel case of the ops the backend claims, at each world size and dtype;
    ops it does not claim are reported "not implemented". ``full``: the real-shape cases
    (:func:`real_cases`) too, and 3 ranks added to the default worlds."""
    results: list[CaseResult] = []
    if full and tuple(worlds) == WORLDS:
        worlds = FULL_WORLDS
    for world in worlds:
        jobs, refs, missing = prepare(world, dtypes, ops, backend.capabilities(), real=full)
        results += missing
        if not jobs:
            continue
        try:
            got = backend.run_sharded(jobs, world)
        except Exception as exc:  # a crash or a timeout fails every job of this world size
            got = [JobResult(error=f"{type(exc).__name__}: {exc}") for _ in jobs]
        results += judge(jobs, got, refs, world)
    return results


def summary(results: Sequence[CaseResult]) -> str:
    lines = [f"{r.case_id:<40} {r.dtype:<8} {r.verdict:<16} {r.message[:100]}" for r in results]
    passed = sum(r.verdict == "passed" for r in results)
    lines.append(f"{passed} passed, {len(results) - passed} not passed")
    return "\n".join(lines)


def load_backend(name: str) -> ContextParallelBackend:
    """ "torch" (gloo processes) or "jax" (forced host devices), or ``module:attribute``."""
    from .registry import get_context_parallel_backend

    backend: ContextParallelBackend = get_context_parallel_backend(name)
    return backend


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnspec.conformance.context_parallel")
    parser.add_argument("backend", help="torch, jax, or module:attribute of a backend object")
    parser.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--ops", nargs="+", default=list(CP_OPS), choices=CP_OPS)
    parser.add_argument(
        "--full", action="store_true", help="the real-shape cases too, and 3 ranks by default"
    )
    args = parser.parse_args(argv)
    results = run(
        load_backend(args.backend),
        worlds=args.worlds,
        dtypes=args.dtypes,
        ops=args.ops,
        full=args.full,
    )
    print(summary(results))
    return 0 if all(r.verdict == "passed" for r in results) else 1


if __name__ == "__main__":
    # Run with -m, this file is the module __main__ and its jobs would pickle as __main__.Job,
    # which a backend's child process cannot load: run the imported module's main instead.
    from attnspec.conformance.context_parallel import main as _main

    sys.exit(_main())

"""Run conformance cases against a backend; every outcome becomes a :class:`CaseResult`.

Nothing a backend does can crash the runner: exceptions, wrong shapes or dtypes and missing ops
are reported per case with the message, and the verdict is failed (or "not implemented" when the
backend does not claim the op).
"""

from __future__ import annotations

import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from attnspec.backends.numpy_backend import NumpyBackend

from .cases import Case
from .gradcheck import directional_check
from .metrics import Comparison, compare
from .protocol import OPS, call_op
from .skips import SkipList
from .tolerances import round_to, tolerance, wide_dtype

KINDS = ("output", "gradient", "finite_difference")
REFERENCE = NumpyBackend()


@dataclass
class CaseResult:
    """The verdict of one (case, dtype, kind)."""

    case_id: str
    op: str
    dtype: str
    kind: str
    verdict: str  # passed | failed | not implemented | skipped
    error: float = float("nan")  # normwise relative error of the worst-placed quantity
    tolerance: float = float("nan")
    ratio: float = float("nan")  # worst error / tolerance over the compared quantities
    message: str = ""
    repro: str = ""
    seed: int = 0
    shapes: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def reference_outputs(case: Case, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 reference on (rounded) inputs, as NumPy arrays by output name."""
    outs = call_op(REFERENCE, case.op, inputs, case.params)
    return {k: np.asarray(v, dtype=np.float64) for k, v in outs.items()}


def rounded_inputs(case: Case, dtype: str) -> dict[str, np.ndarray]:
    """Inputs rounded to the tested dtype (wide inputs to float32 or wider), as float64."""
    spec = OPS[case.op]
    return {
        name: round_to(x, wide_dtype(dtype) if name in spec.wide else dtype)
        for name, x in case.inputs.items()
    }


def native_inputs(backend, case: Case, inputs: dict[str, np.ndarray], dtype: str) -> dict:
    spec = OPS[case.op]
    return {
        name: backend.asarray(x, wide_dtype(dtype) if name in spec.wide else dtype)
        for name, x in inputs.items()
    }


def cotangents(case: Case, outputs: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Random cotangents of the differentiable outputs (o, and lse for FPA), seeded by the case
    and rounded to ``dtype``, so the reference and the backend receive the same values."""
    rng = np.random.default_rng(case.seed + 1)
    names = ["o", "lse"] if case.op == "fpa_attention" else ["o"]
    return {n: round_to(rng.standard_normal(outputs[n].shape), dtype) for n in names}


def _summarise(result: CaseResult, comparisons: dict) -> CaseResult:
    failed = {n: c for n, c in comparisons.items() if not c.passed}
    worst = max(comparisons.values(), key=lambda c: c.ratio)
    result.error = worst.rel
    result.tolerance = worst.tolerance
    result.ratio = worst.ratio
    result.details = {n: c.describe() for n, c in comparisons.items()}
    if failed:
        result.verdict = "failed"
        result.message = "; ".join(f"{n}: {c.describe()}" for n, c in failed.items())
    else:
        result.verdict = "passed"
    return result


def _run_output(backend, case: Case, dtype: str, result: CaseResult) -> CaseResult:
    inputs = rounded_inputs(case, dtype)
    ref = reference_outputs(case, inputs)
    outs = call_op(backend, case.op, native_inputs(backend, case, inputs, dtype), case.params)
    comparisons = {}
    for name, quantity in OPS[case.op].outputs:
        got = backend.to_numpy(outs[name]) if name != "kept_fraction" else np.asarray(outs[name])
        comparisons[name] = compare(got, ref[name], tolerance(case.op, dtype, quantity))
        # NumPy has float64/32/16; a bfloat16 or tf32 result may arrive widened to float32.
        if name in ("o", "y") and dtype in ("float64", "float32", "float16"):
            if np.asarray(got).dtype != np.dtype(dtype):
                problem = f"wrong dtype {np.asarray(got).dtype}, expected {dtype}"
                comparisons[name] = Comparison(
                    np.inf, comparisons[name].tolerance, np.inf, (), problem
                )
    return _summarise(result, comparisons)


def _run_gradient(backend, case: Case, dtype: str, result: CaseResult) -> CaseResult:
    inputs = rounded_inputs(case, dtype)
    cot = cotangents(case, reference_outputs(case, inputs), dtype)
    ref = REFERENCE.vjp(case.op, inputs, case.params, cot)
    native_cot = {n: backend.asarray(c, dtype) for n, c in cot.items()}
    got = backend.vjp(case.op, native_inputs(backend, case, inputs, dtype), case.params, native_cot)
    tol = tolerance(case.op, dtype, "gradient")
    comparisons = {}
    for name in OPS[case.op].differentiable:
        if name not in got:
            comparisons[name] = Comparison(
                np.inf, tol, np.inf, (), "missing from the backend's vjp"
            )
        else:
            comparisons[name] = compare(backend.to_numpy(got[name]), ref[name], tol)
    return _summarise(result, comparisons)


def _run_finite_difference(case: Case, result: CaseResult) -> CaseResult:
    """The reference VJP against float64 central differences along a random direction."""
    spec = OPS[case.op]
    rng = np.random.default_rng(case.seed + 2)
    inputs = dict(case.inputs)
    cot = cotangents(case, reference_outputs(case, inputs), "float64")
    grads = REFERENCE.vjp(case.op, inputs, case.params, cot)
    direction = {n: rng.standard_normal(inputs[n].shape) for n in spec.differentiable}
    names = list(cot)

    def forward(**kw):
        outs = reference_outputs(case, kw)
        return [outs[n] for n in names]

    check = directional_check(forward, inputs, [cot[n] for n in names], grads, direction, h=1e-5)
    tol = 1e-7
    result.error = check.error
    result.tolerance = tol
    result.ratio = check.error / tol
    result.details = {
        "finite_difference": check.finite_difference,
        "vjp_inner": check.vjp_inner,
        "noise": check.noise,
    }
    result.verdict = "passed" if check.passes(tol) else "failed"
    if result.verdict == "failed":
        result.message = (
            f"<vjp, d> = {check.vjp_inner:.12g} but the central difference is "
            f"{check.finite_difference:.12g} (rel {check.error:.2e})"
        )
    return result


def repro_line(backend_name: str, case_id: str, dtype: str, device: str = "cpu") -> str:
    device_flag = f" --device {device}" if device != "cpu" else ""
    return (
        f"attnspec conformance --backend {backend_name}{device_flag} --cases {case_id} "
        f"--dtypes {dtype}"
    )


def run_case(
    backend,
    case: Case,
    dtype: str,
    kind: str,
    *,
    backend_name: str | None = None,
    device: str = "cpu",
) -> CaseResult:
    """Run one (case, dtype, kind) and return its verdict; never raises for backend faults."""
    name = backend_name or getattr(backend, "name", "?")
    result = CaseResult(
        case.id,
        case.op,
        dtype,
        kind,
        "failed",
        seed=case.seed,
        shapes=case.shapes(),
        repro=repro_line(name, case.id, dtype, device),
    )
    try:
        caps = set(backend.capabilities())
        needed = case.op if kind == "output" else f"{case.op}.vjp"
        if kind != "finite_difference" and needed not in caps:
            result.verdict = "not implemented"
            result.message = f"{needed} is not in the backend's capabilities()"
            return result
        if kind != "finite_difference" and dtype not in tuple(getattr(backend, "dtypes", ())):
            result.verdict = "not implemented"
            result.message = f"dtype {dtype} is not in the backend's dtypes"
            return result
        if kind == "output":
            return _run_output(backend, case, dtype, result)
        if kind == "gradient":
            return _run_gradient(backend, case, dtype, result)
        return _run_finite_difference(case, result)
    except Exception as exc:  # a fault of the backend under test, reported per case
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        result.verdict = "failed"
        result.message = (
            f"{type(exc).__name__} raised: {exc} "
            f"({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
        )
        return result


@dataclass
class Plan:
    """What a run will execute: (case, dtype, kind) triples in order."""

    items: list[tuple[Case, str, str]]


def plan(
    cases: Iterable[Case],
    dtypes: Iterable[str],
    *,
    gradients: bool = True,
    finite_differences: bool = False,
) -> Plan:
    items = []
    dtypes = list(dtypes)
    for case in cases:
        for dtype in dtypes:
            items.append((case, dtype, "output"))
            if gradients and case.gradient:
                items.append((case, dtype, "gradient"))
        if finite_differences and case.finite_difference:
            items.append((case, "float64", "finite_difference"))
    return Plan(items)


@dataclass
class RunReport:
    backend: str
    device: str
    results: list[CaseResult]
    unmatched_skips: list[str]
    versions: dict
    seconds: float

    @property
    def ok(self) -> bool:
        return not any(r.verdict == "failed" for r in self.results)


def run(
    backend,
    cases: Iterable[Case],
    dtypes: Iterable[str],
    *,
    backend_name: str | None = None,
    device: str = "cpu",
    gradients: bool = True,
    finite_differences: bool = False,
    skips: SkipList | None = None,
    progress: Callable[[int, int, CaseResult], None] | None = None,
) -> RunReport:
    """Run every planned item; skip-list entries turn matching items into 'skipped'."""
    name = backend_name or getattr(backend, "name", "?")
    work = plan(cases, dtypes, gradients=gradients, finite_differences=finite_differences)
    skips = skips or SkipList([])
    start = time.perf_counter()
    results = []
    for n, (case, dtype, kind) in enumerate(work.items, 1):
        reason = skips.reason(case.id, dtype)
        if reason is not None:
            result = CaseResult(
                case.id,
                case.op,
                dtype,
                kind,
                "skipped",
                message=reason,
                seed=case.seed,
                shapes=case.shapes(),
            )
        else:
            result = run_case(backend, case, dtype, kind, backend_name=name, device=device)
        results.append(result)
        if progress:
            progress(n, len(work.items), result)
    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": sys.platform,
    }
    try:
        versions.update(backend.versions())
    except Exception:  # versions() is optional
        pass
    return RunReport(
        name, device, results, skips.unmatched(), versions, time.perf_counter() - start
    )

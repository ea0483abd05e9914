"""Run conformance cases against a backend; every outcome becomes a :class:`CaseResult`.

Nothing a backend does can crash the runner: exceptions, wrong shapes or dtypes and missing ops
are reported per case with the message, and the verdict is failed (or "not implemented" when the
backend does not claim the op).
"""

from __future__ import annotations

import inspect
import os
import platform
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .calls import (
    REFERENCE,
    NotOffered,
    call_sequence,
    cotangents,
    native_array,
    native_inputs,
    reference_for,
    reference_outputs,
    reference_vjp_for,
)
from .calls import Arrays as Arrays  # re-exported: the tutorial's and users' imports
from .calls import rounded_inputs as rounded_inputs
from .cases import Case, partner
from .gradcheck import directional_check
from .judging import (
    CaseResult,
    dtype_problem,
    mutated,
    mutation_comparison,
    snapshot,
    storage_dtype,
    summarise,
)
from .metrics import Comparison, compare, compare_count, gradient_floors, row_ndim
from .protocol import OPS, Backend, UnsupportedShape, call_op
from .sessions import run_session
from .skips import SkipList, XfailList
from .tolerances import tolerance, wide_dtype

KINDS = ("output", "gradient", "finite_difference", "call_order")
Held = list[tuple[str, Any, np.ndarray]]


def _output_comparisons(
    backend: Backend, case: Case, dtype: str, held: Held | None = None
) -> dict[str, Comparison]:
    """The outputs of one call against the reference; ``held`` (call order) collects each
    returned array with a copy of its values at return."""
    inputs, ref = reference_for(case, dtype)
    native = native_inputs(backend, case, inputs, dtype)
    before = snapshot(backend, native)
    outs = call_op(backend, case.op, native, case.params)
    if held is not None:
        held += [(name, x, np.array(backend.to_numpy(x), copy=True)) for name, x in outs.items()]
    comparisons = {}
    for name, quantity in OPS[case.op].outputs:
        tol = tolerance(case.op, dtype, quantity)
        if name == "kept_fraction":
            q = case.inputs["q"]
            total = q.shape[-2] * int(np.prod(q.shape[:-2]))
            comparisons[name] = compare_count(
                backend.to_numpy(outs[name]), float(ref[name]), total, tol
            )
            continue
        comparisons[name] = compare(
            backend.to_numpy(outs[name]), ref[name], tol, row_ndim=row_ndim(name)
        )
        allowed = (storage_dtype(dtype),) if name != "lse" else ("float32", "float64")
        problem = dtype_problem(backend, outs[name], allowed)
        if problem and comparisons[name].passed:
            comparisons[name] = comparisons[name].failed_with(problem)
    changed = mutated(backend, native, before)
    if changed:
        comparisons["inputs"] = mutation_comparison("inputs", changed)
    return comparisons


def _run_output(backend: Backend, case: Case, dtype: str, result: CaseResult) -> CaseResult:
    return summarise(result, _output_comparisons(backend, case, dtype))


def _gradient_comparisons(
    backend: Backend, case: Case, dtype: str, held: Held | None = None
) -> dict[str, Comparison]:
    """The input cotangents of one VJP against the reference (``held`` as for
    :func:`_output_comparisons`)."""
    spec = OPS[case.op]
    inputs, _ = reference_for(case, dtype)
    cot, ref = reference_vjp_for(case, dtype)
    native = native_inputs(backend, case, inputs, dtype)
    native_cot = {n: native_array(backend, c.copy(), dtype, case.layout) for n, c in cot.items()}
    before = snapshot(backend, native)
    before_cot = snapshot(backend, native_cot)
    got = backend.vjp(case.op, native, case.params, native_cot)
    if held is not None:
        held += [(name, x, np.array(backend.to_numpy(x), copy=True)) for name, x in got.items()]
    tol = tolerance(case.op, dtype, "gradient")
    floors = gradient_floors({n: ref[n] for n in spec.differentiable})
    comparisons = {}
    for name in spec.differentiable:
        if name not in got or got[name] is None:
            fault = "missing from the backend's vjp" if name not in got else "vjp returned None"
            comparisons[name] = Comparison(np.inf, tol, np.inf, (), f"{fault} for {name}")
            continue
        comparisons[name] = compare(
            backend.to_numpy(got[name]), ref[name], tol, row_ndim=row_ndim(name), floor=floors[name]
        )
        expected = wide_dtype(dtype) if name in spec.wide else storage_dtype(dtype)
        problem = dtype_problem(backend, got[name], (expected,))
        if problem and comparisons[name].passed:
            comparisons[name] = comparisons[name].failed_with(problem)
    changed = mutated(backend, native, before)
    if changed:
        comparisons["inputs"] = mutation_comparison("inputs", changed)
    changed = mutated(backend, native_cot, before_cot)
    if changed:
        comparisons["cotangents"] = mutation_comparison("cotangents", changed)
    return comparisons


def _run_gradient(backend: Backend, case: Case, dtype: str, result: CaseResult) -> CaseResult:
    return summarise(result, _gradient_comparisons(backend, case, dtype))


def _run_call_order(backend: Backend, case: Case, dtype: str, result: CaseResult) -> CaseResult:
    """Forwards and VJPs of the case and its partner interleaved; each compared with its own
    reference (names: "<call number> <output|gradient> <A|B>: <quantity>"), and every array
    returned in the sequence held to the end and compared then with a copy taken when it was
    returned ("... held"): a backend that hands out a persistent buffer (a static graph output,
    a reused workspace) which a later call overwrites fails."""
    pair = (case, partner(case))
    comparisons = {}
    held: list[tuple[str, Held]] = []
    for number, (kind, which) in enumerate(call_sequence(case.seed + 3), 1):
        run = _output_comparisons if kind == "output" else _gradient_comparisons
        label = f"call {number} {kind} {'AB'[which]}"
        returned: Held = []
        for name, comparison in run(backend, pair[which], dtype, returned).items():
            comparisons[f"{label}: {name}"] = comparison
        held.append((label, returned))
    for label, returned in held:
        for name, x, copy in returned:
            comparisons[f"{label} held: {name}"] = _held_comparison(backend, x, copy)
    return summarise(result, comparisons)


def _held_comparison(backend: Backend, x: Any, copy: np.ndarray) -> Comparison:
    """A result kept by the caller after the whole call sequence, against its values at
    return: equal bit for bit, or failed."""
    now = np.asarray(backend.to_numpy(x))
    if now.shape == copy.shape and np.array_equal(now, copy, equal_nan=True):
        return Comparison(0.0, 0.0, 0.0, ())
    return Comparison(np.inf, 0.0, np.inf, (), "changed by a later call (a reused output buffer)")


def _run_finite_difference(
    backend: Backend, case: Case, dtype: str, result: CaseResult
) -> CaseResult:
    """The reference VJP against float64 central differences along a random direction (the
    backend and the dtype play no part: the check is of the reference itself)."""
    spec = OPS[case.op]
    rng = np.random.default_rng(case.seed + 2)
    inputs = dict(case.inputs)
    cot = cotangents(case, reference_outputs(case, inputs), "float64")
    grads = REFERENCE.vjp(case.op, inputs, case.params, cot)
    direction = {n: rng.standard_normal(inputs[n].shape) for n in spec.differentiable}
    names = list(cot)

    def forward(**kw: NDArray[np.float64]) -> list[NDArray[np.float64]]:
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


Check = Callable[[Backend, Case, str, CaseResult], CaseResult]

# Every kind of check, by name: (backend, case, dtype, result) -> the result, judged. A plan's
# kind names the check, except a session case's "output": its program (:func:`check_of`).
CHECKS: dict[str, Check] = {
    "output": _run_output,
    "gradient": _run_gradient,
    "call_order": _run_call_order,
    "finite_difference": _run_finite_difference,
    "session": run_session,
}


def check_of(case: Case, kind: str) -> str:
    """The check that judges ``kind`` of ``case``: "session" for the output of a decode-session
    program, else the kind itself."""
    return "session" if kind == "output" and "session" in case.params else kind


def repro_line(
    backend_name: str,
    case_id: str,
    dtype: str,
    device: str = "cpu",
    environment: dict[str, str] | None = None,
) -> str:
    """The command that reruns one item; ``environment`` (the backend's ``environment()``)
    goes in front as ``NAME=value`` assignments."""
    device_flag = f" --device {device}" if device != "cpu" else ""
    env = "".join(f"{k}={v} " for k, v in sorted((environment or {}).items()))
    return (
        f"{env}attnspec conformance --backend {backend_name}{device_flag} --cases {case_id} "
        f"--dtypes {dtype}"
    )


def backend_environment(backend: Backend) -> dict[str, str]:
    """The backend's optional ``environment()``: the variables its repro line sets."""
    environment = getattr(backend, "environment", None)
    if environment is None:
        return {}
    return dict(environment() if callable(environment) else environment)


def unsupported_reason(backend: Backend, case: Case) -> str | None:
    """The backend's optional ``unsupported(op, shapes)``: why it does not take this shape."""
    unsupported = getattr(backend, "unsupported", None)
    if unsupported is None:
        return None
    reason = unsupported(case.op, case.shapes())
    return None if reason is None else str(reason)


def required_capabilities(case: Case, kind: str) -> tuple[str, ...]:
    """The capabilities an item needs: its op (a session case: ``<op>.session``, among its
    requirements), ``<op>.vjp`` for gradients, and the case's requirements."""
    needed = {
        "output": () if "session" in case.params else (case.op,),
        "gradient": (f"{case.op}.vjp",),
        "call_order": (case.op, f"{case.op}.vjp"),
    }.get(kind, ())
    return (*needed, *case.requires)


def run_case(
    backend: Backend,
    case: Case,
    dtype: str,
    kind: str,
    *,
    backend_name: str | None = None,
    device: str = "cpu",
    probe: bool = False,
) -> CaseResult:
    """Run one (case, dtype, kind) and return its verdict; never raises for backend faults.

    ``probe``: the dtype is not one the backend declares, but the kit tries it anyway (the
    float32 rows for a backend that declares only half precisions): a backend that refuses it
    (raises) is "not implemented"; one that accepts it is judged as usual.
    """
    name = backend_name or str(getattr(backend, "name", "?"))
    result = CaseResult(
        case.id,
        case.op,
        dtype,
        kind,
        "failed",
        seed=case.seed,
        shapes=case.shapes(),
        note=case.note,
        backend=name,
    )
    try:
        result.repro = repro_line(name, case.id, dtype, device, backend_environment(backend))
        caps = set(backend.capabilities())
        if kind != "finite_difference":
            missing = [c for c in required_capabilities(case, kind) if c not in caps]
            if missing:
                result.verdict = "not implemented"
                result.message = f"{', '.join(missing)} not in the backend's capabilities()"
                return result
        declared = dtype in tuple(getattr(backend, "dtypes", ()))
        if kind != "finite_difference" and not (declared or probe):
            result.verdict = "not implemented"
            result.message = f"dtype {dtype} is not in the backend's dtypes"
            return result
        check = check_of(case, kind)
        # a session program is judged call by call (its shapes are the program's)
        if check not in ("session", "finite_difference"):
            reason = unsupported_reason(backend, case)
            if reason is not None:
                result.verdict = "not implemented"
                result.message = f"not supported for this shape: {reason}"
                return result
        return CHECKS[check](backend, case, dtype, result)
    except NotOffered as exc:
        result.verdict = "not implemented"
        result.message = str(exc)
        return result
    except UnsupportedShape as exc:
        result.verdict = "not implemented"
        result.message = f"not supported for this shape: {exc}"
        return result
    except Exception as exc:  # a fault of the backend under test, reported per case
        result.verdict = "not implemented" if probe else "failed"
        result.raised = f"{type(exc).__name__}: {exc}"
        result.message = (
            f"{'probe of an undeclared dtype: ' if probe else ''}"
            f"{type(exc).__name__} raised: {exc} ({raise_site(exc, backend, case.op)})"
        )
        return result


KIT_DIR = os.path.dirname(os.path.abspath(__file__))
LIBRARY_DIRS = tuple(
    os.path.abspath(p)
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(LIBRARY_DIRS) or filename.startswith("<")


def raise_site(exc: BaseException, backend: Backend, op: str) -> str:
    """Where a backend's exception comes from, for its author: the innermost frame of code
    that is neither the kit's nor a library's (the backend's own file and line), then the
    library frame that raised if it is deeper ("via numpy/...:123"). When every frame is the
    kit's or a library's (the kit could not even call the op: a wrong signature, an attribute
    that is not callable), the op's definition in the backend is named instead."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if not os.path.abspath(f.filename).startswith(KIT_DIR + os.sep)]
    authored = [f for f in own if not _is_library(f.filename)]
    last = frames[-1] if frames else None
    if authored:
        site = authored[-1]
        text = f"at {site.filename}:{site.lineno} in {site.name}"
        if last is not None and last is not site and _is_library(last.filename):
            text += f", via {_short(last.filename)}:{last.lineno}"
        return text
    target = getattr(type(backend), op, None) or type(backend)
    try:
        source = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (TypeError, OSError):
        source, line = None, 0
    where = f"{source}:{line}" if source else type(backend).__qualname__
    text = f"calling {type(backend).__qualname__}.{op} defined at {where}"
    if last is not None and not os.path.abspath(last.filename).startswith(KIT_DIR + os.sep):
        text += f"; raised at {_short(last.filename)}:{last.lineno}"
    return text


def _short(filename: str) -> str:
    """A library file relative to its installation directory (numpy/core/...)."""
    path = os.path.abspath(filename)
    for root in sorted((*LIBRARY_DIRS, KIT_DIR), key=len, reverse=True):  # innermost first
        if path.startswith(root + os.sep):
            return os.path.relpath(path, os.path.dirname(root) if root == KIT_DIR else root)
    return filename


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
            if gradients and case.call_order:
                items.append((case, dtype, "call_order"))
        if finite_differences and case.finite_difference:
            items.append((case, "float64", "finite_difference"))
    return Plan(items)


@dataclass
class RunReport:
    backend: str
    device: str
    results: list[CaseResult]
    unmatched_skips: list[str]
    versions: dict[str, str]
    seconds: float
    notes: list[str] = field(default_factory=list)
    # what the backend claims (dtypes, capabilities) and its items outside them (unclaimed.py);
    # for a model, what was judged (model_runner.py)
    claims: dict[str, Any] | None = None
    unclaimed: list[CaseResult] = field(default_factory=list)
    model: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not any(r.verdict == "failed" for r in self.results)


def run(
    backend: Backend,
    cases: Iterable[Case],
    dtypes: Iterable[str],
    *,
    backend_name: str | None = None,
    device: str = "cpu",
    gradients: bool = True,
    finite_differences: bool = False,
    skips: SkipList | None = None,
    progress: Callable[[int, int, CaseResult], None] | None = None,
    probes: Iterable[str] = (),
    xfails: XfailList | None = None,
    name_bugs: bool = True,
) -> RunReport:
    """Run every planned item; skip-list entries turn matching items into 'skipped', and
    expected-failure entries turn a failure into 'xfailed' and a pass into a failure.

    ``probes``: dtypes the backend does not declare but that are run anyway (see
    :func:`run_case`); :func:`probe_dtypes` says which are worth it.

    ``name_bugs``: the first failure of each op and kind also says which known wrong backend
    its values match (:mod:`.naming`).
    """
    from .naming import annotate

    named: set[tuple[str, str]] = set()
    name = backend_name or str(getattr(backend, "name", "?"))
    probes = [d for d in probes if d not in dtypes]
    work = plan(
        cases,
        [*dtypes, *probes],
        gradients=gradients,
        finite_differences=finite_differences,
    )
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
                backend=name,
            )
        else:
            result = run_case(
                backend,
                case,
                dtype,
                kind,
                backend_name=name,
                device=device,
                probe=dtype in probes,
            )
            if xfails is not None:
                result = xfails.judge(result)
            if name_bugs and (case.op, kind) not in named:
                if annotate(backend, case, dtype, kind, result):
                    named.add((case.op, kind))
        results.append(result)
        if progress:
            progress(n, len(work.items), result)
    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": sys.platform,
    }
    try:
        versions.update(backend.versions())  # type: ignore[attr-defined]  # optional
    except Exception:  # versions() is optional
        pass
    notes = []
    if probes:
        notes.append(
            f"{name} declares only {', '.join(getattr(backend, 'dtypes', ()))}: the "
            f"{', '.join(probes)} rows are the strongest check of the math (half-precision "
            "tolerances hide small errors), so the kit ran them as a probe; a backend that "
            "refuses them is reported as not implemented there"
        )
    unmatched = skips.unmatched() + ([] if xfails is None else xfails.unmatched())
    seconds = time.perf_counter() - start
    try:
        claims = backend_claims(backend)
    except Exception:  # capabilities() raised: every item says so already
        claims = None
    return RunReport(name, device, results, unmatched, versions, seconds, notes, claims)


def backend_claims(backend: Backend) -> dict[str, Any]:
    """The claims of the JSON report: the dtypes and the sorted capabilities (with
    "strided" when the adapter offers strided inputs)."""
    from .covering_cases import backend_capabilities

    return {
        "dtypes": list(backend.dtypes),
        "capabilities": sorted(backend_capabilities(backend)),
    }


def probe_dtypes(backend: Backend) -> list[str]:
    """["float32"] for a backend that declares only float16 / bfloat16 (or tf32), else []."""
    declared = set(getattr(backend, "dtypes", ()))
    return [] if declared & {"float32", "float64"} else ["float32"]

"""Name the bug: which known wrong backend a failing backend's values match.

A failure with wrong values is located by the runner (the quantity, the worst row). This module
says what the error probably is: it runs the failing item again on the backend and on each
*suspect* (the kit's shipped wrong backends of :mod:`.mutants`, the wrong sessions of
:mod:`.session_mutants` and the FoX variants of :mod:`.fox_variants`) on the same rounded inputs,
and reports the suspects whose results the backend's match within the case's tolerance:
"matches `GateAtOwnKey` (the gate counted at its own key ...) to 3.1e-17".

A *trace* is what one item returns: the outputs of a forward, the cotangents of a VJP, every
array of a call-order sequence (and its values at the end), or the outputs, counts and errors
of a session program up to the failing call; with each array its dtype, and the inputs a call
modified. A suspect matches when every entry of its trace matches the backend's: arrays within
the tolerance of their quantity (relative to each other), the same dtype, counts equal, the same
calls raising. A suspect whose own trace matches the reference's is not distinguishable on this
case and is never named.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import fox_variants, mutants, session_mutants
from .calls import (
    call_sequence,
    native_array,
    native_inputs,
    reference_for,
    reference_vjp_for,
)
from .cases import Case, partner
from .judging import returned_dtype
from .metrics import compare, gradient_floors, row_ndim
from .numpy_backend import NumpyBackend
from .protocol import OPS, Backend, call_op
from .tolerances import tolerance


@dataclass(frozen=True)
class Entry:
    """One returned value: float64 values (None for a non-array fact), the returned dtype or
    the fact ("raised ValueError", "modified q"), and the tolerance quantity ("" exact)."""

    values: np.ndarray | None
    fact: str
    quantity: str = ""
    floor: float = 0.0


Trace = dict[str, Entry]


@dataclass(frozen=True)
class Suspect:
    """A known wrong backend: its name, where it lives, its first docstring line, a maker."""

    name: str
    module: str
    summary: str
    make: Callable[[], Backend]


def _summary(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split()).rstrip(".")


def suspects(case: Case) -> list[Suspect]:
    """The wrong backends that change ``case``'s op (wrong sessions for a session case)."""
    found = []
    if "session" in case.params:
        for name, cls in session_mutants.SESSION_MUTANTS.items():
            if cls.op == case.op:
                summary = _summary(cls.wrong) or cls.family
                found.append(Suspect(name, "session_mutants", summary, cls))
        return found
    for module, table in (
        ("mutants", mutants.MUTANTS),
        ("fox_variants", fox_variants.FOX_VARIANTS),
    ):
        for name, m in table.items():
            if case.op in m.ops:
                found.append(Suspect(name, module, _summary(m), m))
    return found


# traces of the whole-sequence ops


def _entry(backend: Backend, x: Any, quantity: str, floor: float = 0.0) -> Entry:
    values = np.array(backend.to_numpy(x), dtype=np.float64, copy=True)
    return Entry(values, returned_dtype(backend, x), quantity, floor)


def _modified(backend: Backend, native: dict[str, Any], before: dict[str, np.ndarray]) -> str:
    changed = [
        n
        for n, x in native.items()
        if not np.array_equal(np.asarray(backend.to_numpy(x)), before[n], equal_nan=True)
    ]
    return ", ".join(changed)


def op_trace(backend: Backend, case: Case, dtype: str, kind: str) -> Trace:
    """The backend's results of one (case, dtype, kind) item: output, gradient or call_order
    (the call sequence of :func:`~.calls.call_sequence`, then every result held to the end)."""
    calls: list[tuple[str, Case]]
    if kind == "call_order":
        pair = (case, partner(case))
        calls = [(k, pair[w]) for k, w in call_sequence(case.seed + 3)]
    else:
        calls = [(kind, case)]
    trace: Trace = {}
    held = []
    for number, (what, item) in enumerate(calls):
        label = f"call {number} {what}: " if kind == "call_order" else ""
        inputs, _ = reference_for(item, dtype)
        native = native_inputs(backend, item, inputs, dtype)
        before = {n: np.array(backend.to_numpy(x), copy=True) for n, x in native.items()}
        if what == "output":
            got = call_op(backend, item.op, native, item.params)
            quantities = dict(OPS[item.op].outputs)
            floors = {n: 0.0 for n in got}
        else:
            cot, ref_grads = reference_vjp_for(item, dtype)
            native_cot = {
                n: native_array(backend, c.copy(), dtype, item.layout) for n, c in cot.items()
            }
            got = backend.vjp(item.op, native, item.params, native_cot)
            quantities = {n: "gradient" for n in got}
            floors = gradient_floors({n: ref_grads[n] for n in OPS[item.op].differentiable})
        for name, x in got.items():
            trace[label + name] = _entry(
                backend, x, quantities.get(name, "output"), floors.get(name, 0.0)
            )
            held.append((label + name, x))
        changed = _modified(backend, native, before)
        if changed:
            trace[label + "modified"] = Entry(None, f"modified {changed}")
    if kind == "call_order":
        for label, x in held:
            trace[label + " held"] = _entry(backend, x, "")
    return trace


# traces of session programs


def session_trace(backend: Backend, case: Case, dtype: str, upto: int) -> Trace:
    """The backend's outputs, counts and errors for the calls 0..``upto`` of a session case."""
    from .sessions import native_args, native_config, output_name, output_quantity
    from .sessions import reference_for as program_for

    program, _ = program_for(case, dtype)
    trace: Trace = {}
    session = backend.open_session(  # type: ignore[attr-defined]  # the session protocol
        program.op, rows=program.rows, dtype=dtype, config=native_config(backend, program, dtype)
    )
    for i, call in enumerate(program.calls[: upto + 1]):
        args = native_args(backend, program.op, call, dtype)
        try:
            result = getattr(session, call.method)(**args)
        except Exception as exc:  # a call that raises: the same call of a suspect must raise
            trace[f"call {i}"] = Entry(None, f"raised {type(exc).__name__}")
        else:
            if call.method == "advance" and isinstance(result, dict):
                name = output_name(program.op)
                if name in result:
                    quantity = output_quantity(program.op)
                    trace[f"call {i}: {name}"] = _entry(backend, result[name], quantity)
        try:
            counts = session.counts()
            for key in sorted(counts):
                values = np.asarray(backend.to_numpy(counts[key]))
                trace[f"call {i}: {key}"] = Entry(values.astype(np.float64), "count")
        except Exception as exc:  # a fault of the backend, as above
            trace[f"call {i}: counts"] = Entry(None, f"counts raised {type(exc).__name__}")
    return trace


# matching


def distance(got: Trace, other: Trace, op: str, dtype: str) -> float:
    """The largest ratio error / tolerance between two traces (inf where they differ in kind,
    shape, dtype or a fact; exact entries count 0 or inf), as the relative error of the worst
    entry when every entry is within tolerance: a number <= 1 means "matches"."""
    if set(got) != set(other):
        return math.inf
    worst = 0.0
    for label, a in got.items():
        b = other[label]
        if a.fact != b.fact or (a.values is None) != (b.values is None):
            return math.inf
        if a.values is None or b.values is None:
            continue
        if a.values.shape != b.values.shape:
            return math.inf
        if not a.quantity:  # exact: counts, held copies
            if not np.array_equal(a.values, b.values, equal_nan=True):
                return math.inf
            continue
        x, y = a.values, b.values
        bad_x, bad_y = ~np.isfinite(x), ~np.isfinite(y)
        if (bad_x != bad_y).any() or not np.array_equal(x[bad_x], y[bad_y], equal_nan=True):
            return math.inf  # NaN and inf where the other has them, the same ones
        x, y = np.where(bad_x, 0.0, x), np.where(bad_y, 0.0, y)
        tol = tolerance(op, dtype, a.quantity)
        if x.ndim == 0:  # a scalar (the kept fraction)
            error = abs(float(x) - float(y)) / max(abs(float(y)), 1e-30)
            ratio = (0.0 if error == 0 else math.inf) if tol == 0 else error / tol
        else:
            name = label.rsplit(": ", 1)[-1]
            c = compare(
                x,
                y,
                tol,
                row_ndim=row_ndim(name),
                floor=a.floor,
            )
            if not c.passed:
                return math.inf
            ratio = c.ratio
        worst = max(worst, ratio)
    return worst


@dataclass(frozen=True)
class Match:
    suspect: Suspect
    ratio: float  # worst error / tolerance against the suspect
    error: float  # the worst relative error against the suspect

    def describe(self) -> str:
        where = f"attnspec.conformance.{self.suspect.module}:{self.suspect.name}"
        to = "exactly" if self.error == 0 else f"to {self.error:.1e}"
        return f"`{self.suspect.name}` {to} ({self.suspect.summary}; {where})"


def _relative_error(got: Trace, other: Trace) -> float:
    worst = 0.0
    for label, a in got.items():
        b = other[label]
        if a.values is None or b.values is None or a.values.size == 0:
            continue
        x, y = (np.where(np.isfinite(z), z, 0.0) for z in (a.values, b.values))
        diff = float(np.linalg.norm((x - y).ravel()))
        worst = max(worst, diff / max(float(np.linalg.norm(y.ravel())), a.floor, 1e-30))
    return worst


def matches(
    backend: Backend,
    case: Case,
    dtype: str,
    kind: str,
    upto: int = -1,
    among: Iterable[Suspect] | None = None,
) -> list[Match]:
    """The suspects whose trace of the item the backend's matches, closest first (none where
    the backend raises on the item: an exception is named by its own line)."""

    def trace_of(b: Backend) -> Trace:
        if "session" in case.params:
            return session_trace(b, case, dtype, upto)
        return op_trace(b, case, dtype, kind)

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overflow in a wrong backend is part of its values
        return _matches(backend, case, dtype, trace_of, among)


def _matches(
    backend: Backend,
    case: Case,
    dtype: str,
    trace_of: Callable[[Backend], Trace],
    among: Iterable[Suspect] | None,
) -> list[Match]:
    try:
        got = trace_of(backend)
    except Exception:  # the backend raises: the runner names the line
        return []
    reference = trace_of(NumpyBackend())
    found = []
    for suspect in suspects(case) if among is None else among:
        try:
            theirs = trace_of(suspect.make())
        except Exception:  # a suspect that does not take this case (varlen, strides)
            continue
        if distance(theirs, reference, case.op, dtype) <= 1.0:
            continue  # indistinguishable from the reference here
        ratio = distance(got, theirs, case.op, dtype)
        if ratio <= 1.0:
            found.append(Match(suspect, ratio, _relative_error(got, theirs)))
    return sorted(found, key=lambda m: (m.ratio, m.suspect.name))


def name_the_bug(backend: Backend, case: Case, dtype: str, kind: str, upto: int = -1) -> str:
    """One line for a failure message: the suspects the backend's values match, or ""."""
    if kind == "finite_difference":
        return ""
    found = matches(backend, case, dtype, kind, upto)
    if not found:
        return ""
    return "the values match " + "; ".join(m.describe() for m in found)


def annotate(backend: Backend, case: Case, dtype: str, kind: str, result: Any) -> bool:
    """Append :func:`name_the_bug`'s line to a failed result's message (not to one where the
    backend raised, nor to a finite-difference check of the reference). Returns whether the
    item was worth naming (the runner names the first such failure of each op and kind)."""
    if result.verdict != "failed" or result.raised or kind == "finite_difference":
        return False
    upto = int(result.details.get("failed_at", -1)) if "session" in case.params else -1
    line = name_the_bug(backend, case, dtype, kind, upto)
    if line:
        result.message += "\n" + line
    return True

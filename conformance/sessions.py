"""The kit's driver for decode sessions: a program run on a backend and on the reference.

A session case (``<prefix>/session_<family>/<n>``, see :mod:`.session_programs`) holds a
:class:`~.session_programs.Program`. The kit opens the backend's session
(``backend.open_session(op, rows=, dtype=, config=)``) and the reference's
(:mod:`attnspec.reference.sessions`) on the same inputs rounded to the tested dtype, and after
every call compares: the outputs (tolerance of the dtype; exactly 0 at absent positions; the
tested dtype), the counts (exactly; integer arrays), and for a call that must fail, that it
raised a ValueError naming the argument and left the counts unchanged (the next calls show the
state is unchanged too). The first failing call ends the run; the message lists the program up to
it, and ``python -m attnspec.conformance.sessions --backend B --case ID --dtype D`` replays it
call by call.

The present mask reaches the backend as ``backend.asarray(mask, "bool")`` (the NumPy bool array
itself when the adapter refuses the dtype name "bool").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from attnspec.reference import sessions as reference_sessions
from attnspec.reference.ops import session_contract

from .cases import Case, build_case
from .judging import (
    REFERENCE_CACHE,
    CaseResult,
    mutated,
    mutation_comparison,
    returned_dtype,
    snapshot,
    storage_dtype,
    summarise,
)
from .metrics import Comparison, compare
from .protocol import OPS, S4D_PARAMS, Backend
from .session_programs import Call, Program
from .tolerances import round_to, tolerance, wide_dtype


def is_session(case: Case) -> bool:
    """A session case: its params hold the program."""
    return isinstance(case.params.get("session"), Program)


def count_names(op: str) -> tuple[str, ...]:
    """The keys of the op's counts() (its session contract, reference/ops.py)."""
    return session_contract(op).counts


def output_quantity(op: str) -> str:
    """The tolerance quantity of a session's output: an attention output for the FPA and FoX
    sessions and the layers, a state's readout for the Interdomain states."""
    return "output" if op in ("fpa_decode", "fox_attention") or OPS[op].layer else "state"


def output_name(op: str) -> str:
    """The name of the output of the op's advance (its session contract)."""
    return session_contract(op).output


def _input_dtype(op: str, name: str, dtype: str) -> str:
    return wide_dtype(dtype) if name in OPS[op].wide else dtype


def rounded_program(program: Program, dtype: str) -> Program:
    """The program with every array rounded as the backend receives it (wide inputs and the
    S4D parameters to float32 or wider, the rest to ``dtype``), as float64."""

    def config_value(name: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: round_to(v, dtype) for k, v in value.items()}
        if isinstance(value, np.ndarray):
            return round_to(value, wide_dtype(dtype) if name in S4D_PARAMS else dtype)
        return value

    calls = []
    for call in program.calls:
        if call.method == "advance":
            inputs = {
                k: round_to(v, _input_dtype(program.op, k, dtype))
                for k, v in call.args["inputs"].items()
            }
            call = Call(call.method, {**call.args, "inputs": inputs}, call.error, call.note)
        calls.append(call)
    config = {k: config_value(k, v) for k, v in program.config.items()}
    return Program(program.op, program.rows, config, tuple(calls))


@dataclass(frozen=True)
class Step:
    """The reference's result of one call: outputs (advance) and the counts after it."""

    outputs: dict[str, NDArray[np.float64]] | None
    counts: dict[str, NDArray[np.int64]]


def reference_trace(program: Program) -> list[Step]:
    """Run ``program`` (already rounded) on the reference session; a call meant to fail must
    fail there too (else the program itself is wrong: RuntimeError)."""
    session = reference_sessions.open_session(program.op, rows=program.rows, config=program.config)
    trace = []
    for i, call in enumerate(program.calls):
        outputs = None
        try:
            result = getattr(session, call.method)(**call.args)
        except ValueError as exc:
            if not call.error or call.error not in str(exc):
                raise RuntimeError(
                    f"call {i} {call.describe()}: the reference raised {exc}"
                ) from exc
        else:
            if call.error:
                raise RuntimeError(f"call {i} {call.describe()}: the reference did not raise")
            if call.method == "advance":
                outputs = {k: np.asarray(v, dtype=np.float64) for k, v in result.items()}
        trace.append(Step(outputs, session.counts()))
    return trace


def reference_for(case: Case, dtype: str) -> tuple[Program, list[Step]]:
    """(rounded program, reference trace) of a session case at ``dtype``, cached."""

    def compute() -> tuple[Program, list[Step]]:
        program = rounded_program(case.params["session"], dtype)
        return program, reference_trace(program)

    return REFERENCE_CACHE.get((case.id, case.seed, dtype, "session"), compute)


def native_config(backend: Backend, program: Program, dtype: str) -> dict[str, Any]:
    """The config with its arrays as the backend's arrays (S4D parameters wide)."""
    config: dict[str, Any] = {}
    for name, value in program.config.items():
        if isinstance(value, dict):
            config[name] = {k: backend.asarray(v.copy(), dtype) for k, v in value.items()}
        elif isinstance(value, np.ndarray):
            wide = name in S4D_PARAMS
            config[name] = backend.asarray(value.copy(), wide_dtype(dtype) if wide else dtype)
        else:
            config[name] = value
    return config


def native_args(backend: Backend, op: str, call: Call, dtype: str) -> dict[str, Any]:
    if call.method != "advance":  # select's list copied: nothing a backend does reaches the case
        return {k: list(v) if isinstance(v, list) else v for k, v in call.args.items()}
    inputs = {
        k: backend.asarray(v.copy(), _input_dtype(op, k, dtype))
        for k, v in call.args["inputs"].items()
    }
    mask = np.asarray(call.args["present"])
    if mask.dtype != np.bool_:  # a bad call: a float mask, in the backend's float type
        return {"inputs": inputs, "present": backend.asarray(mask.copy(), dtype)}
    try:
        present = backend.asarray(mask.copy(), "bool")
    except Exception:  # an adapter that knows only float dtypes: the NumPy mask itself
        present = mask.copy()
    return {"inputs": inputs, "present": present}


def _failure(problem: str) -> Comparison:
    return Comparison(np.inf, 0.0, np.inf, (), problem, np.inf, ())


def _passed() -> Comparison:
    return Comparison(0.0, 0.0, 0.0, ())


def compare_outputs(
    backend: Backend, op: str, got: Any, ref: NDArray[np.float64], present: Any, dtype: str
) -> Comparison:
    """An advance's output against the reference: shape, dtype, values, exact 0 when absent."""
    name = output_name(op)
    if not isinstance(got, Mapping) or name not in got:
        return _failure(f"expected a dict with {name!r}, got {type(got).__name__}")
    x = np.asarray(backend.to_numpy(got[name]))
    if x.shape != ref.shape:
        return _failure(f"{name}: wrong shape {x.shape}, expected {ref.shape}")
    if ref.size == 0:
        return _passed()
    # FPA decode and the layers: outputs; S4D and LegS decode: the state's readout
    quantity = output_quantity(op)
    comparison = compare(x, ref, tolerance(op, dtype, quantity))
    token_axis = session_contract(op).token_axis
    mask = np.asarray(present, dtype=bool)
    absent = ~np.expand_dims(mask, (*range(1, token_axis), -1))  # (R, 1, n, 1) or (R, n, 1)
    absent = np.broadcast_to(absent, x.shape)
    if absent.any() and np.any(x.astype(np.float64)[absent] != 0):
        index = tuple(int(i) for i in np.argwhere(absent & (x != 0))[0])
        return comparison.failed_with(f"{name}: nonzero output {x[index]!r} at absent {index}")
    got_dtype = returned_dtype(backend, got[name])
    wanted = storage_dtype(dtype)
    if got_dtype != wanted and not (got_dtype == "float32" and wanted == "bfloat16"):
        return comparison.failed_with(f"{name}: wrong dtype {got_dtype}, expected {wanted}")
    return comparison


def compare_counts(
    backend: Backend, op: str, got: Any, ref: Mapping[str, NDArray[np.int64]]
) -> Comparison:
    """counts() against the reference: every key of the op, integer arrays, exactly equal."""
    if not isinstance(got, Mapping):
        return _failure(f"counts(): expected a dict, got {type(got).__name__}")
    problems = []
    if "overflowed" in got and np.asarray(backend.to_numpy(got["overflowed"])).any():
        flags = np.asarray(backend.to_numpy(got["overflowed"])).astype(int).tolist()
        problems.append(f"overflowed {flags} (a fixed capacity ran out)")
    for name in count_names(op):
        if name not in got:
            problems.append(f"{name} missing")
            continue
        x = np.asarray(backend.to_numpy(got[name]))
        if not np.issubdtype(x.dtype, np.integer):
            problems.append(f"{name}: dtype {x.dtype}, expected an integer dtype")
        elif x.shape != ref[name].shape or not np.array_equal(x, ref[name]):
            problems.append(f"{name} {x.tolist()}, expected {ref[name].tolist()}")
    return _failure("; ".join(problems)) if problems else _passed()


def _raised(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_program(
    backend: Backend, program: Program, trace: list[Step], dtype: str, verbose: bool = False
) -> tuple[dict[str, Comparison], int]:
    """Drive the backend through ``program`` (rounded) and compare with ``trace`` after every
    call. Returns the comparisons and the index of the first failing call (-1: none)."""
    op = program.op
    comparisons: dict[str, Comparison] = {}
    try:
        session = backend.open_session(  # type: ignore[attr-defined]  # the session protocol
            op, rows=program.rows, dtype=dtype, config=native_config(backend, program, dtype)
        )
    except Exception as exc:  # a fault of the backend, reported
        return {"open_session": _failure(f"raised {_raised(exc)}")}, 0
    for i, (call, step) in enumerate(zip(program.calls, trace, strict=True)):
        label = f"call {i} {call.method}"
        args = native_args(backend, op, call, dtype)
        before = snapshot(backend, args["inputs"]) if call.method == "advance" else {}
        try:
            result = getattr(session, call.method)(**args)
            raised = None
        except Exception as exc:  # judged below
            result, raised = None, exc
        changed = mutated(backend, args["inputs"], before) if before else []
        if changed:
            comparisons[f"{label}: inputs"] = mutation_comparison("inputs", changed)
        if call.error:
            if raised is None:
                comparisons[label] = _failure(f"expected a ValueError naming {call.error!r}")
            elif not isinstance(raised, ValueError) or call.error not in str(raised):
                comparisons[label] = _failure(
                    f"expected a ValueError naming {call.error!r}, got {_raised(raised)}"
                )
        elif raised is not None:
            comparisons[label] = _failure(f"raised {_raised(raised)}")
        elif step.outputs is not None:
            ref = step.outputs[output_name(op)]
            comparisons[f"{label}: {output_name(op)}"] = compare_outputs(
                backend, op, result, ref, call.args["present"], dtype
            )
        try:
            counts = session.counts()
            comparisons[f"{label}: counts"] = compare_counts(backend, op, counts, step.counts)
        except Exception as exc:  # a fault of the backend, reported
            comparisons[f"{label}: counts"] = _failure(f"counts() raised {_raised(exc)}")
        if verbose:
            bad = [f"{k}: {c.describe()}" for k, c in comparisons.items() if k.startswith(label)]
            ok = all(c.passed for k, c in comparisons.items() if k.startswith(label))
            print(f"{i:>3}: {call.describe()}\n     {'ok' if ok else 'FAILED'} {'; '.join(bad)}")
        if not all(c.passed for c in comparisons.values()):
            return comparisons, i
    return comparisons, -1


def run_session(backend: Backend, case: Case, dtype: str, result: CaseResult) -> CaseResult:
    """The "output" check of a session case: the whole program, compared call by call."""
    program, trace = reference_for(case, dtype)
    comparisons, failed_at = run_program(backend, program, trace, dtype)
    result = summarise(result, comparisons)
    if failed_at >= 0:
        result.message += "\nprogram up to the failing call:\n" + program.listing(failed_at)
        result.repro += (
            f"\nreplay call by call: python -m attnspec.conformance.sessions --backend "
            f"{result.backend} --case {case.id} --dtype {dtype}"
        )
    result.details = {"calls": len(program.calls), "failed_at": failed_at}
    return result


def replay(backend: Backend, case_id: str, dtype: str) -> bool:
    """Print ``case_id``'s program on ``backend`` call by call with each comparison."""
    case = build_case(case_id)
    if not is_session(case):
        raise ValueError(f"case: {case_id!r} is not a session case")
    program, trace = reference_for(case, dtype)
    print(program.listing().splitlines()[0])
    _, failed_at = run_program(backend, program, trace, dtype, verbose=True)
    return failed_at < 0


def main(argv: list[str] | None = None) -> int:
    from .registry import get_backend

    p = argparse.ArgumentParser(
        prog="python -m attnspec.conformance.sessions",
        description="Replay one session case on a backend, call by call.",
    )
    p.add_argument("--backend", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--case", required=True)
    p.add_argument("--dtype", default="float64")
    args = p.parse_args(argv)
    return 0 if replay(get_backend(args.backend, args.device), args.case, args.dtype) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The kit's calls of a case: the float64 reference on the case's inputs rounded to the tested
dtype (kept in the reference cache), the backend's own arrays of them, the cotangents, and the
shuffled order of the call-order check. The runner, the sessions' naming of wrong values and
the unclaimed items all call a backend this way."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .cases import Case
from .judging import REFERENCE_CACHE
from .numpy_backend import NumpyBackend
from .protocol import OPS, Backend, call_op
from .tolerances import round_to, wide_dtype

REFERENCE = NumpyBackend()


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


class NotOffered(Exception):
    """The backend's adapter does not offer what a case needs (a strided input layout)."""


def native_array(backend: Backend, x: np.ndarray, dtype: str, layout: str = "") -> Any:
    """``x`` as the backend's array: fresh and contiguous, or for a token array (ndim 4) in the
    strided ``layout`` from ``backend.asarray_strided`` (optional; NotImplementedError or its
    absence declines, reported as not implemented)."""
    if not layout or x.ndim != 4:
        return backend.asarray(x, dtype)
    strided = getattr(backend, "asarray_strided", None)
    if strided is None:
        raise NotOffered(f"strided inputs ({layout!r}): the adapter has no asarray_strided")
    try:
        return strided(x, dtype, layout)
    except NotImplementedError as exc:
        raise NotOffered(f"strided inputs ({layout!r}) declined by the adapter: {exc}") from None


def native_inputs(
    backend: Backend, case: Case, inputs: dict[str, np.ndarray], dtype: str
) -> dict[str, Any]:
    """The backend's arrays; each made from a copy, so nothing the backend does reaches the
    kit's own arrays. Token arrays come in the case's strided layout when it has one."""
    spec = OPS[case.op]
    return {
        name: native_array(
            backend, x.copy(), wide_dtype(dtype) if name in spec.wide else dtype, case.layout
        )
        for name, x in inputs.items()
    }


def cotangents(case: Case, outputs: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Random cotangents of the differentiable outputs (``OPS[op].cotangents``), seeded by the
    case and rounded to ``dtype``, so the reference and the backend receive the same values."""
    rng = np.random.default_rng(case.seed + 1)
    names = OPS[case.op].cotangents
    return {n: round_to(rng.standard_normal(outputs[n].shape), dtype) for n in names}


Arrays = dict[str, NDArray[np.float64]]


def reference_for(case: Case, dtype: str) -> tuple[Arrays, Arrays]:
    """(rounded inputs, reference outputs) of ``case`` at ``dtype``."""

    def compute() -> tuple[Arrays, Arrays]:
        inputs = rounded_inputs(case, dtype)
        return inputs, reference_outputs(case, inputs)

    return REFERENCE_CACHE.get((case.id, case.seed, dtype, "output"), compute)


def reference_vjp_for(case: Case, dtype: str) -> tuple[Arrays, dict[str, np.ndarray]]:
    """(cotangents, reference input cotangents) of ``case`` at ``dtype``."""

    def compute() -> tuple[Arrays, dict[str, np.ndarray]]:
        inputs, outputs = reference_for(case, dtype)
        cot = cotangents(case, outputs, dtype)
        return cot, REFERENCE.vjp(case.op, inputs, case.params, cot)

    return REFERENCE_CACHE.get((case.id, case.seed, dtype, "gradient"), compute)


def call_sequence(seed: int) -> list[tuple[str, int]]:
    """A shuffled order of forwards and VJPs of two input sets (0 and 1), each call twice, in
    which each input set's VJP at least once directly follows a call on the other set: a
    backend that reuses what it saved for the last call of a shape cannot pass."""
    rng = np.random.default_rng(seed)
    calls = [(kind, which) for kind in ("output", "gradient") for which in (0, 1)] * 2
    while True:
        order = [calls[i] for i in rng.permutation(len(calls))]
        exposed = {
            which
            for (_, before), (kind, which) in pairwise(order)
            if kind == "gradient" and before != which
        }
        if exposed == {0, 1}:
            return order

"""Golden vectors: the generated cases with reference outputs and gradients, for any language.

Layout of a vector directory (format version 1, documented in docs/vectors.md):

- ``manifest.json``: format, versions, and one entry per (case, dtype) with the file name, its
  sha256, the op, its static params, the array names with shapes and dtypes, and the tolerances.
- one ``<case id with '/' -> '__'>.<dtype>.npz`` per entry, holding ``in.<name>`` (inputs already
  rounded to the dtype, stored as float64), ``out.<name>`` (reference outputs on those inputs),
  and for gradient cases ``cot.<name>`` (cotangents) and ``grad.<name>`` (reference VJP).

An implementation writes one ``.npz`` per entry, same file name, into a results directory, with
``out.<name>`` and optionally ``grad.<name>``; ``vectors check`` scores it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.npyio import NpzFile

from .calls import REFERENCE, cotangents, reference_outputs, rounded_inputs
from .cases import GENERATOR_VERSION, Case, generate_cases
from .metrics import Comparison, compare, compare_count, gradient_floors, row_ndim
from .protocol import OPS, Backend
from .tolerances import tolerance, wide_dtype

FORMAT = "attnspec-vectors"
FORMAT_VERSION = 1


def _json_param(value: object) -> object:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf" / "-inf": JSON has no infinities
    return value


def _param_from_json(value: object) -> object:
    if isinstance(value, list):
        return tuple(value)  # cu_seqlens
    return float(value) if value in ("inf", "-inf") else value


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def file_name(case_id: str, dtype: str) -> str:
    return f"{case_id.replace('/', '__')}.{dtype}.npz"


def export(
    directory: str,
    *,
    dtypes: Iterable[str] = ("float64", "float32"),
    ops: list[str] | None = None,
    prefixes: list[str] | None = None,
) -> dict[str, Any]:
    """Write vectors for every selected case and dtype; return the manifest."""
    os.makedirs(directory, exist_ok=True)
    entries = []
    for case in generate_cases(ops, prefixes):
        for dtype in dtypes:
            entries.append(_export_case(directory, case, dtype))
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "generator_version": GENERATOR_VERSION,
        "numpy": np.__version__,
        "cases": entries,
    }
    with open(os.path.join(directory, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    return manifest


def _export_case(directory: str, case: Case, dtype: str) -> dict[str, Any]:
    spec = OPS[case.op]
    inputs = rounded_inputs(case, dtype)
    outs = reference_outputs(case, inputs)
    arrays = {f"in.{n}": x for n, x in inputs.items()}
    arrays.update({f"out.{n}": np.asarray(x, dtype=np.float64) for n, x in outs.items()})
    tolerances = {n: tolerance(case.op, dtype, q) for n, q in spec.outputs}
    if case.gradient:
        cot = cotangents(case, outs, dtype)
        grads = REFERENCE.vjp(case.op, inputs, case.params, cot)
        arrays.update({f"cot.{n}": c for n, c in cot.items()})
        arrays.update({f"grad.{n}": np.asarray(grads[n], np.float64) for n in spec.differentiable})
        tolerances["gradient"] = tolerance(case.op, dtype, "gradient")
    name = file_name(case.id, dtype)
    path = os.path.join(directory, name)
    np.savez(path, **arrays)  # type: ignore[arg-type]  # mypy matches **arrays to allow_pickle
    return {
        "id": case.id,
        "op": case.op,
        "dtype": dtype,
        "file": name,
        "sha256": _sha256(path),
        "seed": case.seed,
        "note": case.note,
        "params": {k: _json_param(v) for k, v in case.params.items()},
        "arrays": {n: {"shape": list(x.shape), "dtype": "float64"} for n, x in arrays.items()},
        "tolerances": tolerances,
    }


@dataclass
class VectorResult:
    id: str
    dtype: str
    verdict: str  # passed | failed | not implemented
    message: str = ""
    worst_ratio: float = 0.0


def load_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "manifest.json")
    if not os.path.isfile(path):
        raise ValueError(f"vectors: no manifest.json in {directory!r}")
    with open(path) as fh:
        manifest = json.load(fh)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"vectors: {path} is not {FORMAT} version {FORMAT_VERSION}")
    return manifest


def check(directory: str, results: str) -> list[VectorResult]:
    """Score the outputs in ``results`` against the vectors in ``directory``."""
    manifest = load_manifest(directory)
    if not os.path.isdir(results):
        raise ValueError(f"results: no such directory {results!r}")
    verdicts = []
    for entry in manifest["cases"]:
        vector_path = os.path.join(directory, entry["file"])
        if _sha256(vector_path) != entry["sha256"]:
            verdicts.append(
                VectorResult(
                    entry["id"], entry["dtype"], "failed", f"checksum mismatch for {entry['file']}"
                )
            )
            continue
        result_path = os.path.join(results, entry["file"])
        if not os.path.isfile(result_path):
            verdicts.append(
                VectorResult(
                    entry["id"], entry["dtype"], "not implemented", f"no {entry['file']} in results"
                )
            )
            continue
        verdicts.append(_score(entry, np.load(vector_path), np.load(result_path)))
    return verdicts


def _score(entry: dict[str, Any], vector: NpzFile, result: NpzFile) -> VectorResult:
    """The runner's comparisons: rows, gradient floors and the kept fraction as a count."""
    comparisons: dict[str, Comparison] = {}
    grads = {k[5:]: vector[k] for k in vector.files if k.startswith("grad.")}
    floors = gradient_floors(grads) if grads else {}
    for key in vector.files:
        kind, _, name = key.partition(".")
        if kind not in ("out", "grad"):
            continue
        tol = entry["tolerances"]["gradient" if kind == "grad" else name]
        if key not in result.files:
            if kind == "grad":
                continue  # gradients are optional in results
            comparisons[key] = Comparison(math.inf, tol, math.inf, (), "missing from results")
        elif name == "kept_fraction":
            q = vector["in.q"]
            total = q.shape[-2] * int(np.prod(q.shape[:-2]))
            comparisons[key] = compare_count(result[key], float(vector[key]), total, tol)
        else:
            comparisons[key] = compare(
                result[key],
                vector[key],
                tol,
                row_ndim=row_ndim(name),
                floor=floors.get(name, 0.0) if kind == "grad" else 0.0,
            )
    failed = {k: c for k, c in comparisons.items() if not c.passed}
    worst = max((c.ratio for c in comparisons.values()), default=0.0)
    if failed:
        message = "; ".join(f"{k}: {c.describe()}" for k, c in failed.items())
        return VectorResult(entry["id"], entry["dtype"], "failed", message, worst)
    return VectorResult(entry["id"], entry["dtype"], "passed", "", worst)


def write_results_from_backend(directory: str, results: str, backend: Backend) -> None:
    """Produce a results directory with a Python backend (used to test the format end to end)."""
    from .protocol import call_op

    manifest = load_manifest(directory)
    os.makedirs(results, exist_ok=True)
    for entry in manifest["cases"]:
        data = np.load(os.path.join(directory, entry["file"]))
        spec = OPS[entry["op"]]
        params = {k: _param_from_json(v) for k, v in entry["params"].items()}
        inputs = {k[3:]: data[k] for k in data.files if k.startswith("in.")}
        dtype = entry["dtype"]
        native = {
            n: backend.asarray(x, wide_dtype(dtype) if n in spec.wide else dtype)
            for n, x in inputs.items()
        }
        outs = call_op(backend, entry["op"], native, params)
        arrays = {f"out.{n}": np.asarray(backend.to_numpy(v)) for n, v in outs.items()}
        cots = {k[4:]: backend.asarray(data[k], dtype) for k in data.files if k.startswith("cot.")}
        if cots:
            grads = backend.vjp(entry["op"], native, params, cots)
            arrays.update({f"grad.{n}": backend.to_numpy(g) for n, g in grads.items()})
        np.savez(os.path.join(results, entry["file"]), **arrays)  # type: ignore[arg-type]  # as above

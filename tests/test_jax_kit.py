"""The conformance kit on the ``jax`` and ``pallas`` backends, through its command line.

CI budget [decision]: the first case of every family (which reaches every family, op and check)
in float32 on ``jax`` and ``pallas``. Every run is a subprocess with XLA:CPU's quick compilation
settings (each kit case is a new shape, so compilation dominates). ``make verify`` (``attnspec
verify``), which CI runs after ``make test``, adds every float32 case on ``jax``, the same
subset in float64 and bfloat16 on ``jax`` and in bfloat16 on ``pallas`` (float16 takes the
bfloat16 path: loads widened to float32); the full runs on all four dtypes are ``make verify
FULL=1`` (``attnspec conformance --backend jax`` and ``--backend pallas``).
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from attnspec.conformance import cases
from attnspec.conformance.cli import QUICK_XLA
from attnspec.conformance.registry import get_backend

RUNS = [("jax", ("float32",)), ("pallas", ("float32",))]


def first_of_each_family(backend: str) -> list[str]:
    ops = list(get_backend(backend).OPS)
    return [i for i in cases.case_ids(ops) if i.endswith("/0")]


@pytest.mark.verify_kit
@pytest.mark.parametrize("backend, dtypes", RUNS)
def test_kit_passes(backend, dtypes):
    command = [sys.executable, "-m", "attnspec.conformance", "--backend", backend]
    command += ["--dtypes", *dtypes, "--cases", *first_of_each_family(backend)]
    command += ["--no-unclaimed"]  # the items outside the claims: tests/test_report_schema.py
    env = {**os.environ, "XLA_FLAGS": QUICK_XLA, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " 0 failed" in summary, summary


def test_adapter_keeps_dtypes_and_the_process_settings():
    """bfloat16 results are named bfloat16 and widen exactly; float64 works inside the adapter
    while the process-wide x64 setting stays as it was."""
    backend = get_backend("jax")
    before = jax.config.jax_enable_x64
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 2, 5, 4))
    field = np.cumsum(rng.standard_normal((1, 2, 5)), axis=-1)
    for dtype in ("float64", "bfloat16"):
        wide = "float64" if dtype == "float64" else "float32"
        x = [backend.asarray(a, dtype) for a in (q, k, v)]
        o, lse = backend.fpa_attention(
            *x, *(backend.asarray(field, wide) for _ in range(2)), return_lse=True
        )
        assert backend.dtype_name(o) == dtype
        assert backend.dtype_name(lse) == wide
        widened = backend.to_numpy(o)
        assert widened.dtype == np.dtype(wide)
        if dtype == "bfloat16":  # every bfloat16 value is a float32 value: widened exactly
            bits = widened.view(np.uint32)
            assert np.all(bits & 0xFFFF == 0)
    assert jax.config.jax_enable_x64 == before
    assert backend.capabilities() >= {
        "fpa_attention.gqa",
        "interdomain_s4d.varlen",
        "fpa_layer",
        "fpa_decode",
    }
    assert get_backend("pallas").capabilities() == {
        f"{op}{suffix}"
        for op in ("fpa_attention", "fox_attention")
        for suffix in ("", ".vjp", ".varlen", ".gqa")
    }


def test_compiled_programs_stay_within_the_budget(monkeypatch):
    """The adapters clear JAX's caches after PROGRAM_BUDGET distinct programs (each compiled
    program keeps its code mapped; a process has a bounded number of maps), and the results
    after a clear are still the reference's."""
    from attnspec.backends.jax import compile_budget, kit
    from attnspec.conformance import runner

    monkeypatch.setattr(compile_budget, "PROGRAM_BUDGET", 2)
    monkeypatch.setattr(compile_budget, "programs", set())
    ids = ["fpa/shapes/0", "fpa/headdim/0", "fox/shapes/0", "fpa/shapes/0"]
    seen = []
    original = compile_budget.count_program

    def watch(*args):
        original(*args)
        seen.append((len(compile_budget.programs), kit._joint._cache_size()))

    monkeypatch.setattr(compile_budget, "count_program", watch)
    report = runner.run(get_backend("jax"), [cases.build_case(i) for i in ids], ["float32"])
    assert all(r.verdict == "passed" for r in report.results), report.results
    assert max(n for n, _ in seen) <= 2
    assert any(size == 0 for _, size in seen[1:])  # a clear happened before a compilation


def test_the_subsets_reach_every_op_and_family():
    for backend in ("jax", "pallas"):
        ids = first_of_each_family(backend)
        ops = set(get_backend(backend).OPS)
        assert {cases.build_case(i).op for i in ids} == ops
        families = {i.rsplit("/", 1)[0] for i in cases.case_ids(sorted(ops))}
        assert {i.rsplit("/", 1)[0] for i in ids} == families

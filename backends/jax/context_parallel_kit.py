"""The conformance kit's adapter for the JAX context-parallel ops
(attnspec.conformance.context_parallel): the jobs run in a child process with forced host devices
(context_parallel_launch.py), one jitted program per job."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .context_parallel import DEFAULT, Sharding, fox_attention, fpa_attention, interdomain_s4d
from .context_parallel_launch import run_on_host_devices

# the sharded attention ops by name; their arguments are the op table's inputs
ATTENTION: dict[str, Callable[..., Any]] = {
    "fpa_attention": fpa_attention,
    "fox_attention": fox_attention,
}


def run_jobs(jobs: list[Any], world: int, sharding: Sharding = DEFAULT) -> list[Any]:
    """Run kit jobs on the first ``world`` devices of this process (enough devices needed):
    one jitted program per job computes the outputs and the vjp of the cotangents."""
    from attnspec.conformance.context_parallel import JobResult

    devices = jax.devices()
    if len(devices) < world:
        raise ValueError(f"world: {world} devices needed, this process has {len(devices)}")
    mesh = Mesh(np.array(devices[:world]), ("seq",))
    results = []
    with jax.enable_x64(True):
        for job in jobs:
            try:
                results.append(_run_job(job, mesh, sharding))
            except ValueError as exc:
                results.append(JobResult(error=f"ValueError: {exc}"))
    return results


def _run_job(job: Any, mesh: Mesh, sharding: Sharding) -> Any:
    from attnspec.conformance.context_parallel import JobResult
    from attnspec.conformance.protocol import OPS

    spec = OPS[job.op]
    dt = {"float64": jnp.float64, "float32": jnp.float32}[job.dtype]
    wide = jnp.float64 if job.dtype == "float64" else jnp.float32
    names = list(job.inputs)
    per_token = {"q", "k", "v", "field", "level", "log_f", "fq", "kt", "vt"}
    params = dict(job.params)

    def public(name: str, x: np.ndarray) -> jax.Array:
        kind = dt if name in ("q", "k", "v", "fq", "kt", "vt") else wide
        return jnp.asarray(np.swapaxes(x, 1, 2) if name in per_token else x, kind)

    def op(*xs: jax.Array) -> dict[str, jax.Array]:
        a = dict(zip(names, xs, strict=True))
        common: dict[str, Any] = dict(
            mesh=mesh, cu_seqlens=params.get("cu_seqlens"), sharding=sharding
        )
        if job.op == "interdomain_s4d":
            lam, b, c = (a[f"{n}_re"] + 1j * a[f"{n}_im"] for n in ("lam", "b", "c"))
            readout = params.get("readout", "linear")
            return {
                "o": interdomain_s4d(
                    a["fq"], a["kt"], a["vt"], lam, b, c, readout=readout, **common
                )
            }
        result = ATTENTION[job.op](
            *(a[n] for n in spec.inputs),
            layout=job.layout,
            scale=params.get("scale"),
            **common,
            **dict(spec.call_options),
        )
        outputs = [n for n, _ in spec.outputs]
        return dict(zip(outputs, result if len(outputs) > 1 else (result,), strict=True))

    @jax.jit
    def both(xs: tuple[jax.Array, ...], cot: dict[str, jax.Array]) -> Any:
        out, vjp = jax.vjp(op, *xs)
        return out, vjp(cot)

    xs = tuple(public(n, job.inputs[n]) for n in names)
    cot = {
        n: jnp.asarray(np.swapaxes(c, 1, 2), dt if n == "o" else wide)
        for n, c in job.cotangents.items()
    }
    out, grads = both(xs, cot)

    def back(x: jax.Array, token_axis: bool) -> np.ndarray:
        y = np.asarray(x, np.float64)
        return np.swapaxes(y, 1, 2) if token_axis else y

    return JobResult(
        {n: back(x, token_axis=True) for n, x in out.items()},
        {n: back(g, token_axis=n in per_token) for n, g in zip(names, grads, strict=True)},
    )


def _kit_main(path_in: str, path_out: str) -> None:
    import pickle

    with open(path_in, "rb") as fh:
        jobs, world = pickle.load(fh)
    results = run_jobs(jobs, world)
    with open(path_out, "wb") as fh:
        pickle.dump(results, fh)


class KitBackend:
    """The JAX context-parallel ops as the kit's ``run_sharded`` backend: a child process with
    ``world`` forced host devices (XLA reads the device count once, at start)."""

    name = "jax-cp"

    def __init__(self, timeout: float = 1800.0) -> None:
        self.timeout = timeout

    def capabilities(self) -> set[str]:
        return {
            f"{op}.context_parallel" for op in ("fpa_attention", "fox_attention", "interdomain_s4d")
        }

    def run_sharded(self, jobs: list[Any], world: int) -> list[Any]:
        return list(
            run_on_host_devices(f"{__name__}:_kit_main", (jobs, world), world, self.timeout)
        )

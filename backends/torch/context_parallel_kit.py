"""The conformance kit's adapter for the torch context-parallel ops
(attnspec.conformance.context_parallel): each job runs on ``world`` gloo processes on this machine
(context_parallel_launch.py), the eager kernels underneath."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .context_parallel import (
    DEFAULT,
    Sharding,
    all_gather,
    fox_attention,
    fpa_attention,
    interdomain_s4d,
    shard_sequence,
    unshard_sequence,
)
from .context_parallel_launch import spawn

# the sharded attention ops by name; their arguments are the op table's inputs
ATTENTION: dict[str, Callable[..., Any]] = {
    "fpa_attention": fpa_attention,
    "fox_attention": fox_attention,
}

_PER_TOKEN = ("q", "k", "v", "field", "level", "log_f", "fq", "kt", "vt")
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def run_job(
    job: Any, sharding: Sharding = DEFAULT, group: Any = None, impl: str = "eager"
) -> dict[str, Any]:
    """One kit job on this rank: shard the canonical inputs, run the op, backpropagate the
    cotangents; returns the full outputs and gradients (gathered, canonical, NumPy)."""
    import numpy as np

    from attnspec.conformance.protocol import OPS
    from attnspec.conformance.tolerances import wide_dtype

    group = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    spec = OPS[job.op]
    layout = job.layout

    def tensor(name: str, x: Any) -> Tensor:
        t = torch.from_numpy(np.ascontiguousarray(x))
        # the kit's rule: wide inputs (field, level, gates, SSM parameters) in float32 or wider
        t = t.to(_DTYPES[wide_dtype(job.dtype) if name in spec.wide else job.dtype])
        if name in _PER_TOKEN:
            t = shard_sequence(t.transpose(1, 2), rank, world, layout=layout).contiguous()
        return t.requires_grad_(True)

    x = {name: tensor(name, val) for name, val in job.inputs.items()}
    params = dict(job.params)
    common: dict[str, Any] = dict(
        group=group, cu_seqlens=params.get("cu_seqlens"), impl=impl, sharding=sharding
    )
    if job.op == "interdomain_s4d":
        lam, b, c = (torch.complex(x[f"{n}_re"], x[f"{n}_im"]) for n in ("lam", "b", "c"))
        readout = params.get("readout", "linear")
        result = interdomain_s4d(x["fq"], x["kt"], x["vt"], lam, b, c, readout=readout, **common)
    else:
        result = ATTENTION[job.op](
            *(x[n] for n in spec.inputs),
            layout=layout,
            scale=params.get("scale"),
            **common,
            **dict(spec.call_options),
        )
    names = [n for n, _ in spec.outputs]
    outs = dict(zip(names, result if len(names) > 1 else (result,), strict=True))
    loss = sum(
        (
            out
            * shard_sequence(
                torch.from_numpy(job.cotangents[n]).to(out.dtype).transpose(1, 2),
                rank,
                world,
                layout=layout,
            )
        ).sum()
        for n, out in outs.items()
    )
    assert isinstance(loss, Tensor)
    loss.backward()

    def full(t: Tensor, per_token: bool) -> Any:
        t = t.detach()
        if per_token:
            t = unshard_sequence(all_gather(t.contiguous(), group), layout=layout).transpose(1, 2)
        else:
            t = t.clone()
            dist.all_reduce(t, group=group)
        return t.to(torch.float64).numpy()

    outputs = {n: full(o, per_token=True) for n, o in outs.items()}
    grads = {
        n: full(t.grad if t.grad is not None else torch.zeros_like(t), per_token=n in _PER_TOKEN)
        for n, t in x.items()
    }
    return {"outputs": outputs, "grads": grads}


def _kit_worker(
    rank: int,
    world: int,
    path: str,
    variants: dict[str, tuple[Sharding, list[Any]]],
    impl: str = "eager",
) -> None:
    import pickle

    results: dict[str, list[Any]] = {}
    for name, (sharding, jobs) in variants.items():
        results[name] = []
        for job in jobs:
            try:
                results[name].append(("", run_job(job, sharding, impl=impl)))
            except ValueError as exc:  # raised alike on every rank (see agree)
                results[name].append((f"ValueError: {exc}", {}))
    if rank == 0:
        with open(path, "wb") as fh:
            pickle.dump(results, fh)


class KitBackend:
    """The torch context-parallel ops as the kit's ``run_sharded`` backend: ``world`` gloo
    processes on this machine, the eager kernels underneath."""

    name = "torch-cp"

    def __init__(
        self, sharding: Sharding = DEFAULT, timeout: float = 300.0, impl: str = "eager"
    ) -> None:
        self.sharding, self.timeout, self.impl = sharding, timeout, impl

    def capabilities(self) -> set[str]:
        return {
            f"{op}.context_parallel" for op in ("fpa_attention", "fox_attention", "interdomain_s4d")
        }

    def run_sharded(self, jobs: list[Any], world: int) -> list[Any]:
        return self.run_variants(world, {"": (self.sharding, jobs)})[""]

    def run_variants(
        self, world: int, variants: dict[str, tuple[Sharding, list[Any]]]
    ) -> dict[str, list[Any]]:
        """Jobs under several sharding strategies (wrong ones included), in one launch:
        ``variants`` maps a name to (strategy, jobs); returns the results by name."""
        import pickle
        import tempfile

        from attnspec.conformance.context_parallel import JobResult

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "results.pkl")
            spawn(_kit_worker, world, path, variants, self.impl, timeout=self.timeout)
            with open(path, "rb") as fh:
                raw = pickle.load(fh)
        return {
            name: [JobResult(r.get("outputs", {}), r.get("grads", {}), err) for err, r in rows]
            for name, rows in raw.items()
        }

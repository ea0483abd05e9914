"""A local process launcher for ``torch.distributed``: ``world`` processes on this machine
joined in one process group (gloo by default), for the tests, the conformance kit's
context-parallel adapter (context_parallel_kit.py) and the CPU benchmarks."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    rank: int, fn: Any, world: int, port: int, backend: str, timeout: float, args: tuple[Any, ...]
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )
    fn(rank, world, *args)
    dist.barrier()  # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()


def spawn(fn: Any, world: int, *args: Any, timeout: float = 120.0, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` local processes joined in a process group.

    ``fn`` must be importable (a module-level function). A process that raises makes this raise
    with its traceback; past ``timeout`` seconds every process is killed and TimeoutError is
    raised, so a deadlock never hangs the caller. Collectives time out after ``timeout`` too.
    """
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, port, backend, timeout, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )

    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"spawn: {world} processes still running after {timeout} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

"""Triton launches captured instead of run, for the static Hopper gates (bench/gpu_static.py,
bench/gpu_static_interdomain.py, bench/gpu_static_decode.py).

Inside ``with capture() as launches:`` the launchers (ours and flash-linear-attention's) run on
CPU tensors and every kernel launch is recorded, not run: the kernel, its arguments by name
(what the launcher passed, then the kernel's defaults), the grid and the launch options. The
arguments are the launcher's own tensors, so :attr:`Captured.launch` compiles (bench/sm90.py)
with the alignment, constexprs and integer specialisation a launch on the GPU gets. A keyword
that is neither a parameter of the kernel nor a launch option raises the ``KeyError`` that
Triton raises at a GPU launch (its interpreter accepts such keywords).

fla picks its tiles and autotune lists from the device when its modules load:
:func:`fla_as_on_hopper` gives it the Hopper answer first. Autotuned kernels take the config
nearest to :data:`FLA_CONFIG` instead of benchmarking.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

FLA_CONFIG = {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 2}


@dataclass
class Captured:
    """One kernel launch as the launcher made it: every argument by name, the grid and the
    launch options."""

    fn: Any  # the JITFunction
    args: dict[str, Any]
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    role: str = ""  # the pass it belongs to ("fwd", "bwd", "step")
    impl: str = ""  # what launched it ("FPA", "S4D", "chunk_gla", a tiling variant, ...)

    @property
    def name(self) -> str:
        return str(self.fn.__name__)

    @property
    def programs(self) -> int:
        n = 1
        for g in self.grid:
            n *= int(g)
        return n

    @property
    def launch(self) -> Any:
        """The compile request of this launch (an ``sm90.Launch``)."""
        from bench import sm90

        return sm90.Launch(self.fn, self.args, self.num_warps, self.num_stages, self.name)


def launch_options() -> set[str]:
    """The keywords a launch takes besides the kernel's parameters (Triton's CUDA options)."""
    import dataclasses

    from triton.backends.nvidia.compiler import CUDAOptions

    return {f.name for f in dataclasses.fields(CUDAOptions)}


@contextlib.contextmanager
def capture() -> Iterator[list[Captured]]:
    """Record every Triton launch inside the block instead of running it (compiled or
    interpreted kernels alike); autotuned kernels take the config nearest to
    :data:`FLA_CONFIG` (no benchmarking)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[Captured] = []
    options = launch_options()

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        params = inspect.signature(self.fn).parameters
        unknown = [k for k in kwargs if k not in params and k not in options]
        if unknown:  # as JITFunction.run on a GPU
            raise KeyError(
                f"{self.__name__}: keyword argument {unknown[0]} was specified but unrecognised"
            )
        num_warps = kwargs.pop("num_warps", 4)
        num_stages = kwargs.pop("num_stages", 3)
        bound = dict(zip(params, args, strict=False))
        bound |= {k: v for k, v in kwargs.items() if k in params}
        for name, p in params.items():
            if name not in bound and p.default is not inspect.Parameter.empty:
                bound[name] = p.default
        g = grid(bound) if callable(grid) else grid
        g = tuple(int(x) for x in (g if isinstance(g, tuple | list) else (g,)))
        launches.append(Captured(self, bound, g, num_warps, num_stages))

    def autotuned(self: Any, *args: Any, **kwargs: Any) -> Any:
        def distance(c: Any) -> int:
            got = c.all_kwargs()
            return sum((1 + (k[0] == "B")) * (got.get(k, v) != v) for k, v in FLA_CONFIG.items())

        config = min(self.configs, key=distance)
        return self.fn.run(*args, **(kwargs | config.all_kwargs()))

    saved = JITFunction.run, InterpretedFunction.run, Autotuner.run
    JITFunction.run = InterpretedFunction.run = run  # type: ignore[method-assign]
    Autotuner.run = autotuned  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.run, InterpretedFunction.run, Autotuner.run = saved  # type: ignore[method-assign]


def fla_as_on_hopper() -> None:
    """fla picks its tiles and autotune lists at import from the device's shared memory: give it
    the Hopper answer (before fla.ops is imported; a second call finds it given)."""
    import fla.utils

    if fla.utils.check_shared_mem is _on_hopper:
        return
    if any(m.startswith("fla.ops") for m in sys.modules):
        raise RuntimeError("launches: fla.ops was imported before the Hopper setup")
    fla.utils.check_shared_mem = _on_hopper
    fla.utils.IS_NVIDIA_HOPPER = True


def _on_hopper(*args: Any, **kwargs: Any) -> bool:
    return True

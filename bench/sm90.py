"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU and read the binary.

The reusable core of the static GPU gates (bench/gpu_static*.py). A kernel is compiled as a
launch with given arguments would compile it: ``Launch(fn, args, num_warps, num_stages)`` names
every argument with a value the launch would pass (a tensor for a pointer, an int, a float, None,
or the value of a constexpr; the gates take them from launches captured by bench/launches.py);
each value is specialised by Triton's own rule (``native_specialize_impl``: pointers and ints
that are multiples of 16 get ``tt.divisibility = 16``, ints equal to 1 and None become
constants, ``do_not_specialize`` respected). Then :func:`compile_launch` builds it for
``GPUTarget("cuda", 90, 32)`` and :func:`analyse` reads the cubin with the ``cuobjdump`` of
Triton's wheel:

- dynamic shared memory the launch asks for, registers, stack bytes per thread;
- tensor-core instructions: ``HGMMA`` (wgmma) and ``HMMA`` (mma.sync) counts;
- loop bodies of the SASS: the span from a backward branch's target to the branch, with the
  instruction count of one iteration and its opcode counts (``STL``/``LDL``: spill traffic).

Usage from another file::

    from bench import sm90
    report = sm90.analyse(sm90.compile_launch(sm90.Launch(kernel, args, num_warps=8)))
    off, diag = sm90.mma_loops(report)  # outermost loops holding a tensor-core instruction

Numbers are deterministic for a given Triton version (its LLVM and ptxas). The H100/H200 block
limit of dynamic shared memory is :data:`SHARED_LIMIT` bytes. No CUDA install or GPU is needed;
``TRITON_INTERPRET`` must be unset before triton is imported (the interpreter replaces
``@triton.jit``).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

SHARED_LIMIT = 232_448  # bytes: the per-block opt-in maximum of H100 and H200 (227 KiB)
TARGET = ("cuda", 90, 32)
DEFAULT_STAGES = 3  # Triton's default num_stages on CUDA
TENSOR_CORE = ("HGMMA", "HMMA")


@dataclass(frozen=True)
class Launch:
    """One compile request: ``args`` maps every parameter of ``fn`` to the value a launch passes
    (tensors for pointers, as :class:`bench.launches.Captured` holds them). ``fn`` may be an
    autotune/heuristics wrapper."""

    fn: Any
    args: dict[str, Any]
    num_warps: int
    num_stages: int = DEFAULT_STAGES
    name: str = ""


@dataclass
class Loop:
    """A loop body of the SASS: instructions from ``start`` to the backward branch at ``end``."""

    start: int
    end: int
    instructions: int
    opcodes: collections.Counter[str]
    depth: int = 0  # 0: outermost

    @property
    def mma(self) -> int:
        return sum(self.opcodes[o] for o in TENSOR_CORE)

    def count(self, *prefixes: str) -> int:
        return sum(n for op, n in self.opcodes.items() if op.startswith(prefixes))


@dataclass
class Report:
    """What the binary of one launch asks for and executes."""

    name: str
    shared: int
    registers: int
    stack: int
    instructions: int
    opcodes: collections.Counter[str]
    loops: list[Loop] = field(default_factory=list)

    @property
    def hgmma(self) -> int:
        return self.opcodes["HGMMA"]

    @property
    def hmma(self) -> int:
        return self.opcodes["HMMA"]

    @property
    def spills(self) -> tuple[int, int]:
        """(STL, LDL) instructions in the whole kernel."""
        return self.opcodes["STL"], self.opcodes["LDL"]


def _jit_function(fn: Any) -> Any:
    while not hasattr(fn, "arg_names") or not hasattr(fn, "params"):
        fn = fn.fn  # Autotuner / Heuristics wrap the JITFunction
    return fn


def specialise(launch: Launch) -> tuple[dict[str, str], dict[str, Any], dict[tuple, list]]:
    """(signature, constexprs, attrs) of the launch, by Triton's rule for launch arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    fn = _jit_function(launch.fn)
    missing = [n for n in fn.arg_names if n not in launch.args]
    extra = [n for n in launch.args if n not in fn.arg_names]
    if missing or extra:
        raise ValueError(f"{fn.__name__}: arguments missing {missing}, unknown {extra}")
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = launch.args[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        specialize = not param.do_not_specialize
        align = not param.do_not_specialize_on_alignment
        kind, desc = native_specialize_impl(CUDABackend, value, False, specialize, align)
        if kind == "constexpr":
            signature[param.name], constexprs[param.name] = "constexpr", desc
            continue
        if isinstance(value, float) or isinstance(value, bool):
            desc = None  # Triton does not specialise non-constexpr floats and bools
        signature[param.name] = kind
        if desc:
            attrs[(i,)] = CUDABackend.parse_attr(desc)
    return signature, constexprs, attrs


def compile_launch(launch: Launch) -> Any:
    """Compile for sm_90; raises what Triton raises (a failed compile is a failure)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        raise RuntimeError("sm90: unset TRITON_INTERPRET before triton is imported")
    signature, constexprs, attrs = specialise(launch)
    fn = _jit_function(launch.fn)
    source = triton.compiler.ASTSource(
        fn=fn, signature=signature, constexprs=constexprs, attrs=attrs
    )
    target = GPUTarget(*TARGET)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    return triton.compile(source, target=target, options=options)


def tool(name: str) -> str:
    """Path of a CUDA tool shipped in Triton's wheel (cuobjdump, nvdisasm, ptxas)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_SASS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"\b0x([0-9a-f]+)\b")


def _sass_lines(cubin: bytes) -> tuple[str, list[tuple[int, str]]]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [tool("cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        sass = subprocess.run(
            [tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    lines = []
    for line in sass.splitlines():
        match = _SASS.match(line)
        if match:
            lines.append((int(match.group(1), 16), match.group(2)))
    return usage, lines


def _opcode(text: str) -> str:
    """The opcode of a SASS instruction without its predicate and modifiers (HGMMA, LDG, BRA)."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse_sass(lines: list[tuple[int, str]]) -> tuple[collections.Counter[str], list[Loop]]:
    """Opcode counts of the kernel and its loop bodies (backward branches), outermost first by
    address; ``depth`` counts the loops that enclose a body."""
    opcodes = collections.Counter(_opcode(t) for _, t in lines)
    index = {addr: n for n, (addr, _) in enumerate(lines)}
    spans = []
    for n, (addr, text) in enumerate(lines):
        if _opcode(text) != "BRA":
            continue
        target = _TARGET.search(text.split("BRA", 1)[1])
        if target is None:
            continue
        to = int(target.group(1), 16)
        if to <= addr and to in index:
            spans.append((index[to], n))
    loops = []
    for a, b in spans:
        body = collections.Counter(_opcode(t) for _, t in lines[a : b + 1])
        depth = sum(1 for c, d in spans if (c, d) != (a, b) and c <= a and b <= d)
        loops.append(Loop(lines[a][0], lines[b][0], b - a + 1, body, depth))
    loops.sort(key=lambda lp: (lp.start, -lp.end))
    return opcodes, loops


def _usage(text: str) -> dict[str, int]:
    fields = {}
    for item in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", text):
        fields.setdefault(item[0], int(item[1]))
    return fields


def analyse(compiled: Any, name: str = "") -> Report:
    """Resources, tensor-core instructions and loop bodies of a compiled kernel."""
    usage, lines = _sass_lines(compiled.asm["cubin"])
    fields = _usage(usage)
    opcodes, loops = parse_sass(lines)
    return Report(
        name=name or compiled.metadata.name,
        shared=int(compiled.metadata.shared),
        registers=fields.get("REG", -1),
        stack=fields.get("STACK", -1),
        instructions=len(lines),
        opcodes=opcodes,
        loops=loops,
    )


def mma_loops(report: Report) -> list[Loop]:
    """The outermost loops that hold a tensor-core instruction, in address order (for a flash
    attention kernel: its key or query loops, in source order)."""
    return [lp for lp in report.loops if lp.mma and not _enclosed(lp, report.loops)]


def _enclosed(loop: Loop, loops: list[Loop]) -> bool:
    return any(
        o is not loop and o.start <= loop.start and loop.end <= o.end and o.mma for o in loops
    )


def build(launch: Launch) -> Report:
    """compile_launch + analyse."""
    return analyse(compile_launch(launch), launch.name)

"""The kit's commands: ``attnspec verify``, ``attnspec conformance`` and ``attnspec vectors``
(the ``attnspec`` command itself, which adds ``theory``, is :mod:`attnspec.cli`).

Exit status: 0 all passed, 1 some case failed, 2 a usage error (bad arguments, a backend that
does not load, a dtype it does not declare), 141 the reader of the output went away (``| head``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from importlib import metadata
from importlib.util import find_spec
from typing import TYPE_CHECKING, TextIO

from .protocol import OPS, Backend
from .tolerances import DTYPES

if TYPE_CHECKING:  # the runner loads only when a command needs it
    from .cases import Case
    from .runner import CaseResult

BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a writer whose reader left

BACKEND_HELP = """which backend to check:
  numpy, torch, triton, jax,        a registered name
  pallas, mosaic
  package.module:attribute           a class, factory or object in an
                                     importable module
  path/to/file.py:attribute          the same in a Python file, loaded by
                                     its path
  numpy,path/to/mine.py:Mine         several, comma-separated; all are
                                     loaded and checked before any runs
  available                          every registered backend that loads
A class or factory is called with device=DEVICE."""


# The smoke subset: the first case of every family (ids ending in /0), in these dtypes (those the
# backend declares), outputs and VJPs. It reaches every family, op and check at a fraction of
# the cost; the Triton and Pallas kernels get it when they run under an interpreter.
SMOKE_DTYPES = ("float32", "bfloat16")
SMOKE_TEXT = "the first case of every family, in float32 and bfloat16, outputs and VJPs"
# Backends whose kernels run natively on a GPU and under an interpreter on CPU (Triton with
# TRITON_INTERPRET=1, Pallas with interpret=True), with the framework that says if a GPU is here.
KERNEL_BACKENDS = {"triton": "torch", "pallas": "jax", "mosaic": "jax"}
# The modules each framework backend needs (``attnspec verify`` leaves out those missing).
FRAMEWORKS = {
    "torch": ("torch",),
    "triton": ("torch", "triton"),
    "jax": ("jax",),
    "pallas": ("jax",),
    "mosaic": ("jax",),
}
FULL_RUN = "make verify FULL=1 (or: attnspec verify --full)"
# Backends that "available" leaves out where their kernels would be interpreted: Mosaic GPU's
# interpreter had done 83 of the smoke subset's 274 checks after 3.3 CPU-minutes (2026-12-03);
# named, they run like the others (--backend mosaic).
NAMED_ONLY_ON_CPU = ("mosaic",)


def quick_xla_flags(jaxlib_version: str | None = None) -> str:
    """XLA:CPU's quick compilation settings for a jaxlib (code generation effort only; the JAX
    tests use them too): the JAX kit's cost on a CPU is compiling a program per case, shape and
    dtype. ``--xla_cpu_use_fusion_emitters`` only below jaxlib 0.11, which aborts the process on
    it ("Unknown flag in XLA_FLAGS"). ``jaxlib_version``: the installed one when None (read from
    the package metadata: jax is not imported); no jaxlib installed gives the common flags."""
    common = "--xla_backend_optimization_level=0"
    if jaxlib_version is None:
        try:
            jaxlib_version = metadata.version("jaxlib")
        except metadata.PackageNotFoundError:
            return common
    major, minor = (int(part) for part in jaxlib_version.split(".")[:2])
    if (major, minor) < (0, 11):
        return "--xla_cpu_use_fusion_emitters=false " + common
    return common


QUICK_XLA = quick_xla_flags()
JAX_FULL = ("--dtypes", "float32")
JAX_SMOKE = ("--smoke", "--dtypes", "float64", "bfloat16")


def smoke_cases(cases: list[Case]) -> list[Case]:
    """The first case of every family among ``cases``."""
    return [case for case in cases if case.id.rpartition("/")[2] == "0"]


def smoke_dtypes(declared: tuple[str, ...]) -> list[str]:
    """float32 and bfloat16 where the backend declares them, else its first declared dtype."""
    return [d for d in SMOKE_DTYPES if d in declared] or list(declared[:1])


def version() -> str:
    from attnspec import __version__

    if __version__ == "unknown":
        return "unknown (attnspec is not installed: pip install . in its checkout)"
    return __version__


def quiet_on_broken_pipe(command: Callable[[], int]) -> int:
    """Run ``command``; when the reader of stdout goes away (``| head``), stop without a
    traceback and return BROKEN_PIPE."""
    try:
        status = command()
        sys.stdout.flush()  # a closed pipe surfaces here when the output is still buffered
        return status
    except BrokenPipeError:
        # Python flushes stdout again at exit; point it at /dev/null so that flush is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE


def _progress(stream: TextIO) -> Callable[[int, int, CaseResult], None]:
    """A one-line progress display on terminals; elsewhere (logs, pipes) one line per tenth of
    the run, with the time so far, so a long run is never silent for long."""
    if not stream.isatty():
        start = time.perf_counter()

        def log(n: int, total: int, result: CaseResult) -> None:
            if n * 10 // total > (n - 1) * 10 // total:
                seconds = time.perf_counter() - start
                stream.write(f"[{n:>5}/{total}] {n * 100 // total:>3}%  {seconds:.0f} s\n")
                stream.flush()

        return log

    def show(n: int, total: int, result: CaseResult) -> None:
        stream.write(f"\r[{n:>5}/{total}] {result.case_id:<32} {result.dtype:<8} {result.kind:<17}")
        if n == total:
            stream.write("\r" + " " * 70 + "\r")
        stream.flush()

    return show


def conformance_parser(prog: str = "attnspec conformance") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Check a backend's ops and gradients against the reference, case by case.",
        epilog="exit status: 0 all passed, 1 a case failed, 2 a usage error (bad arguments,\n"
        "a backend that does not load, a dtype it does not declare), 141 output closed early",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"attnspec {version()}",
        help="print attnspec's version and exit",
    )
    subject = p.add_mutually_exclusive_group(required=True)
    subject.add_argument("--backend", metavar="BACKEND", help=BACKEND_HELP)
    subject.add_argument(
        "--model",
        metavar="MODEL",
        help="instead of a backend, judge a transformers causal LM's\ncache: "
        "decoding with it must give the logits of the\nforward of the same tokens without it "
        "(docs/conformance.md)",
    )
    p.add_argument(
        "--model-config",
        nargs="+",
        metavar="KEY=VALUE",
        default=[],
        help="with --model: the configuration's keyword arguments\n(Python literals; "
        "e.g. hidden_size=32 num_hidden_layers=2)",
    )
    p.add_argument(
        "--model-seed",
        type=int,
        default=0,
        metavar="N",
        help="with --model: torch.manual_seed before the weights\nare drawn (default 0)",
    )
    p.add_argument(
        "--cache",
        metavar="FACTORY",
        help="with --model: module:attribute called with the model's\nconfiguration, giving "
        "the cache of each program\n(default: the cache the model makes itself)",
    )
    p.add_argument("--device", default="cpu", help="device string passed to the backend")
    p.add_argument(
        "--ops",
        nargs="+",
        choices=sorted(OPS),
        metavar="OP",
        help="only these ops: " + textwrap.fill(", ".join(sorted(OPS)), 60),
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        metavar="DTYPE",
        help=f"dtypes to test: {', '.join(DTYPES)};\neach one the backend declares "
        "(default: all it declares)",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        metavar="PREFIX",
        help="only case ids starting with one of these (e.g. fpa/ragged/2)",
    )
    p.add_argument(
        "--skips",
        nargs="+",
        metavar="FILE",
        default=[],
        help="extra skip files (<case-id prefix> [dtype]  # reason)",
    )
    p.add_argument(
        "--xfails",
        nargs="+",
        metavar="FILE",
        default=[],
        help="expected-failure files (the skip files' format): a listed item that fails is\n"
        "xfailed, one that passes is a failure (remove its entry)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"the smoke subset: {SMOKE_TEXT}\n(--dtypes, when given, replaces the two dtypes)",
    )
    p.add_argument(
        "--unclaimed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the first case of every family outside the\nbackend's claims: in each "
        "dtype it does not declare\n(unless --dtypes is given) and with each capability it\n"
        "does not claim; reported as 'unclaimed: passes' or\n'unclaimed: fails', never counted "
        "(default: on)",
    )
    p.add_argument("--no-gradients", action="store_true", help="outputs only")
    p.add_argument(
        "--finite-differences",
        choices=("auto", "on", "off"),
        default="auto",
        help="also check the reference VJP by central differences\n(auto: with the numpy backend)",
    )
    p.add_argument("--json", metavar="FILE", help="write the per-case JSON report")
    p.add_argument("--junit", metavar="FILE", help="write JUnit XML")
    p.add_argument("--list", action="store_true", help="list the selected case ids and exit")
    return p


class BackendError(ValueError):
    """A backend that loads but cannot be run as asked."""


def _protocol_members() -> list[str]:
    """The attributes of :class:`protocol.Backend`: its fields (properties), then its methods."""
    members = {n: v for n, v in vars(Backend).items() if not n.startswith("_")}
    fields = [n for n, v in members.items() if isinstance(v, property)]
    return [*fields, *(n for n, v in members.items() if callable(v))]


def _load_backend(name: str, device: str, requested: list[str] | None) -> Backend:
    from .registry import get_backend

    backend = get_backend(name, device)
    missing = [m for m in _protocol_members() if not hasattr(backend, m)]
    declares_vjp = "capabilities" in missing or any(
        c.endswith(".vjp") for c in backend.capabilities()
    )
    if "vjp" in missing and not declares_vjp:
        missing.remove("vjp")  # only a backend that declares gradients needs vjp
    if missing:
        raise BackendError(f"backend {name!r} lacks {', '.join(missing)} of the protocol")
    declared = tuple(backend.dtypes)
    unknown = [d for d in declared if d not in DTYPES]
    if not declared or unknown:
        raise BackendError(
            f"backend {name!r} declares dtypes {declared}; expected a non-empty tuple of "
            f"{', '.join(DTYPES)}"
        )
    undeclared = [d for d in requested or () if d not in declared]
    if undeclared:
        raise BackendError(
            f"--dtypes {' '.join(undeclared)}: backend {name!r} declares only {', '.join(declared)}"
        )
    return backend


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}, line {exc.lineno}"
        return f"SyntaxError: {exc.msg} ({where})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load_error(name: str, exc: Exception) -> str:
    """One line for a backend that did not load. The registry's own messages (unknown name,
    missing extra) and ours are already phrased for the user; anything else came from the
    backend's code and is shown with its type."""
    if isinstance(exc, BackendError) or str(exc).startswith("backend: "):
        return str(exc)
    hint = ""
    if isinstance(exc, TypeError) and "device" in str(exc):
        hint = " (a backend class or factory is called with device=...)"
    return f"backend {name!r} failed to load: {_one_line(exc)}{hint}"


def _report_path(path: str, backend: str, several: bool) -> str:
    if not several:
        return path
    stem, dot, ext = path.rpartition(".")
    safe = backend.replace(":", "_").replace("/", "_")
    return f"{stem}.{safe}.{ext}" if dot else f"{path}.{safe}"


def conformance_main(argv: list[str] | None = None, prog: str = "attnspec conformance") -> int:
    from .cases import generate_cases
    from .coverage_report import coverage_lines
    from .covering_cases import backend_capabilities
    from .registry import available_backends
    from .report import format_report, write_json, write_junit
    from .runner import probe_dtypes, run
    from .skips import SkipList, XfailList
    from .unclaimed import run_unclaimed, unclaimed_items

    args = conformance_parser(prog).parse_args(argv)
    if args.model is not None:
        from .model_runner import model_command

        return model_command(args, prog, _progress(sys.stderr))
    if args.model_config or args.model_seed or args.cache:
        print(f"{prog}: --model-config, --model-seed and --cache need --model", file=sys.stderr)
        return 2
    try:
        cases = generate_cases(args.ops, args.cases)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if args.cases and not cases:
        print(f"{prog}: --cases matched no case id", file=sys.stderr)
        return 2
    every = len(cases)
    if args.smoke:
        cases = smoke_cases(cases)
    if args.list:
        for case in cases:
            print(f"{case.id:<32} {case.op:<18} {case.note}")
        return 0
    if args.backend == "available":
        try:
            names = available_backends()
        except Exception as exc:  # a registered backend that raises something unexpected
            print(f"{prog}: --backend available: {_one_line(exc)}", file=sys.stderr)
            return 2
    else:
        names = [name.strip() for name in args.backend.split(",")]
    # Load and check every backend before running any, so a typo in the last name of a list
    # does not surface after an hour of the first.
    loaded, problems = [], []
    for name in names:
        try:
            backend = _load_backend(name, args.device, args.dtypes)
        except Exception as exc:  # anything a backend's import or constructor may raise
            problems.append(_load_error(name, exc))
            continue
        try:
            skips = SkipList.load(backend.name, args.skips)
            xfails = XfailList.load(backend.name, args.xfails)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        loaded.append((name, backend, skips, xfails))
    if problems:
        for problem in problems:
            print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    status = 0
    for name, backend, skips, xfails in loaded:
        dtypes = args.dtypes or (
            smoke_dtypes(tuple(backend.dtypes)) if args.smoke else list(backend.dtypes)
        )
        fd = args.finite_differences == "on" or (
            args.finite_differences == "auto" and backend.name == "numpy"
        )
        probes = [] if args.dtypes else probe_dtypes(backend)
        report = run(
            backend,
            cases,
            dtypes,
            backend_name=name,
            device=args.device,
            gradients=not args.no_gradients,
            finite_differences=fd,
            skips=skips,
            xfails=xfails,
            progress=_progress(sys.stderr),
            probes=probes,
        )
        if args.unclaimed:
            start = time.perf_counter()
            items = unclaimed_items(
                backend,
                cases,
                [*dtypes, *probes],
                other_dtypes=not args.dtypes,
                gradients=not args.no_gradients,
            )
            report.unclaimed = run_unclaimed(
                backend,
                items,
                backend_name=name,
                device=args.device,
                progress=_progress(sys.stderr),
            )
            report.seconds += time.perf_counter() - start
        if args.smoke:
            report.notes.append(
                f"smoke subset: {len(cases)} of {every} cases (the first of every "
                f"family) in {', '.join(dtypes)}; the full run drops --smoke"
            )
        elif not args.cases:
            report.notes.extend(coverage_lines(backend_capabilities(backend), cases))
        print(format_report(report))
        several = len(names) > 1
        if args.json:
            write_json(report, _report_path(args.json, name, several))
        if args.junit:
            write_junit(report, _report_path(args.junit, name, several))
        if not report.ok:
            status = max(status, 1)
    return status


def native_device(name: str) -> str:
    """Where a registered backend runs natively: the GPU for the Triton and Pallas kernels when
    their framework sees one, the CPU otherwise (where the kernels are interpreted)."""
    framework = KERNEL_BACKENDS.get(name)
    try:
        if framework == "torch":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        if framework == "jax":
            import jax

            return "cuda" if any(d.platform == "gpu" for d in jax.devices()) else "cpu"
    except (ImportError, RuntimeError):
        pass
    return "cpu"


class _Job:
    """One command of ``attnspec verify``, run as a child process with its output in a file."""

    def __init__(self, label: str, scope: str, argv: list[str], env: dict[str, str]) -> None:
        self.label, self.scope, self.argv, self.env = label, scope, argv, env
        self.output = tempfile.TemporaryFile(mode="w+")
        self.process: subprocess.Popen[str] | None = None
        self.start = self.seconds = self.cpu = 0.0
        self.status: int | None = None

    def launch(self) -> None:
        self.start = time.perf_counter()
        self.process = subprocess.Popen(
            self.argv, stdout=self.output, stderr=subprocess.STDOUT, env=self.env, text=True
        )

    def poll(self) -> bool:
        """True once the child has ended (status, wall time and CPU time recorded)."""
        if self.status is None and self.process is not None:
            pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
            if pid:
                self.status = self.process.returncode = os.waitstatus_to_exitcode(status)
                self.seconds = time.perf_counter() - self.start
                self.cpu = usage.ru_utime + usage.ru_stime
        return self.status is not None

    def text(self) -> str:
        self.output.seek(0)
        # Progress lines (by tenths, on stderr) say nothing once the report is there.
        lines = [line for line in self.output if not line.startswith("[")]
        return "".join(lines).rstrip("\n")


def _verdict(status: int | None) -> str:
    return {0: "passed", 1: "FAILED", 2: "did not run (usage error)"}.get(
        status if status is not None else -1, f"ERROR (exit status {status})"
    )


def verify_jobs(
    names: list[str], *, full: bool, cases: list[str] | None, env: dict[str, str]
) -> tuple[list[_Job], list[str]]:
    """The commands of ``attnspec verify`` for the registered ``names`` (each must load on its
    native device), and the backends among them that do not get every case in every dtype.

    Without ``full``: the Triton and Pallas kernels under an interpreter get the smoke subset;
    JAX on the CPU gets every case in float32 and the smoke subset in float64 and bfloat16, the
    budget of its tests (its cost is XLA compiling a program per case, shape and dtype: without
    a compilation cache about 4 CPU-minutes for these, 5.5 for all four dtypes). JAX on the CPU
    compiles with XLA's quick settings (``QUICK_XLA``) unless XLA_FLAGS is set."""
    python = [sys.executable, "-m"]
    jobs = [_Job("theory", "every check", [*python, "attnspec.theory"], env)]
    partial = []
    for name in names:
        device = native_device(name)
        command = [*python, "attnspec.conformance", "--backend", name, "--device", device]
        if cases:
            command += ["--cases", *cases]
        own = env
        if FRAMEWORKS.get(name) == ("jax",) and device == "cpu":
            own = {**env, "XLA_FLAGS": env.get("XLA_FLAGS", QUICK_XLA)}
        label = f"{name} on {device}"
        if name in KERNEL_BACKENDS and device == "cpu":
            if full:
                jobs.append(_Job(label, "full kit, interpreted", command, own))
            else:
                # no items outside the claims: each is another interpreted kernel run (Pallas
                # on 2 cores: 208 items, 58 CPU-s); the GPU check runs them natively
                smoke = [*command, "--smoke", "--no-unclaimed"]
                jobs.append(_Job(label, "smoke subset, interpreted", smoke, own))
                partial.append(name)
        elif name == "jax" and device == "cpu" and not full:
            jobs.append(_Job(label, "full kit in float32", [*command, *JAX_FULL], own))
            jobs.append(_Job(label, "smoke, float64 bfloat16", [*command, *JAX_SMOKE], own))
            partial.append(name)
        else:
            jobs.append(_Job(label, "full kit", command, own))
    return jobs, partial


def run_jobs(jobs: list[_Job], parallel: int) -> float:
    """Run ``jobs``, ``parallel`` at a time, the longest first (as measured on 2 cores); print
    each one's output when it ends. Seconds taken."""
    order = ["triton", "torch", "jax", "pallas", "mosaic", "numpy", "theory"]
    rank = {name: i for i, name in enumerate(order)}
    pending = sorted(jobs, key=lambda j: rank.get(j.label.split()[0], 0))
    start = time.perf_counter()
    running: list[_Job] = []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                running.append(pending.pop(0))
                running[-1].launch()
                print(f"  started {running[-1].label} ({running[-1].scope})", flush=True)
            time.sleep(0.2)
            for job in [j for j in running if j.poll()]:
                running.remove(job)
                print(
                    f"\n==== {job.label} ({job.scope}): {_verdict(job.status)} in "
                    f"{job.seconds:.0f} s\n{job.text()}",
                    flush=True,
                )
    finally:
        for job in running:
            if job.process is not None:
                job.process.kill()
    return time.perf_counter() - start


def verify_main(argv: list[str] | None = None, prog: str = "attnspec verify") -> int:
    from .registry import BUILTIN, get_backend

    p = argparse.ArgumentParser(
        prog=prog,
        description="The main check: the theorem checks and the conformance kit on every "
        "backend available here, several at a time. numpy and torch get the full kit; kernels "
        "that run under an interpreter (Triton and Pallas without a GPU) get the smoke subset, "
        f"{SMOKE_TEXT}; JAX on a CPU every case in float32 and the smoke subset in float64 and "
        "bfloat16; --full runs every case in every dtype everywhere. On a GPU the kernels run "
        "natively, in full.",
        epilog="exit status: 0 all passed, 1 a check failed, 2 a backend did not load",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the full kit on interpreted kernels too (about 40 minutes on 2 cores)",
    )
    p.add_argument(
        "--backend",
        default="available",
        metavar="BACKEND",
        help="registered names, comma-separated (default: every one available here)",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        metavar="PREFIX",
        help="only case ids starting with one of these, on every backend",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="commands run at the same time (default: the number of CPUs)",
    )
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    everything = args.backend == "available"
    names = list(BUILTIN) if everything else [n.strip() for n in args.backend.split(",")]
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        p.error(f"--backend: {', '.join(unknown)} not registered ({', '.join(BUILTIN)})")
    # A backend whose framework is not installed is left out of "available" (and a usage error
    # when named); the children load the backends, so that no framework loads twice here.
    unavailable = [n for n in names if any(find_spec(m) is None for m in FRAMEWORKS.get(n, ()))]
    if unavailable and not everything:
        for name in unavailable:
            try:
                get_backend(name)
            except (ImportError, ValueError) as exc:
                print(f"{prog}: {_load_error(name, exc)}", file=sys.stderr)
        return 2
    names = [n for n in names if n not in unavailable]
    named_only = [
        n for n in names if everything and n in NAMED_ONLY_ON_CPU and native_device(n) == "cpu"
    ]
    names = [n for n in names if n not in named_only]
    # Each child uses its share of the CPUs (torch and XLA start a thread per CPU otherwise).
    threads = str(max(1, (os.cpu_count() or 1) // args.jobs))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    jobs, partial = verify_jobs(names, full=args.full, cases=args.cases, env=env)
    print(
        f"{prog}: {len(jobs)} commands, {args.jobs} at a time: "
        + ", ".join(f"{j.label} ({j.scope})" for j in jobs),
        flush=True,
    )
    total = run_jobs(jobs, args.jobs)
    cpu = sum(job.cpu for job in jobs)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n==== summary: {total / 60:.1f} minutes, {args.jobs} commands at a time; "
        f"{cpu / 60:.1f} CPU-minutes in all (load average now {load})"
    )
    for job in jobs:
        print(
            f"  {job.label:<14} {job.scope:<27} {_verdict(job.status):<8} {job.seconds:>5.0f} s"
            f" {job.cpu:>6.0f} CPU-s"
        )
    if unavailable:
        print(f"  not available here: {', '.join(unavailable)} (a framework is not installed)")
    if named_only:
        print(
            f"  not run by default on this CPU: {', '.join(named_only)} (an interpreter of "
            f"minutes per case family); --backend {','.join(named_only)} runs it"
        )
    kernels = [n for n in partial if n in KERNEL_BACKENDS]
    if kernels:
        print(
            f"  {' and '.join(kernels)}: kernels interpreted on this CPU (no GPU), so only the "
            f"smoke subset ran: {SMOKE_TEXT}."
        )
    if "jax" in partial:
        print(
            "  jax: every case in float32; in float64 and bfloat16 the smoke subset (XLA "
            "compiles a program per case and dtype: minutes on a CPU)."
        )
    if partial:
        print(f"  The full run, every case in every dtype on every backend: {FULL_RUN}.")
    statuses = [job.status for job in jobs]
    return 2 if 2 in statuses else int(any(s != 0 for s in statuses))


def vectors_main(argv: list[str] | None = None, prog: str = "attnspec vectors") -> int:
    from . import vectors

    p = argparse.ArgumentParser(
        prog=prog,
        description="Golden vectors for implementations outside Python: export the cases with "
        "reference outputs and gradients, then score the results produced elsewhere.",
        epilog=f"then: {prog} export DIR, run your implementation on DIR/*.npz, writing one "
        f".npz of out.<name> (and grad.<name>) per vector file into RESULTS, then {prog} "
        "check DIR --results RESULTS. The format is described in docs/vectors.md.",
    )
    sub = p.add_subparsers(dest="action", required=True, metavar="{export,check}")
    ex = sub.add_parser(
        "export",
        help="write vectors (npz + manifest.json) into DIR",
        description="Write one .npz per (case, dtype) with in.<name>, out.<name> and, for "
        "gradient cases, cot.<name> and grad.<name>, plus manifest.json with checksums and "
        "tolerances.",
    )
    ex.add_argument("dir", metavar="DIR", help="directory to write into (created if missing)")
    ex.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        default=["float64", "float32"],
        help="dtypes to write vectors for; inputs are rounded to each (default: float64 float32)",
    )
    ex.add_argument("--ops", nargs="+", choices=sorted(OPS), help="only these ops")
    ex.add_argument(
        "--cases",
        nargs="+",
        metavar="PREFIX",
        help="only case ids starting with one of these (e.g. fpa/ragged/2); see "
        "'attnspec conformance --backend numpy --list'",
    )
    ck = sub.add_parser(
        "check",
        help="score results produced elsewhere against DIR",
        description="Compare RESULTS/<vector file name> against each vector of DIR's manifest; "
        "a missing result file is 'not implemented', missing gradients are not checked.",
    )
    ck.add_argument("dir", metavar="DIR", help="a directory written by 'export'")
    ck.add_argument(
        "--results",
        required=True,
        metavar="RESULTS",
        help="directory of result .npz files, named as the vector files, holding "
        "out.<name> (and optionally grad.<name>) arrays",
    )
    ck.add_argument("--json", metavar="FILE", help="write the verdicts as JSON")
    args = p.parse_args(argv)
    try:
        if args.action == "export":
            manifest = vectors.export(
                args.dir, dtypes=args.dtypes, ops=args.ops, prefixes=args.cases
            )
            print(f"wrote {len(manifest['cases'])} vector files and manifest.json to {args.dir}")
            return 0
        verdicts = vectors.check(args.dir, args.results)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    for v in verdicts:
        if v.verdict != "passed":
            print(f"{v.verdict.upper():<15} {v.id} [{v.dtype}] {v.message}")
    counts = {
        k: sum(v.verdict == k for v in verdicts) for k in ("passed", "failed", "not implemented")
    }
    print(
        f"{counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['not implemented']} not implemented"
    )
    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump([v.__dict__ for v in verdicts], fh, indent=1, default=float)
    return 1 if counts["failed"] else 0

"""The ``attnspec`` command: ``conformance``, ``theory`` and ``vectors`` subcommands.

Exit status: 0 all passed, 1 some case failed, 2 a usage error (bad arguments, a backend that
does not load, a dtype it does not declare), 141 the reader of the output went away (``| head``).
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, TextIO

from .protocol import OPS, Backend
from .tolerances import DTYPES

if TYPE_CHECKING:  # the runner loads only when a command needs it
    from .runner import CaseResult

BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a writer whose reader left

BACKEND_HELP = """which backend to check:
  numpy, torch, triton, jax, pallas  a registered name
  package.module:attribute           a class, factory or object in an
                                     importable module
  path/to/file.py:attribute          the same in a Python file, loaded by
                                     its path
  numpy,path/to/mine.py:Mine         several, comma-separated; all are
                                     loaded and checked before any runs
  available                          every registered backend that loads
A class or factory is called with device=DEVICE."""


def _version() -> str:
    try:
        return metadata.version("attnspec")
    except metadata.PackageNotFoundError:
        return "unknown (attnspec is not installed; pip install -e .)"


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
        version=f"attnspec {_version()}",
        help="print attnspec's version and exit",
    )
    p.add_argument("--backend", required=True, metavar="BACKEND", help=BACKEND_HELP)
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
    from attnspec.backends.registry import get_backend

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
    from attnspec.backends.registry import available_backends

    from .cases import generate_cases
    from .report import format_report, write_json, write_junit
    from .runner import probe_dtypes, run
    from .skips import SkipList

    args = conformance_parser(prog).parse_args(argv)
    try:
        cases = generate_cases(args.ops, args.cases)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if args.cases and not cases:
        print(f"{prog}: --cases matched no case id", file=sys.stderr)
        return 2
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
        except ValueError as exc:
            problems.append(str(exc))
            continue
        loaded.append((name, backend, skips))
    if problems:
        for problem in problems:
            print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    status = 0
    for name, backend, skips in loaded:
        dtypes = args.dtypes or list(backend.dtypes)
        fd = args.finite_differences == "on" or (
            args.finite_differences == "auto" and backend.name == "numpy"
        )
        report = run(
            backend,
            cases,
            dtypes,
            backend_name=name,
            device=args.device,
            gradients=not args.no_gradients,
            finite_differences=fd,
            skips=skips,
            progress=_progress(sys.stderr),
            probes=[] if args.dtypes else probe_dtypes(backend),
        )
        print(format_report(report))
        several = len(names) > 1
        if args.json:
            write_json(report, _report_path(args.json, name, several))
        if args.junit:
            write_junit(report, _report_path(args.junit, name, several))
        if not report.ok:
            status = max(status, 1)
    return status


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return quiet_on_broken_pipe(lambda: _dispatch(argv))


def _dispatch(argv: list[str]) -> int:
    commands = {"conformance": conformance_main, "vectors": vectors_main}
    if argv and argv[0] == "--version":
        print(f"attnspec {_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*commands, "theory"):
        print(
            "usage: attnspec {conformance,theory,vectors} ... | --version\n\n"
            "  conformance  check a backend against the reference (see --help)\n"
            "  theory       verify the theorems and identities numerically\n"
            "  vectors      export golden vectors / check results from other languages",
            file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "theory":
        from attnspec.theory.__main__ import main as theory_main

        return theory_main(argv[1:])
    return commands[argv[0]](argv[1:], prog=f"attnspec {argv[0]}")

"""The ``attnspec`` command: ``conformance``, ``theory`` and ``vectors`` subcommands."""

from __future__ import annotations

import argparse
import sys

from .protocol import OPS
from .tolerances import DTYPES


def _progress(stream):
    """A one-line progress display on terminals; silent otherwise."""
    if not stream.isatty():
        return None

    def show(n, total, result):
        stream.write(f"\r[{n:>5}/{total}] {result.case_id:<32} {result.dtype:<8} {result.kind:<17}")
        if n == total:
            stream.write("\r" + " " * 70 + "\r")
        stream.flush()

    return show


def conformance_parser(prog: str = "attnspec conformance") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Check a backend's ops and gradients against the reference, case by case.",
    )
    p.add_argument(
        "--backend",
        required=True,
        help="registered name (numpy, ...), 'module:attribute', a comma-separated "
        "list, or 'available' for every backend installed here",
    )
    p.add_argument("--device", default="cpu", help="device string passed to the backend")
    p.add_argument("--ops", nargs="+", choices=sorted(OPS), help="only these ops")
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        help="dtypes to test (default: every dtype the backend declares)",
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
        help="also check the reference VJP by central differences (auto: with the numpy backend)",
    )
    p.add_argument("--json", metavar="FILE", help="write the per-case JSON report")
    p.add_argument("--junit", metavar="FILE", help="write JUnit XML")
    p.add_argument("--list", action="store_true", help="list the selected case ids and exit")
    return p


def _report_path(path: str | None, backend: str, several: bool) -> str | None:
    if path is None or not several:
        return path
    stem, dot, ext = path.rpartition(".")
    safe = backend.replace(":", "_").replace("/", "_")
    return f"{stem}.{safe}.{ext}" if dot else f"{path}.{safe}"


def conformance_main(argv: list[str] | None = None, prog: str = "attnspec conformance") -> int:
    from attnspec.backends.registry import available_backends, get_backend

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
    names = available_backends() if args.backend == "available" else args.backend.split(",")
    status = 0
    for name in names:
        try:
            backend = get_backend(name, args.device)
            skips = SkipList.load(getattr(backend, "name", name), args.skips)
        except (ValueError, ImportError) as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            status = 2
            continue
        dtypes = args.dtypes or list(getattr(backend, "dtypes", ("float64",)))
        fd = args.finite_differences == "on" or (
            args.finite_differences == "auto" and getattr(backend, "name", "") == "numpy"
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

    p = argparse.ArgumentParser(prog=prog, description="Golden vectors for other languages.")
    sub = p.add_subparsers(dest="action", required=True)
    ex = sub.add_parser("export", help="write vectors (npz + manifest.json) into DIR")
    ex.add_argument("dir")
    ex.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float64", "float32"])
    ex.add_argument("--ops", nargs="+", choices=sorted(OPS))
    ex.add_argument("--cases", nargs="+", metavar="PREFIX")
    ck = sub.add_parser("check", help="score results produced elsewhere against DIR")
    ck.add_argument("dir")
    ck.add_argument("--results", required=True, help="directory of result .npz files")
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
    commands = {"conformance": conformance_main, "vectors": vectors_main}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*commands, "theory"):
        print(
            "usage: attnspec {conformance,theory,vectors} ...\n\n"
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

"""``python -m attnspec.theory [--json FILE] [--plots DIR] [--only ID ...]``."""

from __future__ import annotations

import argparse
import sys

from .registry import run_checks
from .report import format_table, write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attnspec theory",
        description="Verify the theorems and identities of the spec numerically.",
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--plots", metavar="DIR", help="write the teaching figures (PNG) here")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these checks")
    args = parser.parse_args(argv)
    if args.plots:
        from .plots import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            parser.error(str(exc))
    try:
        results = run_checks(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    print(format_table(results))
    if args.json:
        write_json(results, args.json)
    if args.plots:
        from .plots import write_all

        for path in write_all(args.plots):
            print(f"wrote {path}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The ``attnspec`` command: ``verify``, ``conformance``, ``theory`` and ``vectors``.

It sits above every subpackage: the kit's commands come from :mod:`attnspec.conformance.cli`,
``theory`` from :mod:`attnspec.theory`. Exit status: 0 all passed, 1 some case failed, 2 a usage
error, 141 the reader of the output went away (``| head``).
"""

from __future__ import annotations

import sys

from attnspec.conformance.cli import (
    conformance_main,
    quiet_on_broken_pipe,
    vectors_main,
    verify_main,
    version,
)

USAGE = """usage: attnspec {verify,conformance,theory,vectors} ... | --version

  verify       the theory checks and the kit on every backend available here
  conformance  check a backend against the reference (see --help)
  theory       verify the theorems and identities numerically
  vectors      export golden vectors / check results from other languages"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return quiet_on_broken_pipe(lambda: _dispatch(argv))


def _dispatch(argv: list[str]) -> int:
    commands = {"verify": verify_main, "conformance": conformance_main, "vectors": vectors_main}
    if argv and argv[0] == "--version":
        print(f"attnspec {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*commands, "theory"):
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(USAGE, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    if argv[0] == "theory":
        from attnspec.theory.__main__ import main as theory_main

        return theory_main(argv[1:])
    return commands[argv[0]](argv[1:], prog=f"attnspec {argv[0]}")

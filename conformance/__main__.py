"""``python -m attnspec.conformance`` = ``attnspec conformance``."""

import sys

from .cli import conformance_main, quiet_on_broken_pipe

if __name__ == "__main__":
    sys.exit(quiet_on_broken_pipe(lambda: conformance_main(prog="python -m attnspec.conformance")))

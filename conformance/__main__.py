"""``python -m attnspec.conformance`` = ``attnspec conformance``."""

import sys

from .cli import conformance_main

if __name__ == "__main__":
    sys.exit(conformance_main(prog="python -m attnspec.conformance"))

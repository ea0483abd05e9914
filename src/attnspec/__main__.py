"""``python -m attnspec`` = the ``attnspec`` command."""

import sys

from attnspec.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""attnspec.conformance: the cross-framework conformance and gradient kit.

``__version__`` is attnspec's version, read from the installed package's metadata (the version of
pyproject.toml); ``attnspec --version`` prints the same. It lives here because ``attnspec``
itself is a namespace package, which runs no code of its own (docs/decisions.md).
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("attnspec")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

"""attnspec: the executable specification of First Passage Attention and Interdomain Attention.

The subpackages, in the direction of their imports (docs/contributing.md; tests/test_layering.py
checks it): ``attnspec.reference`` (the equations in NumPy/SciPy) <- ``attnspec.theory`` (the
theorems, checked numerically) and ``attnspec.conformance`` (the kit: cases, tolerances, the
runner, the reference as a backend, the backend registry) <- ``attnspec.backends`` (torch + Triton,
JAX + Pallas, each with its adapter to the kit); ``attnspec.experiments`` may use any of them.
``import attnspec`` imports none of them.

``__version__`` is read from the installed package's metadata (the version in pyproject.toml);
``attnspec --version`` prints the same.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("attnspec")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

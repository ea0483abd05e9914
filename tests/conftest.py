"""Test configuration: hypothesis profiles (derandomised in CI), the Triton interpreter (with its
language patched once per launch, :func:`patch_the_language_once_per_launch`), and a check that
the editable install links every module of the code folders."""

import importlib.util
import inspect
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=40)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_configure(config: pytest.Config) -> None:
    """Stop early, with the fix, when a module added to a code folder is not installed yet.

    ``make`` installs in setuptools' strict editable mode, which links each file into
    build/__editable__.*/ at install time: a module added later does not import until
    ``make install`` links it.
    """
    root = Path(__file__).resolve().parent.parent
    with open(root / "pyproject.toml", "rb") as fh:
        package_dirs = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    unlinked = []
    for package, folder in package_dirs.items():
        spec = importlib.util.find_spec(package)
        installed = spec and spec.submodule_search_locations
        if not installed or "__editable__" not in installed[0]:
            continue  # not a strict editable install: nothing is linked file by file
        for source in sorted((root / folder).rglob("*.py")):
            if not (Path(installed[0]) / source.relative_to(root / folder)).exists():
                unlinked.append(str(source.relative_to(root)))
    if unlinked:
        raise pytest.UsageError(
            f"not in the editable install yet: {', '.join(unlinked)}; run `make install` (a new "
            "subpackage also goes into [tool.setuptools] packages of pyproject.toml)"
        )


# The tests measured longest (seconds each on 2 cores, ``pytest --durations``), in that order:
# run first, so that ``make test``'s workers, handed tests one at a time in collection order
# (``--dist load --maxschedchunk 1``), finish together instead of one of them running a long test
# while the other idles. Prefixes of test ids; the rest keep their order.
SLOW_FIRST = (
    "tests/test_jax_kit.py::test_kit_passes",
    "tests/test_triton_kit.py",
    "tests/test_conformance_kit.py::test_reference_backend_passes_everything",
    "tests/test_conformance_kit.py::test_cli_reports_json_junit_and_exit_codes",
    "tests/test_envelope_gate.py",
    "tests/test_gpu_static_interdomain.py",
    "tests/test_gpu_check_dryrun.py",
    "tests/test_triton_interdomain.py::test_gpu_s4d_dry_run",
    "tests/test_kit_checks.py::test_a_flash_style_low_precision_backend_passes",
    "tests/test_context_parallel_torch.py",
    "tests/test_triton_fpa.py::test_kernels_compile_for_sm90",
    "tests/test_gpu_static.py",
    "tests/test_gpu_static_decode.py",
    "tests/test_torch_kit.py",
    "tests/test_context_parallel_jax.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next(
            (i for i, p in enumerate(SLOW_FIRST) if item.nodeid.startswith(p)), len(SLOW_FIRST)
        )

    items.sort(key=rank)  # stable: the order within each prefix, and of the rest, is kept


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures(...)``):
    on tiny tensors OpenMP synchronisation, not arithmetic, dominates with two threads."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def patch_the_language_once_per_launch() -> bool:
    """Make Triton's interpreter patch ``triton.language`` once per kernel launch, not again on
    every call of a ``@triton.jit`` helper inside it. Returns whether it applied.

    The interpreter swaps the language's builtins for interpreted ones when a launch starts
    (``GridExecutor.__call__``), restores them when it ends, and swaps them again, scanning every
    member of ``triton.language``, on each helper call (``InterpretedFunction.__call__``):
    about 0.7 ms a call, a third of an interpreted S4D kit case (20,000 helper calls), a fifth of
    an FPA one. Inside a launch a second swap for the same language modules changes nothing (the
    builtins are already the interpreted ones), so it is skipped: the first call for each set of
    language modules (``tl``, ``tl.core``) still patches, into the launch's own scope where it is
    the launch's. Outside a launch, and with any other version of these internals, the
    interpreter runs as shipped. Every Triton test compares against the reference or the eager
    twin, so a wrong patch fails them.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original: Callable[[Any], Any] | None = getattr(interpreter, "_patch_lang", None)
    grid = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or grid is None or scope_type is None or not callable(grid.__call__):
        return False
    langs = (interpreter.tl, interpreter.tl.core)
    launch: dict[tuple[int, ...], bool] = {}  # language modules patched in the current launch
    active = [0]  # launches in progress

    def key(fn: Any) -> tuple[int, ...]:  # not cached: rewriting a helper adds to its globals
        modules = (v for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs)
        return tuple(sorted(id(v) for v in modules))

    def patch_lang(fn: Any) -> Any:
        if not active[0]:
            return original(fn)
        k = key(fn)
        if k in launch:
            return scope_type()  # nothing patched, nothing to restore
        launch[k] = True
        return original(fn)

    run = grid.__call__

    def launch_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        active[0] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            active[0] -= 1
            if not active[0]:
                launch.clear()

    interpreter._patch_lang = patch_lang
    grid.__call__ = launch_call
    return True


if os.environ.get("TRITON_INTERPRET") == "1":
    patch_the_language_once_per_launch()

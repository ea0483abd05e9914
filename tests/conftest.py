"""Test configuration: hypothesis profiles (derandomised in CI), the Triton interpreter, and a
check that the editable install links every module of the code folders."""

import importlib.util
import os
import tomllib
from pathlib import Path

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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures(...)``):
    on tiny tensors OpenMP synchronisation, not arithmetic, dominates with two threads."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""The wheel as a user installs it: PEP 561 markers shipped, and mypy following the public API.

The wheel is built offline from a copy of the package sources (``pip wheel --no-deps
--no-build-isolation``) and installed into a fresh virtual environment. That environment reaches
its dependencies (NumPy, SciPy, and torch or jax where installed) through one ``.pth`` line to
this interpreter's site-packages; a ``.pth`` file is read only in a site directory, so the editable
install of this checkout stays invisible there and ``attnspec`` resolves to the wheel alone.
mypy then checks a user script that uses each public entry point with ``assert_type`` (an
unresolved import would make every type ``Any`` and fail those asserts), and a script of user
mistakes that must be reported. mypy shares the project's cache (``.mypy_cache``, filled by
``make typecheck``), so the third-party packages are not analysed twice.

The tests that build and install are marked ``wheel``: ``pytest -m "not wheel"`` leaves them out
locally; ``make test`` runs them.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
with open(ROOT / "pyproject.toml", "rb") as _fh:
    TOOL = tomllib.load(_fh)["tool"]
SETUPTOOLS = TOOL["setuptools"]

USER_SCRIPT = '''\
"""A user's script: every public entry point, with the types a checker must infer."""

from collections.abc import Callable
from typing import assert_type

import numpy as np
from numpy.typing import NDArray

import attnspec
from attnspec.cli import main
from attnspec.conformance.cases import Case, generate_cases
from attnspec.conformance.numpy_backend import NumpyBackend
from attnspec.conformance.registry import available_backends, get_backend
from attnspec.conformance.protocol import Backend
from attnspec.conformance.runner import RunReport, run
from attnspec.reference import (
    DecodeResult,
    FPADecoder,
    FPAGrads,
    InterdomainDecoder,
    fox_attention,
    fpa_attention,
    fpa_attention_vjp,
    fpa_decode,
    interdomain_legs,
    interdomain_s4d,
    legs_transition,
    live_keys,
    s4d_lambda,
    segment_argmin,
)
from attnspec.theory.registry import CheckResult, run_checks

F64 = NDArray[np.float64]
q = np.zeros((1, 2, 4, 3))
field = np.zeros((1, 2, 4))
lam = np.full((2, 3), 0.5 + 0j)

assert_type(fpa_attention(q, q, q, field, field), F64)
assert_type(fpa_attention(q, q, q, field, field, return_lse=True), tuple[F64, F64])
assert_type(fox_attention(q, q, q, field, scale=0.5), F64)
assert_type(fpa_attention_vjp(q, q, q, field, field, q), FPAGrads)
assert_type(fpa_decode(q, q, q, field, field, theta=4.0), DecodeResult)
assert_type(FPADecoder(scale=1.0).step(q[0, 0, 0], q[0, 0, 0], q[0, 0, 0], 0.0, 0.0), F64)
assert_type(live_keys(field, field), NDArray[np.bool_])
assert_type(segment_argmin(field), NDArray[np.int64])
assert_type(legs_transition(4), tuple[F64, F64])
assert_type(interdomain_legs(q, q, q, 4), F64)
assert_type(interdomain_s4d(q, q, q, lam, lam, np.zeros((2, 3, 3))), F64)
assert_type(InterdomainDecoder(lam, lam, np.eye(3)).step(q[0, :, 0], q[0, :, 0], q[0, :, 0]), F64)
assert_type(s4d_lambda(np.zeros(2), np.zeros((2, 3)), np.zeros((2, 3))), NDArray[np.complex128])

backend: Backend = NumpyBackend()
cases = generate_cases(["fpa_attention"], ["fpa/shapes/0"])
assert_type(cases, list[Case])
assert_type(run(backend, cases, ["float64"]), RunReport)
assert_type(available_backends(), list[str])
get_backend("numpy")
assert_type(main(["--version"]), int)
assert_type(attnspec.__version__, str)
assert_type(run_checks(["T1"]), list[CheckResult])
'''

# One section per framework extra, added where the framework is installed.
EXTRA_SECTIONS = {
    "torch": """
from typing import Any

from attnspec.backends.torch.dispatch import KERNELS, lookup, register

assert_type(lookup(KERNELS[0], "eager"), Callable[..., Any])


@register("fpa_fwd", "user")
def user_kernel(x: int) -> str:
    return str(x)


assert_type(user_kernel(1), str)  # register hands the function back with its signature
""",
    "jax": """
import attnspec.backends.jax
""",
}

# Each line is a mistake a checker must report (the line numbers are asserted).
USER_MISTAKES = """\
import numpy as np

from attnspec.reference import FPADecoder, fpa_attention

x = np.zeros((1, 2, 4, 3))
fpa_attention(x, x, x, x[..., 0], x[..., 0], scale="0.5")
FPADecoder(theta=1.0)
fpa_attention(x, x, x, x[..., 0], x[..., 0]).lse
"""
MISTAKE_LINES = {6, 7, 8}


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """attnspec-*.whl built from a copy of pyproject.toml, README.md and the code folders."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in SETUPTOOLS["package-dir"].values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "--wheel-dir", dist, src)  # fmt: skip
    (built,) = dist.glob("attnspec-*.whl")
    return built


def test_type_check_covers_every_package() -> None:
    """``make typecheck`` checks every subpackage the wheel installs, and each folder is typed."""
    checked = TOOL["mypy"]["packages"]
    for package in SETUPTOOLS["packages"]:
        assert any(package == c or package.startswith(c + ".") for c in checked), package
    for folder in SETUPTOOLS["package-dir"].values():
        for init in (ROOT / folder).rglob("__init__.py"):
            assert (init.parent / "py.typed").is_file(), f"{init.parent} has no py.typed"


@pytest.mark.wheel
def test_wheel_ships_py_typed_and_package_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in SETUPTOOLS["packages"]:
        folder = package.replace(".", "/")
        assert f"{folder}/__init__.py" in names, package
        assert f"{folder}/py.typed" in names, f"{package} ships no py.typed"
    assert "attnspec/conformance/skips/numpy.txt" in names
    assert "attnspec/conformance/report-schema.json" in names  # docs/report-schema.md
    assert "attnspec/cli.py" in names and "attnspec/__main__.py" in names


@pytest.mark.wheel
def test_mypy_follows_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--quiet", wheel)  # fmt: skip
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    ours = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    (Path(site.strip()) / "attnspec_test_dependencies.pth").write_text(
        "".join(f"{path}\n" for path in sorted(ours))
    )
    where = _run(python, "-c", "import attnspec.reference as r; print(r.__file__)")
    assert where.startswith(str(venv)), f"attnspec resolved outside the wheel's venv: {where}"

    script = USER_SCRIPT + "".join(
        textwrap.dedent(section)
        for extra, section in EXTRA_SECTIONS.items()
        if importlib.util.find_spec(extra) is not None
    )
    (tmp_path / "user_script.py").write_text(script)
    (tmp_path / "user_mistakes.py").write_text(USER_MISTAKES)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--python-executable",
            str(python),
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            "--no-pretty",
            "user_script.py",
            "user_mistakes.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = re.findall(r"^(\S+?):(\d+): error: (.*)$", done.stdout, flags=re.M)
    in_script = [e for e in errors if e[0] == "user_script.py"]
    assert not in_script, f"the user script does not type-check:\n{done.stdout}{done.stderr}"
    reported = {int(line) for name, line, _ in errors if name == "user_mistakes.py"}
    assert reported == MISTAKE_LINES, (
        f"expected errors on lines {sorted(MISTAKE_LINES)}:\n{done.stdout}{done.stderr}"
    )

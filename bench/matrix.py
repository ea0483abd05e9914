"""The version matrix (``make matrix``): the Python, JAX, Triton and torch versions users run,
beside ``make test``'s one cell (Python 3.11, CPU torch 2.13, Triton 3.9, JAX 0.10.2).

Each leg is a virtual environment under build/matrix/<leg>/ with exact pins from the package
index, created on first use and reused while its pins are unchanged (the stamp file holds them);
attnspec is installed into it editable, without dependencies. The ``newest`` leg is the other
kind: it pins nothing and is created anew on every run, by ``pip install -e ".[all,bench,test]"``
alone, without the local pip configuration (constraints, find-links, extra indexes), so it
resolves what a user's ``pip install ".[all]"`` gets from the index that day; it prints those
versions and writes them to build/matrix/newest-versions.txt. Then the leg's steps run from the
repository root; a failing step is reported and the next one still runs. The table (leg, what ran,
seconds to install and to run) is printed at the end and written to build/matrix/matrix.md; the
exit status is 1 when any step failed.

    python -m bench.matrix                      # every leg
    python -m bench.matrix --legs triton-3.6    # some legs (comma-separated)
    python -m bench.matrix --list               # the legs, their pins and steps

Stdlib only: it runs under any Python 3.11+ (the Makefile calls it with the project's venv).
Python 3.12 and 3.13 come from pyenv (``PYENV_VERSION=3.12.1 pyenv exec python``) when they are
not on PATH as python3.12 / python3.13.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "build" / "matrix"
PYENV = {"3.11": "3.11.7", "3.12": "3.12.1", "3.13": "3.13.0"}

TEST_TOOLS = ("pytest==9.0.3", "pytest-xdist==3.8.0", "hypothesis==6.155.2", "setuptools==84.2.1")
# Beside each Triton: the CPU torch wheel (it pins no Triton; the index's torch for Python 3.12 is
# a 2.6 GB CUDA build), flash-linear-attention (the static gates' peer) and SciPy.
TORCH_CPU = ("torch==2.13.0", "fla-core==0.6.0", "einops==0.8.2", "scipy==1.17.1")
JAX_CPU = ("absl-py==2.5.1", "scipy==1.17.1", "numpy==2.5.2")
STATIC = (
    ("static FPA/FoX (sm_90)", ("python", "-m", "bench.gpu_static", "--report-budgets", "--json")),
    ("static Interdomain (sm_90)", ("python", "-m", "bench.gpu_static_interdomain",
                                    "--report-budgets", "--json")),
    # every corner of backends/envelope.py (make test compiles a representative set)
    ("static envelope (sm_90)", ("python", "-m", "bench.gpu_static_envelope", "--full",
                                 "--json")),
)  # fmt: skip
# The interpreted kernels in float32, float16 and bfloat16 (FPA, FoX, S4D, LegS, their decode
# steps) against the reference and their eager twins.
INTERPRETER_SMOKE = (
    "tests/test_triton_fpa.py",
    "tests/test_triton_interdomain.py",
    "-k",
    "dtypes or eager_twin or decode_steps",
)
# The lent GPU machine's image (Python 3.12; no attnspec, no fla, no network: what the check
# needs beyond it comes as wheels from `make wheels`). torch 2.11 is the index's CUDA build
# (about 2.6 GB with its libraries), run on CPU; jax the CPU build of the same version.
GPU_IMAGE = (
    "torch==2.11.0",
    "triton==3.6.0",
    "jax[cpu]==0.11.2",
    "transformers==5.17.0",
    "safetensors==0.8.0",
    "numpy==2.5.2",
)


def pytest_step(*args: str, stop: bool = True) -> tuple[str, ...]:
    """A serial, quiet pytest run (legs run one after another on CI's two cores), stopping at
    the first failure unless ``stop`` is False (the newest leg reports every failure)."""
    return ("python", "-m", "pytest", "-p", "no:cacheprovider", "-q", *("-x",) * stop, *args)


@dataclass(frozen=True)
class Leg:
    """One cell of the matrix: a Python version, exact pins and the steps run in its venv
    (argument tuples: "python" is the leg's interpreter, "attnspec" its command, "host-python"
    the interpreter running the matrix (the project's venv), anything else a command on PATH; a
    step ending in "--json" gets a file under build/matrix/<leg>/)."""

    name: str
    python: str
    pins: tuple[str, ...]
    steps: tuple[tuple[str, tuple[str, ...]], ...]
    env: tuple[tuple[str, str], ...] = ()  # "{venv}" in a value: the leg's venv
    attnspec: bool = True  # installed into the venv (editable, no dependencies)
    # the project's extras resolved fresh from the index on every run (no pins): the newest leg
    extras: str = ""

    @property
    def venv(self) -> Path:
        return BASE / self.name


# The JAX tests that differ between versions: the Mosaic GPU and Pallas lowerings for CUDA, the
# Mosaic interpreter against the reference, the kit adapters' dtypes and program budget.
JAX_TESTS = pytest_step(
    "tests/test_jax_pallas.py",
    "tests/test_jax_kit.py",
    "-k",
    "mosaic or lower or adapter or budget",
)
KIT_SMOKE = ("attnspec", "verify", "--backend", "jax,pallas,mosaic", "--cases", "fpa/shapes/0")
# The Flax NNX modules and their example on current Flax (flax 0.12.10+ needs JAX 0.11.1+).
NNX_FILES = ("tests/test_jax_init.py", "tests/test_jax_nnx.py", "tests/test_nnx_example.py")
NNX_TESTS = pytest_step(*NNX_FILES)
REFERENCE_FILES = ("tests/test_fpa.py", "tests/test_interdomain.py", "tests/test_theory.py")
# The torch backend on the newest torch: ops (FoX against flash-linear-attention's naive
# reference, so fla-core's range too), custom ops, modules, decode and paged sessions.
TORCH_FILES = tuple(
    f"tests/test_{name}.py"
    for name in (
        "torch_cpu_ops", "torch_decode", "torch_fpa", "torch_host_reads", "torch_interdomain",
        "torch_library", "torch_modules", "torch_paged", "torch_state_sessions", "torch_window",
        "launches", "serving_example",
    )
)  # fmt: skip


def first_cases() -> tuple[str, ...]:
    """The first case of every family of the JAX backend's ops: what ``attnspec verify`` runs in
    the matrix (the whole kit on JAX is the job of make verify; in CI it would take longer than
    the leg's share of the 90 minutes)."""
    from attnspec.conformance import cases  # the project's venv runs this file

    return tuple(i for i in cases.case_ids(sorted(cases.FAMILIES)) if i.endswith("/0"))


# What the newest leg installs: every extra a user can want ("all": torch, jax, flax, hf, plots)
# and the test and benchmark tools (fla-core, the peer of some tests); the docs' are left out.
NEWEST_EXTRAS = "all,bench,test"
# The versions printed after the newest leg's install (all of them go to newest-versions.txt).
NEWEST_SHOWN = (
    "torch", "triton", "jax", "jaxlib", "flax", "optax", "numpy", "scipy", "transformers",
    "safetensors", "accelerate", "fla-core", "einops", "matplotlib", "absl-py",
)  # fmt: skip

LEGS = (
    Leg(
        "jax-0.12",
        "3.12",
        ("jax[cpu]==0.12.0.1", "flax==0.12.12", "optax==0.2.8", *JAX_CPU, *TEST_TOOLS),
        (
            ("JAX tests (lowerings, Mosaic, adapters)", JAX_TESTS),
            ("Flax NNX modules and example", NNX_TESTS),
            ("kit smoke: jax, pallas, mosaic", KIT_SMOKE),
            (
                "attnspec verify --backend jax (first case of every family)",
                ("attnspec", "verify", "--backend", "jax", "--cases", *first_cases()),
            ),
        ),
    ),
    Leg(
        "jax-0.11",  # the lent GPU machine's JAX
        "3.12",
        ("jax[cpu]==0.11.2", *JAX_CPU, *TEST_TOOLS),
        (("JAX tests (lowerings, Mosaic, adapters)", JAX_TESTS),),
    ),
    Leg(
        "triton-3.6",  # the GPU machine's Triton (the index's torch 2.10 and 2.11 pin it)
        "3.11",
        (*TORCH_CPU, "triton==3.6.0", "numpy==2.3.5", "packaging==26.4", *TEST_TOOLS),
        (
            *STATIC,
            ("interpreter smoke", pytest_step(*INTERPRETER_SMOKE)),
        ),
        (("TRITON_INTERPRET", "1"),),
    ),
    Leg(
        "triton-3.7.1",  # the index's torch 2.12 and 2.13 pin it
        "3.11",
        (*TORCH_CPU, "triton==3.7.1", "numpy==2.4.6", *TEST_TOOLS),
        (*STATIC, ("interpreter smoke", pytest_step(*INTERPRETER_SMOKE))),
        (("TRITON_INTERPRET", "1"),),
    ),
    Leg(
        "gpu-image",  # bench/gpu_check.sh --dry-run as the GPU machine runs it (issue 55)
        "3.12",
        GPU_IMAGE,
        (
            ("make wheels", ("make", "wheels")),
            (
                "gpu_check.sh --dry-run with the image's Python",
                ("host-python", *pytest_step("tests/test_gpu_check_dryrun.py", "-k", "image")[1:]),
            ),
        ),
        (("GPU_IMAGE_PYTHON", "{venv}/bin/python"),),
        attnspec=False,
    ),
    Leg(
        "python-3.13",
        "3.13",
        ("numpy==2.5.2", "scipy==1.17.1", *TEST_TOOLS),
        (("reference tests", pytest_step("tests/test_fpa.py", "tests/test_interdomain.py")),),
    ),
    Leg(
        # Python 3.13: the newest that pyenv has here; every extra's range resolves on it as
        # on 3.12, to the same versions (docs/decisions.md, "Supported versions").
        "newest",
        "3.13",
        (),
        (
            (
                "transformers models and the verdict on their caches",
                pytest_step(
                    "tests/test_hf_models.py", "tests/test_model_conformance.py", stop=False
                ),
            ),
            ("Flax NNX modules and example", pytest_step(*NNX_FILES, stop=False)),
            ("torch backend tests", pytest_step(*TORCH_FILES, stop=False)),
            ("reference and theory tests", pytest_step(*REFERENCE_FILES, stop=False)),
            (
                "kit smoke: numpy, torch, jax (first case of every family, float32, bfloat16)",
                # the smoke subset: attnspec verify's whole run of these cases in every dtype took
                # 11.7 CPU-minutes of the leg before this round's families
                (
                    "attnspec",
                    "conformance",
                    "--backend",
                    "numpy,torch,jax",
                    "--smoke",
                    "--no-unclaimed",
                ),
            ),
        ),
        (("TRITON_INTERPRET", "1"),),
        extras=NEWEST_EXTRAS,
    ),
)


def interpreter(version: str) -> list[str]:
    """The command that runs Python ``version`` (3.11, 3.12, 3.13): pyenv's, else
    python<version> on PATH (the first that starts)."""
    candidates = [["env", f"PYENV_VERSION={PYENV[version]}", "pyenv", "exec", "python"]]
    candidates.append([f"python{version}"])
    for command in candidates:
        try:
            done = subprocess.run([*command, "-c", "pass"], capture_output=True)
        except FileNotFoundError:
            continue
        if done.returncode == 0:
            return command
    raise SystemExit(f"matrix: no Python {version} (neither pyenv nor python{version} starts)")


def index_only_env() -> dict[str, str]:
    """The environment for an install that sees only the package index, as a user's fresh
    machine does: no pip configuration file (constraints, find-links, extra indexes) and none of
    those settings from the environment; the index itself (PIP_INDEX_URL), certificates and
    timeouts are kept."""
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    for name in ("PIP_CONSTRAINT", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        env.pop(name, None)
    env.pop("VIRTUAL_ENV", None)
    return env


def prepare(leg: Leg, log: Path) -> bool:
    """Create the leg's venv (or reuse it while its pins are unchanged; a leg with extras is
    created anew every time); False on failure."""
    stamp = leg.venv / ".matrix-pins"
    wanted = "\n".join(leg.pins) + "\n"
    if not leg.extras and stamp.is_file() and stamp.read_text() == wanted:
        return True
    shutil.rmtree(leg.venv, ignore_errors=True)
    (BASE / f"{leg.name}-versions.txt").unlink(missing_ok=True)
    pip = [str(leg.venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    venv = [*interpreter(leg.python), "-m", "venv", str(leg.venv)]
    if leg.extras:
        commands = [venv, [*pip, "-e", f"{ROOT}[{leg.extras}]"]]
        env = index_only_env()
    else:
        commands, env = [venv, [*pip, *leg.pins]], None
        if leg.attnspec:
            commands.append([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)])
    for command in commands:
        with log.open("a") as out:
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            if done.returncode:
                return False
    if leg.extras:
        return record_versions(leg, log)
    stamp.write_text(wanted)
    return True


def record_versions(leg: Leg, log: Path) -> bool:
    """Write every version the leg's install resolved to build/matrix/<leg>-versions.txt and
    print the main ones; False when pip cannot list them."""
    python = str(leg.venv / "bin" / "python")
    listing = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze"],
        capture_output=True, text=True, env=index_only_env(),
    )  # fmt: skip
    version = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        capture_output=True, text=True,
    )  # fmt: skip
    if listing.returncode or version.returncode:
        with log.open("a") as out:
            out.write(listing.stdout + listing.stderr + version.stderr)
        return False
    day = time.strftime("%Y-%m-%d")
    header = f"# Python {version.stdout.strip()}; pip install -e '.[{leg.extras}]', {day}\n"
    (BASE / f"{leg.name}-versions.txt").write_text(header + listing.stdout)
    print(f"matrix {leg.name}: {resolved(leg)}", flush=True)
    return True


def resolved(leg: Leg) -> str:
    """The Python and the main versions that ``leg``'s last install resolved ("" if none)."""
    path = BASE / f"{leg.name}-versions.txt"
    if not path.is_file():
        return ""
    header, *lines = path.read_text().splitlines()
    pins = dict(line.split("==", 1) for line in lines if "==" in line)
    shown = " ".join(f"{name}=={pins[name]}" for name in NEWEST_SHOWN if name in pins)
    return f"{header.split(';')[0].lstrip('# ')}; resolved {shown}"


def run_leg(leg: Leg) -> list[tuple[str, str, float, int]]:
    """(step, status, seconds, exit code) for the install and each step of ``leg``."""
    BASE.mkdir(parents=True, exist_ok=True)
    log = BASE / f"{leg.name}.log"
    log.write_text("")
    start = time.perf_counter()
    ok = prepare(leg, log)
    rows = [("install", "ok" if ok else "FAILED", time.perf_counter() - start, 0 if ok else 1)]
    if not ok:
        return rows
    env = dict(os.environ) | {name: value.format(venv=leg.venv) for name, value in leg.env}
    env["PATH"] = f"{leg.venv / 'bin'}{os.pathsep}{env['PATH']}"
    env.pop("VIRTUAL_ENV", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    if "TRITON_INTERPRET" not in dict(leg.env):
        env.pop("TRITON_INTERPRET", None)
    for label, argv in leg.steps:
        if argv[0] in ("python", "attnspec"):
            command = [str(leg.venv / "bin" / argv[0]), *argv[1:]]
        else:
            command = [sys.executable if argv[0] == "host-python" else argv[0], *argv[1:]]
        if command[-1] == "--json":
            command.append(str(leg.venv / (re.sub(r"\W+", "-", label).strip("-") + ".json")))
        start = time.perf_counter()
        with log.open("a") as out:
            out.write(f"\n== {label}\n$ " + " ".join(command) + "\n")
            out.flush()
            code = subprocess.run(
                command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            ).returncode
        took = time.perf_counter() - start
        rows.append((label, "ok" if code == 0 else "FAILED", took, code))
        print(f"matrix {leg.name}: {label}: {rows[-1][1]} in {took:.0f} s", flush=True)
    return rows


def table(results: dict[str, list[tuple[str, str, float, int]]]) -> list[str]:
    """The Markdown table: leg, pins, step, status, seconds."""
    lines = ["| leg | step | result | seconds |", "|---|---|---|---:|"]
    for name, rows in results.items():
        for step, status, seconds, _ in rows:
            lines.append(f"| {name} | {step} | {status} | {seconds:.0f} |")
    total = sum(s for rows in results.values() for _, _, s, _ in rows)
    lines.append(f"| all | | | {total:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--legs", default="", help="comma-separated leg names (default: all)")
    parser.add_argument("--list", action="store_true", help="print the legs and stop")
    args = parser.parse_args(argv)
    names = [n for n in args.legs.split(",") if n]
    unknown = set(names) - {leg.name for leg in LEGS}
    if unknown:
        parser.error(f"unknown legs {sorted(unknown)}; known: {[leg.name for leg in LEGS]}")
    legs = [leg for leg in LEGS if not names or leg.name in names]
    if args.list:
        for leg in legs:
            what = " ".join(leg.pins) or f"pip install -e '.[{leg.extras}]' (unpinned)"
            print(f"{leg.name}: Python {leg.python}; {what}")
            for label, step in leg.steps:
                print(f"    {label}: {' '.join(step)}")
        return 0
    results = {leg.name: run_leg(leg) for leg in legs}
    lines = table(results)
    lines += [f"\n{leg.name}: {resolved(leg)}" for leg in legs if leg.extras and resolved(leg)]
    (BASE / "matrix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    failed = [f"{n}: {s}" for n, rows in results.items() for s, st, _, _ in rows if st != "ok"]
    print("matrix: " + ("FAILED " + "; ".join(failed) if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

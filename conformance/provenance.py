"""Where and with what a report was made: the header of the JSON report (docs/report-schema.md).

Nothing here imports a framework: library versions come from the installed distributions'
metadata, and the GPU's name from a framework only when the run has already loaded it (the
backend under test's). The kit's commit is read with ``git`` only when the package runs from
its own checkout; anywhere else (a wheel, no git) it is None, never an error.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

# The report's format: raised when a key is removed or changes meaning; new keys keep it.
SCHEMA_VERSION = 1
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report-schema.json")

# The libraries a report names, by distribution; absent ones are None.
LIBRARIES = ("numpy", "scipy", "torch", "triton", "jax", "jaxlib", "transformers")


def utc_now() -> str:
    """The time now in UTC, ISO 8601 to the second: ``2026-12-07T23:30:05Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def library_versions() -> dict[str, str | None]:
    """Python's version and each of :data:`LIBRARIES`' installed version (None: not installed),
    from the distributions' metadata (nothing is imported)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def kit_version() -> str:
    from attnspec import __version__

    return __version__


def _git(folder: str, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", folder, *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def kit_commit(package_dir: str | None = None) -> dict[str, Any] | None:
    """``{"commit": <40 hex digits>, "modified": <tracked files changed since>}`` when the kit
    runs from its own checkout (the package folder is ``conformance/`` at the top of a git work
    tree), else None. ``package_dir``: the conformance package's folder (default: this one,
    followed through the links of an editable install)."""
    folder = package_dir or os.path.dirname(os.path.realpath(__file__))  # the file's own folder
    folder = os.path.realpath(folder)
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.dirname(folder):
        return None  # not a checkout, or a checkout of something else that holds the package
    commit = _git(folder, "rev-parse", "HEAD")
    if commit is None:
        return None
    status = _git(folder, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "modified": None if status is None else bool(status)}


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name(device: str) -> str | None:
    """The name of the GPU ``device`` (a "cuda..." or "gpu..." device string) from a framework
    the run has loaded, else None (a CPU run, or no framework loaded to ask)."""
    if not device.startswith(("cuda", "gpu")):
        return None
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(device.replace("gpu", "cuda", 1)))
        jax = sys.modules.get("jax")
        if jax is not None:
            return str(jax.devices("gpu")[0].device_kind)
    except Exception:  # a device string the framework does not take; a driver problem
        return None
    return None


def machine(device: str) -> dict[str, Any]:
    """The machine of the run: operating system, CPU, CPU count, and the GPU if it ran on one."""
    return {
        "os": f"{platform.system()} {platform.release()}",
        "platform": sys.platform,
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "gpu": gpu_name(device),
    }


def header(device: str) -> dict[str, Any]:
    """The keys the JSON report starts with (docs/report-schema.md)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kit": {"name": "attnspec", "version": kit_version(), "checkout": kit_commit()},
        "created": utc_now(),
        "machine": machine(device),
        "libraries": library_versions(),
    }

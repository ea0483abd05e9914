"""A launcher for JAX programs on several host devices: a child process with ``world`` forced
host devices (XLA reads the device count once, at start), for the conformance kit's
context-parallel adapter (context_parallel_kit.py)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any


def run_on_host_devices(entry: str, payload: Any, world: int, timeout: float) -> Any:
    """Call ``entry`` (``module:function``, importable) as ``function(path_in, path_out)`` in a
    child process with ``world`` host devices: ``payload`` is pickled to ``path_in`` and what
    the function pickles to ``path_out`` is returned. A child that fails raises RuntimeError
    with the end of its stderr; past ``timeout`` seconds, subprocess.TimeoutExpired."""
    module, function = entry.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        path_in, path_out = os.path.join(tmp, "jobs.pkl"), os.path.join(tmp, "out.pkl")
        with open(path_in, "wb") as fh:
            pickle.dump(payload, fh)
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={world}"
        ).strip()
        env["JAX_PLATFORMS"] = "cpu"
        code = f"from {module} import {function}; {function}({path_in!r}, {path_out!r})"
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode:
            raise RuntimeError(f"the JAX child process failed: {done.stderr[-3000:]}")
        with open(path_out, "rb") as fh:
            return pickle.load(fh)

"""Shared pieces of the JAX backend's tests: XLA:CPU compile settings, the float64 scope, the
reference's layout and a child process with several host devices."""

import os
import subprocess
import sys

# XLA:CPU compiles these small programs several times faster with these settings (they change
# code generation effort only, not results); they apply if jax has not started a backend yet.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0",
)

import jax
import numpy as np
import pytest


@pytest.fixture(autouse=True)
def x64():
    """float64 inside each test only (the process-wide setting stays as it is)."""
    with jax.enable_x64(True):
        yield


def canonical(x):
    """[B, T, N, ...] -> (B, N, T, ...), the reference's layout, in float64."""
    return np.swapaxes(np.asarray(x, dtype=np.float64), 1, 2)


def run_on_host_devices(code: str, timeout: float, devices: int = 4) -> str:
    """Run ``code`` in a child Python with ``devices`` CPU devices and return its stdout: XLA's
    host device count is fixed when JAX starts, so sharding is tested in a fresh process."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout

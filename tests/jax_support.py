"""Shared pieces of the JAX backend's tests: XLA:CPU compile settings, the float64 scope and the
comparisons with the reference."""

import os

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

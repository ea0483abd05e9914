"""Shared pieces of the JAX backend's tests: XLA:CPU compile settings, the float64 scope, the
reference's layout, FPA inputs and expected values in the backend's layout, and a child process
with several host devices."""

import os
import subprocess
import sys

from attnspec.conformance.cli import QUICK_XLA

# XLA:CPU compiles these small programs several times faster with these settings (they change
# code generation effort only, not results; chosen by jaxlib version); they apply if jax has
# not started a backend yet.
os.environ.setdefault("XLA_FLAGS", QUICK_XLA)

import jax
import numpy as np
import pytest
from drawers import attention

from attnspec.conformance.numpy_backend import NumpyBackend


@pytest.fixture(autouse=True)
def x64():
    """float64 inside each test only (the process-wide setting stays as it is)."""
    with jax.enable_x64(True):
        yield


def canonical(x):
    """[B, T, N, ...] -> (B, N, T, ...), the reference's layout, in float64."""
    return np.swapaxes(np.asarray(x, dtype=np.float64), 1, 2)


KINDS = {
    "walk": {},
    "brackets": {"field": "brackets", "level": "one_walk"},  # ties everywhere (section 6)
    "constant": {"field": "constant"},  # every segment minimum is tied
}
NUMPY = NumpyBackend()  # the reference as the kit runs it: per packed sequence, GQA by repeats


def draw(B, T, N, K, H, Hv, seed=0, field_kind="walk"):
    """q, k, v, field, level in the [B, T, N, ...] layout: N query heads, K key/value heads."""
    x = attention(np.random.default_rng(seed), B, T, N, K, H, Hv, **KINDS[field_kind])
    return tuple(np.swapaxes(a, 1, 2) for a in x)


def reference_fpa(q, k, v, field, level, do, dlse, scale=None, cu_seqlens=None):
    """o, lse and the five gradients by the reference on [B, T, ...] inputs, in its layout."""
    inputs = {"q": q, "k": k, "v": v, "field": field, "level": level}
    inputs = {name: canonical(x) for name, x in inputs.items()}
    o, lse = NUMPY.fpa_attention(**inputs, scale=scale, cu_seqlens=cu_seqlens, return_lse=True)
    params = {"scale": scale, "cu_seqlens": cu_seqlens}
    g = NUMPY.vjp("fpa_attention", inputs, params, {"o": canonical(do), "lse": canonical(dlse)})
    return o, lse, tuple(g[name] for name in inputs)


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

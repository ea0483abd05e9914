"""Test configuration: hypothesis profiles (derandomised in CI) and the Triton interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton

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

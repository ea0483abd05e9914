"""docs/examples/generation.py: greedy generation with the decode caches (prefill, then one step
per token) gives the tokens the parallel forward predicts on the generated sequence."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs", "examples", "generation.py")


def example():
    spec = importlib.util.spec_from_file_location("generation_example", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_cached_generation_equals_the_parallel_forward(framework):
    pytest.importorskip(framework)
    generate = getattr(example(), f"generate_{framework}")
    cached, parallel = generate(b"def first_passage(", 8)
    assert len(cached) == 8 and len(set(cached)) > 1  # not a constant continuation
    assert cached == parallel

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


def test_a_full_jax_cache_stops_generation():
    """Capacity for the prompt and 2 tokens: the jitted step sets ``overflowed`` at the third
    generated token, and the example reads it and raises (eager steps raise by themselves)."""
    pytest.importorskip("jax")
    prompt = b"def first_passage("
    with pytest.raises(ValueError, match=f"capacity: the FPA cache of {len(prompt) + 2} slots"):
        example().generate_jax(prompt, 8, capacity=len(prompt) + 2)
    with pytest.raises(ValueError, match="capacity: the cache of 4 slots per head is full"):
        example().generate_jax(prompt, 8, capacity=4)  # the eager prefill

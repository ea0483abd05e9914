"""The one tile table (backends/tile_sizes.py): framework-free, read by every backend, and its
short-sequence rule."""

import inspect
import subprocess
import sys

import pytest

from attnspec.backends import tile_sizes


@pytest.mark.parametrize(
    "size, T, least, expected",
    [(128, 1, 16, 16), (128, 5, 16, 16), (128, 17, 16, 32), (128, 128, 16, 128),
     (128, 129, 16, 128), (64, 1, 8, 8), (64, 9, 8, 16), (64, 40, 8, 64), (32, 10_000, 8, 32)],
)  # fmt: skip
def test_a_short_sequence_takes_the_next_power_of_two(size, T, least, expected):
    assert tile_sizes.fitted(size, T, least) == expected


def test_the_table_imports_no_framework():
    code = (
        "import sys, attnspec.backends.tile_sizes; "
        "assert not {'torch', 'jax', 'triton'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_row_is_a_valid_tiling():
    for forward, backward in [*tile_sizes.TILE_TABLE.values(), *tile_sizes.HOPPER_WIDE.values()]:
        assert forward.own % forward.visit == 0 and backward.own % backward.visit == 0
    for blocks in tile_sizes.DEVICE_BLOCKS.values():
        assert blocks.diagonal in tile_sizes.DIAGONALS
        assert blocks.chunk % blocks.sub_chunk == 0
    assert set(tile_sizes.DEVICE_CLASSES.values()) <= set(tile_sizes.TILE_TABLE)
    assert tile_sizes.JAX_BLOCK["mosaic"] == 64  # one warpgroup's wgmma rows


def test_the_torch_defaults_come_from_the_table():
    pytest.importorskip("torch")
    from attnspec.backends.torch import eager_fpa, eager_interdomain

    assert eager_fpa.tile_sizes(None, None) == (
        tile_sizes.EAGER_QUERY_BLOCK,
        tile_sizes.EAGER_KEY_BLOCK,
    )
    assert eager_fpa.tile_sizes(32, 16) == (32, 16)
    source = inspect.getsource(eager_interdomain)
    assert 'EAGER_CHUNK["s4d"]' in source and 'EAGER_CHUNK["legs"]' in source


def test_the_jax_defaults_come_from_the_table():
    pytest.importorskip("jax")
    from attnspec.backends import jax as ajax
    from attnspec.backends.jax import fpa, fpa_mosaic

    assert fpa.AttentionConfig("fpa", 1.0).block == tile_sizes.JAX_BLOCK["xla"]
    assert fpa_mosaic.BLOCK == tile_sizes.JAX_BLOCK["mosaic"]
    for op, name in ((ajax.interdomain_s4d, "s4d"), (ajax.interdomain_legs, "legs")):
        assert inspect.signature(op).parameters["chunk"].default == tile_sizes.JAX_CHUNK[name]

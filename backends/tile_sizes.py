"""Tile sizes of every kernel family of every backend: the one table.

Each family picks its tiles here, by the class of device it runs on, and each has one override
for tests and benchmarks (beside its row: `triton_fpa.forced_tiles`, `triton_chunks.block_sizes`,
the functions' arguments). Nothing here imports a framework: torch and JAX both read it.

| family | rows | override |
|---|---|---|
| Triton FPA / FoX | `TILE_TABLE` by device class, `HOPPER_WIDE` (wide heads) | `forced_tiles` |
| Triton Interdomain | `DEVICE_BLOCKS` by device class | `block_sizes` |
| torch eager | `EAGER_QUERY_BLOCK`, `EAGER_KEY_BLOCK`, `EAGER_CHUNK` | `block`, `chunk` args |
| torch context parallel | `CONTEXT_PARALLEL_QUERY_BLOCK` | none (it bounds memory only) |
| JAX FPA / FoX | `JAX_BLOCK` by implementation | `block_size=` |
| JAX Interdomain | `JAX_CHUNK` by operator | `chunk=` |

Device classes (Triton): ``"interpreter"`` (``TRITON_INTERPRET=1``, or a CPU tensor),
``"hopper"`` and ``"ampere"`` by compute capability (:data:`DEVICE_CLASSES`), ``"gpu"`` for any
other CUDA device; ``backends/torch/devices.py`` tells which applies. JAX picks by
implementation: XLA on any device, Pallas (a GPU, or its interpreter), Mosaic GPU (Hopper).
Short sequences take a smaller tile by one rule, :func:`fitted`. The static Hopper gates
(``python -m bench.gpu_static``, ``python -m bench.gpu_static_interdomain``) compile the
Triton kernels at the ``"hopper"`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CONTEXT_PARALLEL_QUERY_BLOCK",
    "DEVICE_BLOCKS",
    "DEVICE_CLASSES",
    "DIAGONALS",
    "EAGER_CHUNK",
    "EAGER_KEY_BLOCK",
    "EAGER_QUERY_BLOCK",
    "HOPPER_BLOCKS",
    "HOPPER_WIDE",
    "INTERPRETER_BLOCKS",
    "JAX_BLOCK",
    "JAX_CHUNK",
    "TILE_TABLE",
    "Blocks",
    "Tiles",
    "fitted",
]

# Compute capability major -> device class of the Triton tables; any other CUDA device is "gpu".
DEVICE_CLASSES = {9: "hopper", 8: "ampere"}


def fitted(size: int, T: int, least: int) -> int:
    """``size``, or for a short sequence the next power of two >= max(T, least)."""
    return min(size, max(least, 1 << (T - 1).bit_length()))


# Triton: FPA and FoX


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one pass: a program owns ``own`` rows and visits tiles of ``visit`` rows,
    with ``num_warps`` warps and a software pipeline of ``num_stages`` (Triton's default 3).
    The backward visits its diagonal tile ``min(visit, diagonal)`` rows at a time (FoX's dq:
    ``visit``): there FPA carries the in-tile minima and dq the dfield sums beside the
    accumulators, and at 64 rows a step they spill registers at the Hopper tiles, as FoX's
    dk/dv does (bench/gpu_static.py).

    Powers of two, at least 16 (the smallest ``tl.dot``), ``own`` a multiple of ``visit``.
    """

    own: int
    visit: int
    num_warps: int = 4
    num_stages: int = 3
    diagonal: int = 32

    def __post_init__(self) -> None:
        for name in ("own", "visit", "diagonal"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"Tiles.{name}: expected a power of two >= 16, got {size}")
        if self.own % self.visit:
            raise ValueError(f"Tiles: own ({self.own}) must be a multiple of visit ({self.visit})")


# (forward, backward) per device class. Hopper (sm90): flash-linear-attention's table for its
# FoX kernel (BT = 128, BS = 64, 8 warps; `fla/ops/forgetting_attn`). The interpreter runs
# fastest with 64 x 64 tiles (measured on CPU).
TILE_TABLE: dict[str, tuple[Tiles, Tiles]] = {
    "hopper": (Tiles(128, 64, 8), Tiles(128, 64, 8)),
    "ampere": (Tiles(128, 32, 4), Tiles(64, 32, 4)),
    "gpu": (Tiles(64, 32, 4), Tiles(64, 32, 4)),
    "interpreter": (Tiles(64, 64), Tiles(64, 64)),
}
# Hopper at wider rows (bytes per row of q, k, v: element size x the head dim's power of two):
# (forward, backward) tiles that keep every kernel within a block's 232,448 B of shared memory
# (bench/gpu_static.py), for rows above 256 B (16-bit D > 128, float32 D > 64) and above 512 B.
HOPPER_WIDE: dict[int, tuple[Tiles, Tiles]] = {
    512: (Tiles(128, 32, 8, 3), Tiles(128, 32, 8, 2)),
    1024: (Tiles(64, 32, 4, 2), Tiles(64, 16, 4, 2)),
    2048: (Tiles(64, 16, 4, 2), Tiles(32, 16, 4, 2)),
}


# Triton: Interdomain


@dataclass(frozen=True)
class Blocks:
    """Tile sizes: ``chunk`` tokens per state-pass step, ``sub_chunk`` tokens per output program
    (both powers of two, sub_chunk <= chunk; at least 16 on a GPU, where tl.dot needs it).

    ``diagonal`` is the form of the pairs inside a diagonal block (docs/kernels-interdomain.md
    [S2]): ``"loop"`` walks them token by token with [BS, M] tiles, ``"lag"`` turns the
    [BS, BS] scores into [BS, lag] by a skew (a gather) so that every diagonal product is a
    matmul against the table rows Lambda^k. S4D splits a
    sub-chunk into diagonal blocks of ``diag_block`` tokens (the pairs of different blocks are
    matmuls), so a GPU program can own a whole chunk (64-row products, wgmma); LegS runs one
    program per chunk (its per-position tables: docs/kernels-interdomain.md [L2]).
    ``channels``: state channels per state-pass program (at most; a power of two >= 16).
    ``columns``: S4D's forward chunk programs, when one program owns a chunk that is one diagonal
    block in the lag form, take the tokens as the columns of their products, in slices of this
    many (chunk or chunk / 2: a slice's reach must be a power of two), each slice summing
    only the lags its tokens reach (docs/kernels-interdomain.md [S2]); 0 keeps the tokens as
    rows.
    Static resource use on sm_90: ``python -m bench.gpu_static_interdomain``.
    """

    chunk: int = 64
    sub_chunk: int = 16
    num_warps: int = 8
    diagonal: str = "loop"  # the pairs inside a diagonal block: "loop" or "lag"
    channels: int = 32
    diag_block: int | None = None  # S4D: tokens per diagonal block (None: the sub-chunk)
    columns: int = 0  # S4D forward, chunk-wide lag: tokens as product columns, slices of this many


DIAGONALS = ("loop", "lag")  # the forms of a diagonal block (Blocks.diagonal)

# Per device class; any other GPU takes the default. Hopper: one S4D program per 64-token chunk,
# the chunk one diagonal block in the lag form (every product 64 rows, wgmma; no spill; a
# quarter of the 16-row programs' state reads; docs/decisions.md).
# The interpreter counts operations, not registers: whole chunks per program and wide channel
# blocks run fastest there.
HOPPER_BLOCKS = Blocks(64, 64, 8, diagonal="lag", channels=32, diag_block=64, columns=32)
INTERPRETER_BLOCKS = Blocks(64, 64, 4, diagonal="lag", channels=64, columns=32)
DEVICE_BLOCKS = {"hopper": HOPPER_BLOCKS, "ampere": Blocks(), "interpreter": INTERPRETER_BLOCKS}
# LegS's position programs take every (sequence, head) as a column of the products with the
# per-position tables, at most this many per program (docs/kernels-interdomain.md [L2])
LEGS_POSITION_COLUMNS = 64


# torch eager

EAGER_QUERY_BLOCK = 128  # FPA/FoX query rows per tile: memory O(T * block), BLAS-wide matmuls
EAGER_KEY_BLOCK: int | None = None  # keys per block left of the diagonal; None: all at once
EAGER_CHUNK = {"s4d": 64, "legs": 64}  # tokens per chunk of the Interdomain twins
CONTEXT_PARALLEL_QUERY_BLOCK = 128  # query rows per cross-chunk tile: memory O(T/P * block)


# JAX

# FPA/FoX positions per tile by implementation; Mosaic GPU needs 64 (one warpgroup's wgmma rows).
JAX_BLOCK = {"xla": 128, "pallas": 64, "mosaic": 64}
JAX_CHUNK = {"s4d": 64, "legs": 32}  # Interdomain tokens per chunk

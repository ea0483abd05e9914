"""Deterministic conformance cases with stable ids ``<op>/<family>/<n>``.

A case is built from its id alone: the seed is crc32 of the id, so ``fpa/ragged/2`` names the
same float64 arrays on every machine. Shapes come from a fixed menu so compiled backends do not
recompile per case. Assumptions that keep a case well conditioned are stated in ``note``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from attnspec.reference import fpa
from attnspec.reference import interdomain as idm
from attnspec.reference.ops import OPS

from . import session_covering, session_programs
from .covering_cases import families as covering_families
from .drawers import (
    RATIO_LAYER,
    TRAINED,
    Builder,
    Built,
    Case,
    Family,
    Inputs,
    bracket_walk,
    case_seed,
    draw_fox_inputs,
    draw_fpa_inputs,
    draw_interdomain_layer,
    draw_layer_inputs,
    legs_builder,
    s4d_builder,
    trained,
)

GENERATOR_VERSION = "1"

# FPA


# The shape menu (B, H, T, dk, dv); families pick from it by index.
FPA_SHAPES = [(1, 1, 1, 16, 16), (2, 3, 7, 16, 16), (1, 2, 64, 16, 16), (2, 1, 130, 16, 16)]
FPA_HEADDIMS = [(1, 2, 17, 1, 5), (1, 2, 17, 3, 1), (1, 2, 17, 64, 64), (1, 2, 17, 128, 32)]
FPA_RAGGED = [(2, 3, 15, 8, 8), (2, 3, 17, 8, 8), (2, 3, 63, 8, 8), (2, 3, 65, 8, 8)]
FPA_FIELD_SHAPE = (1, 2, 33, 8, 8)
SMOOTH = "inputs at least 1e-4 away from clamp zeros and segment-minimum ties"


# Menus, packings and notes that several ops' families share.
TIES = "tie case: checks the conventions of spec/fpa.md section 6"


# Packed sequences: FlashAttention's cu_seqlens with B = 1; a length-1 segment in the second.
VARLEN_OFFSETS = [(0, 15, 100, 300), (0, 1, 40, 41, 130)]
# GQA: (B, H of q, H of k and v, T).
GQA_SHAPES = [(1, 8, 2, 65), (2, 4, 1, 130), (1, 6, 3, 33)]


VARLEN = "packed sequences (cu_seqlens), each checked against the reference on its own"
GQA = "fewer key/value heads than query heads; per-token scalars per query head"


def draw_packing(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    """cu_seqlens drawn from a length menu: tile multiples (64, 128) and non-multiples, the
    longest segment never last, a length-1 segment first (n % 3 = 0), inside (1) or last (2),
    so borders fall inside late chunks of 128 as well as early ones."""
    menu = [(128, 64, 37, 90), (200, 64, 27, 129), (63, 256, 45, 64)][n % 3]
    while True:
        lengths = [int(x) for x in rng.permutation(menu)]
        if lengths[-1] != max(lengths):
            break
    lengths.insert([0, 2, len(lengths)][n % 3], 1)
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(lengths)]))


# Zero-length packed sequences (reference/packing.py: they contribute nothing): first, two in a
# row inside, last.
EMPTY_SEGMENT_OFFSETS = [(0, 0, 9, 65), (0, 9, 9, 9, 65), (0, 56, 65, 65)]
EMPTY_SEGMENT = (
    "zero-length packed sequences (contributing nothing) first, two in a row inside, and last"
)


# Varlen x GQA: (H of q, H of k and v) with a drawn packing; GQA with B > 1 and several
# key/value heads: (B, H, H_kv, T).
VARLEN_GQA_HEADS = [(4, 2), (6, 2)]
GQA_BATCH_SHAPES = [(2, 6, 3, 65), (3, 4, 2, 130)]


# Head dims above 128 (FlashAttention-class kernels split them), dk != dv: (dk, dv, T).
HEADDIM_BIG = [(192, 128, 130), (256, 192, 130), (128, 256, 65)]


# Gradients on long rows: kernels change strategy past 512 keys. (B, H, T, dk, dv), small.
LONG_GRADIENT_SHAPES = [(1, 1, 1024, 16, 16), (1, 1, 1100, 8, 16), (2, 2, 640, 16, 16)]


STRIDED_LAYOUTS = ("slice", "transpose")
CALL_ORDER = (
    "call order: a second input set of the same shape, forwards and VJPs of both interleaved "
    "in a shuffled order, each compared with its own reference"
)
STRIDED = (
    "inputs as non-contiguous views in the backend's own arrays: 'slice' (a slice of a wider "
    "array, as q from a fused qkv projection), 'transpose' (a (B, H, T, D) view of (B, T, H, D))"
)
PACKINGS = (
    "drawn packings: tile-multiple and other lengths, longest segment not last, a length-1 "
    "segment first, inside or last, borders inside late chunks"
)


# The window of (F3w), W = params["window"]: W = 1 (each query its own key), W inside a tile,
# W across tile borders (tiles of 16-128), W = T (every causal pair: one key past the last
# one a window off by one misses), then packed sequences and GQA with a window.
WINDOWS = [(65, 1), (130, 17), (257, 100), (130, 130), (200, 64), (300, 129)]
WINDOW = (
    "the window of (F3w): query i sees keys i-W+1..i (W = 1, inside a tile, across tiles, W = T)"
)


def _window_varlen(inputs: Builder) -> Builder:
    def build(rng: np.random.Generator, n: int) -> Built:
        offsets, W = [(VARLEN_OFFSETS[0], 40), (VARLEN_OFFSETS[1], 70)][n]
        built, _ = inputs(rng, offsets[-1])
        return built, {"cu_seqlens": offsets, "window": W}

    return build


def _window_gqa(inputs: Callable[[np.random.Generator, int, int, int], Inputs]) -> Builder:
    def build(rng: np.random.Generator, n: int) -> Built:
        B, H, H_kv, T = GQA_SHAPES[n]
        drawn = inputs(rng, B, H, T)
        drawn["k"], drawn["v"] = drawn["k"][:, :H_kv], drawn["v"][:, :H_kv]
        return drawn, {"window": 20 + n}

    return build


# fpa_attention


def _fpa_family(shape_list: Sequence[tuple[int, int, int, int, int]], **kw: Any) -> Builder:
    def build(rng: np.random.Generator, n: int) -> Built:
        return draw_fpa_inputs(rng, shape_list[n % len(shape_list)], **kw), {}

    return build


# Families that reach a tiled kernel's borders, precision limits and parameters. Block sizes of
# 16-128 are crossed at least three times by the longest cases, with B*H > 1 and distinct
# per-head fields.
TILE_LENGTHS = (127, 128, 129, 255, 256, 257, 300)
TILE_FIELDS = (("walk", "offset"), ("brackets", "one_walk"), ("walk", "one_walk"))


def _fpa_tiles(rng: np.random.Generator, n: int) -> Built:
    field_kind, level_kind = TILE_FIELDS[n % 3]
    B, H = (2, 2) if n % 2 else (1, 3)
    shape = (B, H, TILE_LENGTHS[n], 16, 16)
    return draw_fpa_inputs(rng, shape, field_kind=field_kind, level_kind=level_kind), {}


# Every head-dim pair meets every length: (dk, dv) x T.
HEADDIM_LENGTHS = [
    (dk, dv, T) for T in (65, 130, 257) for dk, dv in ((64, 64), (128, 128), (128, 64), (96, 96))
]


def _fpa_headdim_long(rng: np.random.Generator, n: int) -> Built:
    dk, dv, T = HEADDIM_LENGTHS[n]
    return draw_fpa_inputs(rng, (1, 2, T, dk, dv)), {}


TIE_TILES = [(kind, T) for T in (65, 130, 257) for kind in ("brackets", "constant")]


def _fpa_ties_tiles(rng: np.random.Generator, n: int) -> Built:
    kind, T = TIE_TILES[n]
    level_kind = "one_walk" if kind == "brackets" else "offset"
    return draw_fpa_inputs(rng, (1, 2, T, 16, 16), field_kind=kind, level_kind=level_kind), {}


def _fpa_scale(rng: np.random.Generator, n: int) -> Built:
    scale, T = [(0.3, 65), (2.5, 33)][n]
    return draw_fpa_inputs(rng, (1, 2, T, 16, 16), margin=1e-4), {"scale": scale}


def _fpa_large_logits(rng: np.random.Generator, n: int) -> Built:
    # s <q, k> ~ N(0, 300^2): logits in the hundreds, far beyond exp's float32 range.
    return draw_fpa_inputs(rng, (1, 2, [65, 130][n], 16, 16), logit=300.0, margin=1e-4), {}


def _fpa_low_rows(rng: np.random.Generator, n: int) -> Built:
    """Some rows have every logit near -200 (exp underflows in float32 without a row max)."""
    B, H, T, dk, dv = (1, 2, [65, 130][n], 16, 16)
    inputs = draw_fpa_inputs(rng, (B, H, T, dk, dv), margin=1e-4)
    u = rng.standard_normal(dk)
    u /= np.linalg.norm(u)
    k = 8.0 * u + 0.3 * rng.standard_normal((B, H, T, dk))  # <u, k_j> ~ 8 for every key
    q = inputs["q"]
    low = rng.random((B, H, T)) < 0.3
    q[low] = -200.0 / (8.0 / np.sqrt(dk)) * u  # s <q_i, k_j> ~ -200 +- 8 for every j
    inputs["k"] = k
    return inputs, {}


def _fpa_long_uniform(rng: np.random.Generator, n: int) -> Built:
    """Near-uniform weights over T = 2304 keys: a float16 softmax sum stalls at 2048 (the
    spacing of float16 there is 2), so half-precision accumulation is visibly wrong."""
    B, H, T, dk, dv = (1, 1, 2304, 16, 16)
    q = 1e-3 * rng.standard_normal((B, H, T, dk))
    k = rng.standard_normal((B, H, T, dk))
    v = rng.standard_normal((B, H, T, dv))
    f = 1e-3 * np.cumsum(rng.standard_normal((B, H, T)), axis=-1)
    return {"q": q, "k": k, "v": v, "field": f, "level": f - 10.0}, {}  # every key live


def _fpa_large_field(rng: np.random.Generator, n: int) -> Built:
    """Fields near +-1e4 plus an O(1) walk: O(1) penalties as differences of large numbers."""
    inputs = draw_fpa_inputs(rng, FPA_FIELD_SHAPE, margin=1e-4)
    centre = np.array([1e4, -1e4])[:, None]  # one head near +1e4, one near -1e4
    inputs["field"] = inputs["field"] + centre
    inputs["level"] = inputs["level"] + centre
    return inputs, {}


def _fpa_varlen(rng: np.random.Generator, n: int) -> Built:
    offsets = VARLEN_OFFSETS[n % 2]
    inputs = draw_fpa_inputs(rng, (1, 2, offsets[-1], 16, 16))
    return inputs, {"cu_seqlens": offsets}


def _fpa_gqa(rng: np.random.Generator, n: int) -> Built:
    B, H, H_kv, T = GQA_SHAPES[n]
    inputs = draw_fpa_inputs(rng, (B, H, T, 16, 16), margin=1e-4)
    inputs["k"] = inputs["k"][:, :H_kv]
    inputs["v"] = inputs["v"][:, :H_kv]
    return inputs, {}


def _fpa_empty_segment(rng: np.random.Generator, n: int) -> Built:
    offsets = EMPTY_SEGMENT_OFFSETS[n]
    return draw_fpa_inputs(rng, (1, 2, offsets[-1], 16, 16)), {"cu_seqlens": offsets}


def _fpa_packings(rng: np.random.Generator, n: int) -> Built:
    offsets = draw_packing(rng, n)
    return draw_fpa_inputs(rng, (1, 2, offsets[-1], 16, 16)), {"cu_seqlens": offsets}


def _fpa_varlen_gqa(rng: np.random.Generator, n: int) -> Built:
    H, H_kv = VARLEN_GQA_HEADS[n]
    offsets = draw_packing(rng, n + 1)
    inputs = draw_fpa_inputs(rng, (1, H, offsets[-1], 16, 16))
    inputs["k"], inputs["v"] = inputs["k"][:, :H_kv], inputs["v"][:, :H_kv]
    return inputs, {"cu_seqlens": offsets}


def _fpa_gqa_batch(rng: np.random.Generator, n: int) -> Built:
    B, H, H_kv, T = GQA_BATCH_SHAPES[n]
    inputs = draw_fpa_inputs(rng, (B, H, T, 16, 16), margin=1e-4)
    inputs["k"], inputs["v"] = inputs["k"][:, :H_kv], inputs["v"][:, :H_kv]
    return inputs, {}


def _fpa_headdim_big(rng: np.random.Generator, n: int) -> Built:
    dk, dv, T = HEADDIM_BIG[n]
    return draw_fpa_inputs(rng, (1, 2, T, dk, dv), margin=1e-4), {}


def _fpa_long_gradient(rng: np.random.Generator, n: int) -> Built:
    return draw_fpa_inputs(rng, LONG_GRADIENT_SHAPES[n]), {}


def _fpa_call_order(rng: np.random.Generator, n: int) -> Built:
    return draw_fpa_inputs(rng, (2, 2, 65, 16, 16), margin=1e-4), {}


def _fpa_window(rng: np.random.Generator, n: int) -> Built:
    T, W = WINDOWS[n]
    return draw_fpa_inputs(rng, (1 + n % 2, 2, T, 16, 16), margin=1e-4), {"window": W}


FPA_FAMILIES = {
    "shapes": Family(
        4, _fpa_family(FPA_SHAPES, margin=1e-4), SMOOTH, gradient=True, finite_difference=True
    ),
    "headdim": Family(
        4, _fpa_family(FPA_HEADDIMS, margin=1e-4), SMOOTH, gradient=True, finite_difference=True
    ),
    "ragged": Family(
        4, _fpa_family(FPA_RAGGED, margin=1e-4), SMOOTH, gradient=True, finite_difference=True
    ),
    "long": Family(1, _fpa_family([(1, 1, 512, 16, 16)]), "T = 512"),
    "walk": Family(
        3,
        _fpa_family([FPA_FIELD_SHAPE], margin=1e-4),
        SMOOTH,
        gradient=True,
        finite_difference=True,
    ),
    "monotone": Family(
        3,
        _fpa_family([FPA_FIELD_SHAPE], field_kind="monotone", level_kind="one_walk", margin=1e-4),
        "FoX-like field, level = field; " + SMOOTH,
        gradient=True,
        finite_difference=True,
    ),
    "brackets": Family(
        3,
        _fpa_family([FPA_FIELD_SHAPE], field_kind="brackets", level_kind="one_walk"),
        "integer field, level = field; " + TIES,
        gradient=True,
        finite_difference=False,
    ),
    "constant": Family(
        2,
        _fpa_family([FPA_FIELD_SHAPE], field_kind="constant"),
        "every segment minimum tied; " + TIES,
        gradient=True,
        finite_difference=False,
    ),
    "huge": Family(
        2,
        _fpa_family([FPA_FIELD_SHAPE], field_kind="huge"),
        "field of magnitude 1e4",
        gradient=True,
        finite_difference=False,
    ),
    "cliff": Family(2, _fpa_family([FPA_FIELD_SHAPE], field_kind="cliff"), "a 1e30 descent midway"),
    "one_walk": Family(
        2,
        _fpa_family([FPA_FIELD_SHAPE], level_kind="one_walk", margin=1e-4),
        "level = field; " + SMOOTH,
        gradient=True,
        finite_difference=True,
    ),
    "extreme_level": Family(
        2,
        _fpa_family([FPA_FIELD_SHAPE], level_kind="extreme"),
        "level offsets of +-1e4",
        gradient=True,
        finite_difference=False,
    ),
    "near_uniform": Family(
        2,
        _fpa_family([FPA_FIELD_SHAPE], field_kind="constant", logit=1e-3),
        "tiny logits, flat field: near-uniform weights; " + TIES,
        gradient=True,
        finite_difference=False,
    ),
    "near_onehot": Family(
        2,
        _fpa_family([FPA_FIELD_SHAPE], logit=12.0, margin=1e-4),
        "large logits: near one-hot weights; " + SMOOTH,
        gradient=True,
        finite_difference=True,
    ),
    "tiles": Family(
        7,
        _fpa_tiles,
        "T across tile borders (127-129, 255-257, 300), B*H > 1; walk, bracket and one-walk "
        "fields (brackets are tie cases)",
        gradient=True,
    ),
    "headdim_long": Family(
        12,
        _fpa_headdim_long,
        "dk/dv 64/64, 128/128, 128/64, 96/96 at T 65, 130, 257",
        gradient=True,
    ),
    "ties_tiles": Family(6, _fpa_ties_tiles, "ties across tile borders; " + TIES, gradient=True),
    "scale": Family(
        2, _fpa_scale, "non-default softmax scale; " + SMOOTH, gradient=True, finite_difference=True
    ),
    "large_logits": Family(
        2,
        _fpa_large_logits,
        "logits in the hundreds; " + SMOOTH,
        gradient=True,
        finite_difference=True,
    ),
    "low_rows": Family(
        2,
        _fpa_low_rows,
        "30% of rows have every logit near -200; " + SMOOTH,
        gradient=True,
        finite_difference=True,
    ),
    "long_uniform": Family(1, _fpa_long_uniform, "T = 2304, near-uniform weights, every key live"),
    "large_field": Family(
        2,
        _fpa_large_field,
        "fields near +-1e4 with O(1) penalties; " + SMOOTH,
        gradient=True,
        finite_difference=True,
    ),
    "varlen": Family(2, _fpa_varlen, VARLEN, gradient=True, requires=("fpa_attention.varlen",)),
    "gqa": Family(
        3,
        _fpa_gqa,
        GQA + "; " + SMOOTH,
        gradient=True,
        finite_difference=True,
        requires=("fpa_attention.gqa",),
    ),
    "packings": Family(
        3, _fpa_packings, PACKINGS, gradient=True, requires=("fpa_attention.varlen",)
    ),
    "empty_segment": Family(
        3, _fpa_empty_segment, EMPTY_SEGMENT, gradient=True, requires=("fpa_attention.varlen",)
    ),
    "varlen_gqa": Family(
        2,
        _fpa_varlen_gqa,
        "packed sequences with 4/2 and 6/2 query/key-value heads",
        gradient=True,
        requires=("fpa_attention.varlen", "fpa_attention.gqa"),
    ),
    "gqa_batch": Family(
        2,
        _fpa_gqa_batch,
        "GQA with B > 1 and several key/value heads (2 x 6/3, 3 x 4/2); " + SMOOTH,
        gradient=True,
        finite_difference=True,
        requires=("fpa_attention.gqa",),
    ),
    "headdim_big": Family(
        3,
        _fpa_headdim_big,
        "dk/dv 192/128, 256/192, 128/256; " + SMOOTH,
        gradient=True,
        finite_difference=True,
    ),
    "long_gradient": Family(
        3,
        _fpa_long_gradient,
        "gradients at T = 1024 and 1100 (small B, H, D), and at T = 640 with B = H = 2",
        gradient=True,
    ),
    "call_order": Family(
        1,
        _fpa_call_order,
        CALL_ORDER + "; " + SMOOTH,
        gradient=True,
        finite_difference=True,
        call_order=True,
    ),
    "strided": Family(
        2,
        _fpa_family([(2, 2, 65, 16, 16)], margin=1e-4),
        STRIDED,
        gradient=True,
        layouts=STRIDED_LAYOUTS,
    ),
    "window": Family(
        len(WINDOWS),
        _fpa_window,
        WINDOW + "; " + SMOOTH,
        gradient=True,
        finite_difference=True,
        requires=("fpa_attention.window",),
    ),
    "window_varlen": Family(
        2,
        _window_varlen(lambda rng, T: (draw_fpa_inputs(rng, (1, 2, T, 16, 16)), {})),
        WINDOW + "; " + VARLEN,
        gradient=True,
        requires=("fpa_attention.window", "fpa_attention.varlen"),
    ),
    "window_gqa": Family(
        2,
        _window_gqa(lambda rng, B, H, T: draw_fpa_inputs(rng, (B, H, T, 16, 16), margin=1e-4)),
        WINDOW + "; " + GQA + "; " + SMOOTH,
        gradient=True,
        finite_difference=True,
        requires=("fpa_attention.window", "fpa_attention.gqa"),
    ),
}


# fox_attention


def _fox_family(unit_gates: float, decay: float) -> Builder:
    def build(rng: np.random.Generator, n: int) -> Built:
        B, H, T, dk, dv = [(1, 1, 1, 8, 8), (2, 3, 17, 16, 8), (1, 2, 65, 8, 16)][n % 3]
        q, k = rng.standard_normal((2, B, H, T, dk))
        v = rng.standard_normal((B, H, T, dv))
        log_f = -rng.exponential(decay, (B, H, T)) - (0.0 if unit_gates else 1e-2)
        log_f[rng.random(log_f.shape) < unit_gates] = 0.0
        return {"q": q, "k": k, "v": v, "log_f": log_f}, {}

    return build


def _fox_empty_segment(rng: np.random.Generator, n: int) -> Built:
    offsets = EMPTY_SEGMENT_OFFSETS[n]
    return draw_fox_inputs(rng, 1, 2, offsets[-1], decay=0.05), {"cu_seqlens": offsets}


def _fox_packings(rng: np.random.Generator, n: int) -> Built:
    offsets = draw_packing(rng, n)
    return draw_fox_inputs(rng, 1, 2, offsets[-1], decay=0.05), {"cu_seqlens": offsets}


def _fox_varlen_gqa(rng: np.random.Generator, n: int) -> Built:
    H, H_kv = VARLEN_GQA_HEADS[n]
    offsets = draw_packing(rng, n + 1)
    return draw_fox_inputs(rng, 1, H, offsets[-1], decay=0.05, H_kv=H_kv), {"cu_seqlens": offsets}


def _fox_gqa_batch(rng: np.random.Generator, n: int) -> Built:
    B, H, H_kv, T = GQA_BATCH_SHAPES[n]
    return draw_fox_inputs(rng, B, H, T, H_kv=H_kv), {}


def _fox_headdim_big(rng: np.random.Generator, n: int) -> Built:
    dk, dv, T = HEADDIM_BIG[n]
    return draw_fox_inputs(rng, 1, 2, T, dk, dv), {}


def _fox_long_gradient(rng: np.random.Generator, n: int) -> Built:
    B, H, T, dk, dv = LONG_GRADIENT_SHAPES[n]
    return draw_fox_inputs(rng, B, H, T, dk, dv, decay=0.02), {}


def _fox_call_order(rng: np.random.Generator, n: int) -> Built:
    return draw_fox_inputs(rng, 2, 2, 65), {}


def _fox_large_logits(rng: np.random.Generator, n: int) -> Built:
    """Large q and k norms and the default scale: s q.k in the hundreds, and log f ~ -8, so
    the decay c_i - c_j passes -50 within a few tokens while the logits outweigh it."""
    B, H, T = [(1, 2, 33), (2, 1, 65)][n]
    inputs = draw_fox_inputs(rng, B, H, T, decay=8.0)
    inputs["q"], inputs["k"] = 18.0 * inputs["q"], 18.0 * inputs["k"]  # s q.k ~ N(0, 324^2)
    return inputs, {}


PADDED = [(0, 5, 20), (9, 0, 32)]  # left padding per row (0: none; 32: one token)


def _fox_padded(rng: np.random.Generator, n: int) -> Built:
    """A left-padded batch (B = 3, T = 33, GQA 4/2 in case 1): absent positions hold garbage
    (q, k, v x 30, log f = -20), so a backend that reads them shows it."""
    H, H_kv = [(2, 2), (4, 2)][n]
    inputs = draw_fox_inputs(rng, 3, H, 33, decay=0.3, H_kv=H_kv)
    present = np.arange(33)[None, :] >= np.array(PADDED[n])[:, None]  # (B, T)
    for name in ("q", "k", "v"):
        inputs[name] = np.where(present[:, None, :, None], inputs[name], 30.0 * inputs[name])
    inputs["log_f"] = np.where(present[:, None, :], inputs["log_f"], -20.0)
    return inputs, {"present": present}


# FoX at W = 1 has o = v and gradients of q, k and log_f exactly zero (FPA's lse cotangent keeps
# its own nonzero): a relative check of them is ill-posed, so W = 1 is an outputs-only family.
FOX_WINDOWS = [(65, 2), *WINDOWS[1:]]


def _fox_window(rng: np.random.Generator, n: int) -> Built:
    T, W = FOX_WINDOWS[n]
    return draw_fox_inputs(rng, 1 + n % 2, 2, T, decay=0.05), {"window": W}


FOX_FAMILIES = {
    "shapes": Family(
        3, _fox_family(0.0, 0.5), "gates f < 1", gradient=True, finite_difference=True
    ),
    "unit_gates": Family(
        3, _fox_family(0.4, 0.5), "40% of gates exactly 1; " + TIES, gradient=True
    ),
    "strong_decay": Family(
        2, _fox_family(0.0, 5.0), "log f ~ -5", gradient=True, finite_difference=True
    ),
    "long": Family(
        2,
        lambda rng, n: (draw_fox_inputs(rng, 2, 2, [257, 300][n], decay=0.05), {}),
        "T >= 257 across tile borders, weak decay, B*H > 1",
        gradient=True,
    ),
    "padded": Family(
        2,
        _fox_padded,
        "left-padded rows (params present (B, T) bool; needs fox_attention.padding)",
        gradient=True,
        per_case=lambda n: (("fox_attention.padding", "fox_attention.gqa")[: n + 1], ""),
    ),
    "large_logits": Family(
        2,
        _fox_large_logits,
        "large q and k norms without a custom scale: logits in the hundreds, decays past -50",
        gradient=True,
    ),
    "scale": Family(
        1,
        lambda rng, n: (draw_fox_inputs(rng, 1, 2, 65), {"scale": 0.3}),
        "scale 0.3",
        gradient=True,
        finite_difference=True,
    ),
    "varlen": Family(
        2,
        lambda rng, n: (
            draw_fox_inputs(rng, 1, 2, VARLEN_OFFSETS[n][-1], decay=0.05),
            {"cu_seqlens": VARLEN_OFFSETS[n]},
        ),
        VARLEN,
        gradient=True,
        requires=("fox_attention.varlen",),
    ),
    "gqa": Family(
        3,
        lambda rng, n: (
            draw_fox_inputs(rng, *GQA_SHAPES[n][:2], GQA_SHAPES[n][3], H_kv=GQA_SHAPES[n][2]),
            {},
        ),
        GQA,
        gradient=True,
        finite_difference=True,
        requires=("fox_attention.gqa",),
    ),
    "packings": Family(
        3, _fox_packings, PACKINGS, gradient=True, requires=("fox_attention.varlen",)
    ),
    "empty_segment": Family(
        3, _fox_empty_segment, EMPTY_SEGMENT, gradient=True, requires=("fox_attention.varlen",)
    ),
    "varlen_gqa": Family(
        2,
        _fox_varlen_gqa,
        "packed sequences with 4/2 and 6/2 query/key-value heads",
        gradient=True,
        requires=("fox_attention.varlen", "fox_attention.gqa"),
    ),
    "gqa_batch": Family(
        2,
        _fox_gqa_batch,
        "GQA with B > 1 and several key/value heads (2 x 6/3, 3 x 4/2)",
        gradient=True,
        finite_difference=True,
        requires=("fox_attention.gqa",),
    ),
    "headdim_big": Family(
        3,
        _fox_headdim_big,
        "dk/dv 192/128, 256/192, 128/256",
        gradient=True,
        finite_difference=True,
    ),
    "long_gradient": Family(
        3,
        _fox_long_gradient,
        "gradients at T = 1024 and 1100 (small B, H, D), and at T = 640 with B = H = 2",
        gradient=True,
    ),
    "call_order": Family(
        1, _fox_call_order, CALL_ORDER, gradient=True, finite_difference=True, call_order=True
    ),
    "strided": Family(
        2,
        lambda rng, n: (draw_fox_inputs(rng, 2, 2, 65), {}),
        STRIDED,
        gradient=True,
        layouts=STRIDED_LAYOUTS,
    ),
    "window": Family(
        len(FOX_WINDOWS),
        _fox_window,
        WINDOW,
        gradient=True,
        finite_difference=True,
        requires=("fox_attention.window",),
    ),
    "window_one": Family(
        1,
        lambda rng, n: (draw_fox_inputs(rng, 2, 2, 65), {"window": 1}),
        "W = 1: each query sees its own key only (o = v); outputs only, the gradients of q, "
        "k and log_f being exactly zero",
        requires=("fox_attention.window",),
    ),
    "window_varlen": Family(
        2,
        _window_varlen(lambda rng, T: (draw_fox_inputs(rng, 1, 2, T, decay=0.05), {})),
        WINDOW + "; " + VARLEN,
        gradient=True,
        requires=("fox_attention.window", "fox_attention.varlen"),
    ),
    "window_gqa": Family(
        2,
        _window_gqa(lambda rng, B, H, T: draw_fox_inputs(rng, B, H, T)),
        WINDOW + "; " + GQA,
        gradient=True,
        finite_difference=True,
        requires=("fox_attention.window", "fox_attention.gqa"),
    ),
}


# fpa_decode


def threshold_in_widest_gap(
    depths: NDArray[np.float64], low: float = 1.0, high: float = 8.0
) -> float:
    """The midpoint of the widest gap between the distinct depths in [low, high] (and its ends),
    so that no key's depth lies near the eviction threshold."""
    points = np.unique(np.concatenate([[low, high], depths[(depths > low) & (depths < high)]]))
    widest = int(np.argmax(np.diff(points)))
    return float((points[widest] + points[widest + 1]) / 2)


def _decode_family(kind: str) -> Builder:
    def build(rng: np.random.Generator, n: int) -> Built:
        B, H, T, dk, dv = [(1, 1, 1, 8, 8), (1, 2, 33, 8, 4), (2, 1, 65, 4, 8)][n % 3]
        level = None
        if kind == "brackets":
            f = 4.0 * bracket_walk(rng, (B, H, T))
            theta = 6.0  # depths are multiples of 4: no depth within 2 of theta
        elif kind == "walk":
            f = 2.0 * np.cumsum(rng.standard_normal((B, H, T)), axis=-1)
            level = f + 0.5 * rng.standard_normal((B, H, T))  # general levels: not one walk
            theta = threshold_in_widest_gap(fpa.descent_depth(f, level).ravel())
        else:
            f = np.cumsum(rng.standard_normal((B, H, T)), axis=-1)
            theta = np.inf
        q, k = rng.standard_normal((2, B, H, T, dk))
        v = rng.standard_normal((B, H, T, dv))
        level = f.copy() if level is None else level
        return {"q": q, "k": k, "v": v, "field": f, "level": level}, {"theta": theta}

    return build


def _decode_boundary(rng: np.random.Generator, n: int) -> Built:
    """Integer field and levels, so every depth is an exact integer; theta is one of them."""
    B, H, T, dk, dv = [(1, 2, 65, 8, 8), (2, 2, 130, 8, 8)][n]
    f = bracket_walk(rng, (B, H, T))
    level = f + rng.choice([-1.0, 0.0, 0.0, 1.0], size=f.shape)
    depths = fpa.descent_depth(f, level)
    theta = 2.0 if (depths == 2.0).any() else float(depths[depths > 0].min())
    q, k = rng.standard_normal((2, B, H, T, dk))
    v = rng.standard_normal((B, H, T, dv))
    return {"q": q, "k": k, "v": v, "field": f, "level": level}, {"theta": theta}


def _decode_long(rng: np.random.Generator, n: int) -> Built:
    """T >= 257 with B > 1 and H > 1; n = 2 keeps all 200 keys live (a cache beyond 128)."""
    B, H, dk, dv = 2, 2, 8, 8
    T = [257, 300, 200][n]
    if n == 2:
        f = np.cumsum(np.abs(rng.standard_normal((B, H, T))), axis=-1)  # non-decreasing
        level, theta = f.copy(), 3.0  # every depth is 0: nothing is ever evicted
    else:
        f = 2.0 * np.cumsum(rng.standard_normal((B, H, T)), axis=-1)
        level = f + 0.5 * rng.standard_normal((B, H, T))
        theta = np.inf if n == 0 else threshold_in_widest_gap(fpa.descent_depth(f, level).ravel())
    q, k = rng.standard_normal((2, B, H, T, dk))
    v = rng.standard_normal((B, H, T, dv))
    return {"q": q, "k": k, "v": v, "field": f, "level": level}, {"theta": theta}


def _decode_theta_near(rng: np.random.Generator, n: int) -> Built:
    """Integer depths (exact in float32) and theta just off an occurring depth d: d + 1e-4,
    d - 1e-4, d + 1/3, none of them exactly representable in binary."""
    B, H, T, dk, dv = [(1, 2, 65, 8, 8), (2, 2, 130, 8, 8), (1, 1, 33, 8, 8)][n]
    f = bracket_walk(rng, (B, H, T))
    level = f + rng.choice([-1.0, 0.0, 0.0, 1.0], size=f.shape)
    depths = fpa.descent_depth(f, level)
    d = 2.0 if (depths == 2.0).any() else float(depths[depths > 0].min())
    theta = d + [1e-4, -1e-4, 1.0 / 3.0][n]
    q, k = rng.standard_normal((2, B, H, T, dk))
    v = rng.standard_normal((B, H, T, dv))
    return {"q": q, "k": k, "v": v, "field": f, "level": level}, {"theta": theta}


DECODE_FAMILIES = {
    "no_eviction": Family(3, _decode_family("inf"), "theta = inf: equals the parallel op"),
    "brackets": Family(
        3, _decode_family("brackets"), "bracket field x4, theta = 6: far from all depths"
    ),
    "walk": Family(
        3,
        _decode_family("walk"),
        "random-walk field, offset levels; theta mid-way in the widest gap of the depths",
    ),
    "boundary": Family(
        2,
        _decode_boundary,
        "integer depths, theta equal to an occurring depth: evicted at pi >= theta (F7)",
    ),
    "long": Family(
        3,
        _decode_long,
        "T = 257 (theta = inf), 300 (theta in the widest gap), 200 with every key live "
        "(a cache of more than 128 keys); B = H = 2",
    ),
    "theta_near": Family(
        3,
        _decode_theta_near,
        "integer depths, theta = d + 1e-4, d - 1e-4, d + 1/3 for an occurring depth d (not exactly "
        "representable; a backend that rounds theta to half precision sees a tie)",
    ),
}


# interdomain_legs


def _legs_strided(rng: np.random.Generator, n: int) -> Built:
    return legs_builder([(2, 2, 33, 4, 8, 8)])(rng, n)


LEGS_FAMILIES = {
    "basis_size": Family(
        4,
        legs_builder([(1, 2, 80, 4, 4, M) for M in (1, 4, 16, 64)]),
        "positive features; T >> M for small M",
        gradient=True,
        finite_difference=True,
    ),
    "shapes": Family(
        3,
        legs_builder([(1, 1, 1, 3, 2, 4), (2, 3, 17, 8, 4, 8), (1, 2, 65, 4, 8, 16)]),
        "positive features",
        gradient=True,
        finite_difference=True,
    ),
    "long": Family(1, legs_builder([(1, 1, 300, 4, 4, 16)]), "T = 300, M = 16", gradient=True),
    "tiles": Family(
        3,
        legs_builder([(1, 2, 127, 4, 4, 16), (1, 2, 129, 4, 4, 64), (2, 1, 257, 4, 8, 16)]),
        "T across chunk borders (127, 129, 257), M = 16 and 64",
        gradient=True,
        finite_difference=True,
    ),
    "strided": Family(
        2, _legs_strided, "positive features; " + STRIDED, gradient=True, layouts=STRIDED_LAYOUTS
    ),
}


# interdomain_s4d


def _s4d_packings(rng: np.random.Generator, n: int) -> Built:
    readout = ("linear", "ratio")[n % 2]
    offsets = draw_packing(rng, n)
    inputs, params = s4d_builder([(1, 2, offsets[-1], 4, 4, 8)], readout=readout)(rng, n)
    return inputs, {**params, "cu_seqlens": offsets}


def _s4d_zero_mode(rng: np.random.Generator, n: int) -> Built:
    """Mode h of head h has Lambda = 0 (it forgets at once); the rest as usual."""
    readout = ("linear", "ratio")[n]
    menu = [(2, 2, 65, 4, 4, 8), (1, 3, 33, 4, 8, 4)]
    inputs, params = s4d_builder(menu, readout=readout)(rng, n)
    for h in range(inputs["lam_re"].shape[0]):
        inputs["lam_re"][h, h] = inputs["lam_im"][h, h] = 0.0
    return inputs, params


def _s4d_call_order(rng: np.random.Generator, n: int) -> Built:
    return s4d_builder([(2, 2, 65, 4, 4, 8)])(rng, n)


def _s4d_empty_segment(rng: np.random.Generator, n: int) -> Built:
    offsets = EMPTY_SEGMENT_OFFSETS[n]
    inputs, params = s4d_builder(
        [(1, 2, offsets[-1], 4, 4, 8)], readout=("linear", "ratio")[n % 2]
    )(rng, n)
    return inputs, {**params, "cu_seqlens": offsets}


S4D_FAMILIES = {
    "modes": Family(
        4,
        s4d_builder([(1, 2, 40, 4, 4, M) for M in (1, 4, 16, 64)]),
        "M from 1 to 64",
        gradient=True,
        finite_difference=True,
    ),
    "long_memory": Family(
        2,
        s4d_builder([(1, 2, 130, 4, 4, 8)], dt_range=(1e-3, 2e-3)),
        "|Lambda| near 1, T >> M",
        gradient=True,
        finite_difference=True,
    ),
    "short_memory": Family(
        2,
        s4d_builder([(1, 2, 40, 4, 4, 8)], dt_range=(1.0, 2.0)),
        "|Lambda| = exp(-dt/2) <= 0.61",
        gradient=True,
        finite_difference=True,
    ),
    "ratio": Family(
        3,
        s4d_builder(
            [(1, 2, 1, 4, 4, 4), (2, 2, 17, 4, 8, 8), (1, 3, 65, 8, 4, 16)], readout="ratio"
        ),
        "ratio readout, positive features, C near I",
        gradient=True,
        finite_difference=True,
    ),
    "shapes": Family(
        3,
        s4d_builder([(1, 1, 1, 3, 2, 4), (2, 3, 17, 8, 4, 8), (1, 2, 65, 16, 16, 16)]),
        "B*H > 1, odd sizes",
        gradient=True,
        finite_difference=True,
    ),
    "long": Family(
        2,
        s4d_builder([(2, 2, 300, 4, 4, 16), (1, 2, 257, 8, 4, 64)]),
        "T >= 257 across chunk borders, M = 16 and 64",
        gradient=True,
        finite_difference=True,
    ),
    "long_ratio": Family(
        1,
        s4d_builder([(1, 1, 2048, 4, 4, 8)], dt_range=(1e-3, 2e-3), readout="ratio"),
        "long memory (|Lambda| near 1) with the ratio readout at T = 2048",
        gradient=True,
        finite_difference=True,
    ),
    "varlen": Family(
        2,
        s4d_builder([(1, 2, 300, 4, 4, 8), (1, 2, 130, 4, 8, 4)], offsets=VARLEN_OFFSETS),
        VARLEN + "; the state resets at each boundary",
        gradient=True,
        requires=("interdomain_s4d.varlen",),
    ),
    "packings": Family(
        3,
        _s4d_packings,
        PACKINGS + "; linear and ratio readouts",
        gradient=True,
        requires=("interdomain_s4d.varlen",),
    ),
    "zero_mode": Family(
        2,
        _s4d_zero_mode,
        "a mode with Lambda = 0 in each head, linear and ratio readouts",
        gradient=True,
        finite_difference=True,
    ),
    "empty_segment": Family(
        3,
        _s4d_empty_segment,
        EMPTY_SEGMENT + "; linear and ratio readouts",
        gradient=True,
        requires=("interdomain_s4d.varlen",),
    ),
    "call_order": Family(
        1, _s4d_call_order, CALL_ORDER, gradient=True, finite_difference=True, call_order=True
    ),
    "strided": Family(
        1, s4d_builder([(2, 2, 33, 4, 4, 8)]), STRIDED, gradient=True, layouts=("slice",)
    ),
}


# The layers (fpa_layer, interdomain_layer), the sessions and the case ids


# FPA layer options: (increments,); Interdomain: (readout, gate, use_rope, output_norm).
FPA_LAYER_OPTIONS = ["signed", "logsigmoid"]
INTERDOMAIN_LAYER_OPTIONS = [
    ("linear", False, False, True),
    ("ratio", False, False, True),
    ("linear", True, False, True),
    ("linear", False, True, False),
    ("ratio", True, True, False),
]


def _fpa_layer_trained(B: int, T: int, d: int, packed: bool = False) -> Builder:
    def build(rng: np.random.Generator, n: int) -> Built:
        increments = FPA_LAYER_OPTIONS[n % 2]
        params = trained(fpa.init_fpa_params(d, 2, 4, 4, int(rng.integers(2**31))), rng)
        options: dict[str, Any] = {"increments": increments}
        if packed:
            options["cu_seqlens"] = draw_packing(rng, n)
            T_ = options["cu_seqlens"][-1]
        else:
            T_ = T
        return draw_layer_inputs(rng, params, B, T_, d), options

    return build


def _interdomain_layer_trained(
    B: int, T: int, d: int, menu: Sequence[int], packed: bool = False
) -> Builder:
    def build(rng: np.random.Generator, n: int) -> Built:
        readout, gate, use_rope, output_norm = INTERDOMAIN_LAYER_OPTIONS[menu[n % len(menu)]]
        options: dict[str, Any] = {
            "readout": readout,
            "gate": gate,
            "use_rope": use_rope,
            "output_norm": output_norm,
        }
        T_ = T
        if packed:
            options["cu_seqlens"] = draw_packing(rng, n)
            T_ = options["cu_seqlens"][-1]
        return draw_interdomain_layer(rng, B, T_, d, options)

    return build


FPA_LAYER_FAMILIES = {
    "trained": Family(
        2, _fpa_layer_trained(2, 17, 16), TRAINED + "; signed and logsigmoid increments"
    ),
    "long": Family(2, _fpa_layer_trained(2, 130, 16), TRAINED + "; T = 130 (both increments)"),
    "varlen": Family(
        1,
        _fpa_layer_trained(1, 0, 16, packed=True),
        TRAINED + "; packed sequences, each its own conv window and field",
        requires=("fpa_layer.varlen",),
    ),
}
INTERDOMAIN_LAYER_FAMILIES = {
    "trained": Family(
        5,
        _interdomain_layer_trained(2, 17, 16, range(5)),
        TRAINED
        + "; readouts linear and ratio, output gate, RoPE, output norm on and off; "
        + RATIO_LAYER,
    ),
    "long": Family(
        2,
        _interdomain_layer_trained(1, 130, 16, [0, 4]),
        TRAINED + "; T = 130 across conv and chunk borders, both readouts; " + RATIO_LAYER,
    ),
    "varlen": Family(
        1,
        _interdomain_layer_trained(1, 0, 16, [2], packed=True),
        TRAINED + "; packed sequences, each its own conv window, positions and state",
        requires=("interdomain_layer.varlen",),
    ),
}


def _layer_family(kind: str, readout: str = "linear") -> Builder:
    def build(rng: np.random.Generator, n: int) -> Built:
        B, T, d = [(1, 9, 8), (2, 17, 16)][n % 2]
        seed = int(rng.integers(2**31))
        if kind == "fpa":
            params = fpa.init_fpa_params(d, 2, 4, 4, seed)
            extra = {}
        else:
            params = idm.init_interdomain_params(d, 2, 4, 4, 8, seed)
            if readout == "ratio":
                params["norm_k_b"] += 3.0  # positive k~ keeps the denominator away from zero
                params["c_re"] += np.eye(8)
            extra = {"readout": readout}
        inputs = {"x": rng.standard_normal((B, T, d))}
        inputs.update({f"params.{k}": v for k, v in params.items()})
        return inputs, extra

    return build


def _session_builder(build: session_programs.Build) -> Builder:
    def session_case(rng: np.random.Generator, n: int) -> Built:
        return {}, {"session": build(rng, n)}

    return session_case


def _session_families(op: str) -> dict[str, Family]:
    """The decode sessions of ``op`` (session_programs.py): <prefix>/session_<family>/<n>, for
    "<op>.session", then its programs covering every pair of session-feature values
    (session_covering.py): <prefix>/session_covering/<n>."""
    families = {
        f"session_{name}": Family(count, _session_builder(build), note, requires=(f"{op}.session",))
        for name, (count, build, note) in session_programs.FAMILIES.get(op, {}).items()
    }
    if op in session_covering.OPS:
        families["session_covering"] = Family(
            len(session_covering.rows(op)),
            _session_builder(functools.partial(session_covering.program, op)),
            session_covering.NOTE,
            requires=(f"{op}.session",),
        )
    return families


# The menu: per op its families, then its decode sessions, then its all-pairs covering family
# over the feature axes (conformance/covering_cases.py).
FAMILIES: dict[str, dict[str, Family]] = {
    op: {**families, **_session_families(op), **covering_families().get(op, {})}
    for op, families in {
        "fpa_attention": FPA_FAMILIES,
        "fox_attention": FOX_FAMILIES,
        "fpa_decode": DECODE_FAMILIES,
        "interdomain_legs": LEGS_FAMILIES,
        "interdomain_s4d": S4D_FAMILIES,
        # Layers have no reference VJP: forward only [decision].
        "fpa_layer": {
            "shapes": Family(2, _layer_family("fpa"), "random layer, H = 2"),
            **FPA_LAYER_FAMILIES,
        },
        "interdomain_layer": {
            "shapes": Family(2, _layer_family("interdomain"), "S4D-Inv init, linear readout"),
            "ratio": Family(1, _layer_family("interdomain", "ratio"), "ratio readout, positive k~"),
            **INTERDOMAIN_LAYER_FAMILIES,
        },
    }.items()
}
PREFIX = {op: spec.prefix for op, spec in OPS.items()}
OP_OF_PREFIX = {prefix: op for op, prefix in PREFIX.items()}


def build_case(case_id: str, seed: int | None = None) -> Case:
    """Build one case from its id (``fpa/ragged/2``); ``seed`` overrides the id's seed."""
    try:
        prefix, family, index = case_id.split("/")
        op = OP_OF_PREFIX[prefix]
        fam = FAMILIES[op][family]
        n = int(index)
    except (ValueError, KeyError):
        raise ValueError(f"case id: unknown case {case_id!r}") from None
    if not 0 <= n < fam.count and seed is None:
        raise ValueError(f"case id: {case_id!r} out of range: family has {fam.count} cases")
    seed = case_seed(case_id) if seed is None else seed
    inputs, params = fam.build(np.random.default_rng(seed), n)
    gradient, fd, note = fam.gradient, fam.finite_difference, fam.note
    if gradient and _vanishing_gradients(op, inputs, params):
        gradient, fd = False, False
        note += "; output only: " + VANISHING
    layout = fam.layouts[n % len(fam.layouts)] if fam.layouts else ""
    requires = fam.requires
    if fam.per_case is not None:
        requires, layout = fam.per_case(n)
    return Case(
        case_id, op, seed, inputs, params, gradient, fd, note, requires, fam.call_order, layout
    )


def partner(case: Case) -> Case:
    """The second input set of a call-order case: the same family and shape, another seed."""
    return build_case(case.id, seed=(case.seed + 1) % 2**32)


VANISHING = (
    "with T = 1 (or M = 1 for LegS) every gradient but that of the values vanishes "
    "identically, so a relative error is undefined"
)


def _vanishing_gradients(op: str, inputs: Inputs, params: dict[str, Any]) -> bool:
    T = next(iter(inputs.values())).shape[-2]
    return T == 1 or (op == "interdomain_legs" and params["M"] == 1)


def case_ids(ops: list[str] | None = None) -> list[str]:
    """Every case id, in a stable order."""
    ids: list[str] = []
    for op, families in FAMILIES.items():
        if ops is None or op in ops:
            for name, fam in families.items():
                ids.extend(f"{PREFIX[op]}/{name}/{n}" for n in range(fam.count))
    return ids


def generate_cases(ops: list[str] | None = None, prefixes: list[str] | None = None) -> list[Case]:
    """All cases of the given ops whose id starts with one of ``prefixes`` (all by default)."""
    ids = [i for i in case_ids(ops) if not prefixes or any(i.startswith(p) for p in prefixes)]
    return [build_case(i) for i in ids]

"""attnspec.reference: the executable specification (NumPy + SciPy, float64).

One module per mechanism: :mod:`.fpa` (First Passage Attention and FoX), :mod:`.hippo` (HiPPO
operators), :mod:`.interdomain` (Interdomain Attention and the S4D layer).
"""

from .fpa import (
    DecodeResult,
    FoXGrads,
    FPADecoder,
    FPAGrads,
    descent_depth,
    eviction_threshold,
    fox_attention,
    fox_attention_direct,
    fox_attention_vjp,
    fpa_attention,
    fpa_attention_loops,
    fpa_attention_vjp,
    fpa_decode,
    live_keys,
    segment_argmin,
    segment_min,
    stack_live_keys,
)

__all__ = [
    "DecodeResult",
    "FPADecoder",
    "FPAGrads",
    "FoXGrads",
    "descent_depth",
    "eviction_threshold",
    "fox_attention",
    "fox_attention_direct",
    "fox_attention_vjp",
    "fpa_attention",
    "fpa_attention_loops",
    "fpa_attention_vjp",
    "fpa_decode",
    "live_keys",
    "segment_argmin",
    "segment_min",
    "stack_live_keys",
]

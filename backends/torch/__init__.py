"""attnspec.backends.torch: PyTorch eager ops, autograd, torch.library ops and Triton kernels.

Public ops in the flash-attn / flash-linear-attention layout ``[B, T, H, D]``:
:func:`fpa_attention`, :func:`fox_attention`, :func:`interdomain_s4d`, :func:`interdomain_legs`;
decoding with :class:`FPADecodeCache`, :class:`S4DDecodeState`, :class:`LegSDecodeState`; the
layers :class:`FirstPassageAttention` and :class:`InterdomainAttention`. Kernels are chosen per
call (``impl=``) from :mod:`.dispatch`; the Triton modules are imported only when a Triton
kernel is asked for. The value checks (NaN/Inf, gates, decays) are switched by
:func:`value_checks` / :func:`set_value_checks` and skipped while a CUDA graph captures.
"""

from .checks import set_value_checks, value_checks
from .decode import FPADecodeCache, LegSDecodeState, S4DDecodeState
from .modules import FirstPassageAttention, InterdomainAttention
from .ops import fox_attention, fpa_attention, interdomain_legs, interdomain_s4d

__all__ = [
    "FPADecodeCache",
    "FirstPassageAttention",
    "InterdomainAttention",
    "LegSDecodeState",
    "S4DDecodeState",
    "fox_attention",
    "fpa_attention",
    "interdomain_legs",
    "interdomain_s4d",
    "set_value_checks",
    "value_checks",
]

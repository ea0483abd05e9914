"""attnspec.backends.jax: FPA, FoX and Interdomain Attention as pure JAX functions.

Layout of ``jax.nn.dot_product_attention`` ([B, T, N, H]); they compose with jit, grad, vmap
and sharding. FPA and FoX are blockwise with a custom VJP (spec/fpa.md sections 6-7) and have
Pallas kernels behind ``implementation="pallas"``. The layers are pure functions of a parameter
dict drawn by ``init_fpa_params`` / ``init_interdomain_params``. Needs the ``jax`` extra.
"""

try:
    import jax  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "attnspec.backends.jax needs jax; install the 'jax' extra from the attnspec checkout: "
        "pip install '.[jax]' (attnspec is not on a package index; pip install jax also works)"
    ) from exc

from .decode import FPACache, fpa_cache, fpa_decode, fpa_decode_step
from .fpa import AttentionConfig, fox_attention, fpa_attention
from .interdomain import (
    S4DState,
    interdomain_legs,
    interdomain_s4d,
    interdomain_s4d_step,
    s4d_state,
)
from .layers import (
    FPALayerState,
    InterdomainLayerState,
    fpa_layer,
    fpa_layer_prefill,
    fpa_layer_state,
    fpa_layer_step,
    init_fpa_params,
    init_interdomain_params,
    interdomain_layer,
    interdomain_layer_prefill,
    interdomain_layer_state,
    interdomain_layer_step,
)

__all__ = [
    "AttentionConfig",
    "FPACache",
    "FPALayerState",
    "InterdomainLayerState",
    "S4DState",
    "fox_attention",
    "fpa_attention",
    "fpa_cache",
    "fpa_decode",
    "fpa_decode_step",
    "fpa_layer",
    "fpa_layer_prefill",
    "fpa_layer_state",
    "fpa_layer_step",
    "init_fpa_params",
    "init_interdomain_params",
    "interdomain_layer",
    "interdomain_layer_prefill",
    "interdomain_layer_state",
    "interdomain_layer_step",
    "interdomain_legs",
    "interdomain_s4d",
    "interdomain_s4d_step",
    "s4d_state",
]

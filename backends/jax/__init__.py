"""attnspec.backends.jax: JAX ops under jit, custom_vjp and Pallas kernels (the jax extra)."""

try:
    import jax  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "attnspec.backends.jax needs jax; install the 'jax' extra: pip install 'attnspec[jax]'"
    ) from exc

from .fpa import AttentionConfig, fox_attention, fpa_attention

__all__ = ["AttentionConfig", "fox_attention", "fpa_attention"]

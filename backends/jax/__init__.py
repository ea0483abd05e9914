"""attnspec.backends.jax: JAX ops under jit, custom_vjp and Pallas kernels (the jax extra)."""

"""attnspec.conformance: the cross-framework conformance and gradient kit.

It imports the reference and nothing of the backends: the reference runs as a backend through
:mod:`attnspec.conformance.numpy_backend`, and framework backends are loaded by name through
:mod:`attnspec.conformance.registry`.
"""

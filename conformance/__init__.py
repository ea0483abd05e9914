"""attnspec.conformance: the cross-framework conformance and gradient kit."""

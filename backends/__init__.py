"""attnspec.backends: optimised implementations judged against the reference."""

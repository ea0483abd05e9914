"""attnspec.backends.torch: PyTorch eager ops, autograd Functions and Triton kernels."""

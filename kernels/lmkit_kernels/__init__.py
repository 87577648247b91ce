"""lmkit Triton kernels, each with a torch reference."""

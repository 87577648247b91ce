"""Built-in quantization methods (registered by :mod:`lmkit_plugins.models`, whose
linear layers they serve): ``gguf`` keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks packed
and computes with lmkit's C kernels on the CPU; ``fp8`` keeps float8 e4m3 weights with
per-channel scales on CUDA (Triton GEMV for decode, ``torch._scaled_mm`` above)."""

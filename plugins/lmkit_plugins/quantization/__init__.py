"""Built-in quantization methods (registered by :mod:`lmkit_plugins.models`, whose
linear layers they serve): ``gguf`` keeps a GGUF file's Q8_0/Q4_0/Q4_1 blocks packed
and computes with lmkit's C kernels on the CPU."""

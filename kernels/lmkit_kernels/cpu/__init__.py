"""lmkit's C kernels for the CPU (decode, encoders), compiled on first use (see :mod:`.build`).

* :mod:`~lmkit_kernels.cpu.row_gemv` -- ``row_gemv_linear``: float32 ``x @ w.T + b``
  for decode batches (at most 32 rows), one sequential weight stream per thread
* :mod:`~lmkit_kernels.cpu.paged_decode` -- ``paged_decode_attention``: float32 decode
  attention straight from the paged KV cache (the ``cpu`` attention backend)
* :mod:`~lmkit_kernels.cpu.encoder_attention` -- ``encoder_attention``: bidirectional
  attention over packed requests, float32 or bfloat16 (the ``cpu`` backend's encoder steps)
* :mod:`~lmkit_kernels.cpu.rms_norm` -- ``add_rms_norm``: float32 residual add +
  RMSNorm for decode batches
* :mod:`~lmkit_kernels.cpu.rope` -- ``rope_inplace``: float32 RoPE of query and key
  heads in place for decode batches
* :mod:`~lmkit_kernels.cpu.qgemv` -- ``qgemv_linear``: ``x @ dequant(w).T + b`` over
  GGUF-quantized (Q8_0 / Q4_0 / Q4_1) weights
* :mod:`~lmkit_kernels.cpu.decode_stack` -- ``DecodeStack``: a Llama-family decode step
  (all layers over GGUF-quantized weights, and the final norm) in one C call over the
  kernels above, bit-identical to calling them from Python
* :mod:`~lmkit_kernels.cpu.checks` -- argument checks their checked entry points share

Importing this package imports nothing heavy; the kernel modules import torch.
"""

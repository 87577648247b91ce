"""lmkit Triton kernels, each with one checking launcher and a torch reference.

* :mod:`~lmkit_kernels.paged_attention` -- ``paged_attention``: decode (split-K) and
  causal prefill over the paged KV cache (kernels in ``paged_decode``/``paged_prefill``)
* :mod:`~lmkit_kernels.cache_write` -- ``reshape_and_cache``: new K/V through
  ``slot_mapping``
* :mod:`~lmkit_kernels.sampling` -- ``sample``: temperature / top-k / top-p sampling
  (kernels in ``sampling_kernels``)
* :mod:`~lmkit_kernels.rejection_sample` -- ``rejection_sample``: speculative-decoding
  verification (greedy prefix, rejection sampling), with its torch reference
* :mod:`~lmkit_kernels.moe` -- ``fused_moe``: mixture-of-experts MLPs as grouped GEMMs
  over tokens sorted by expert (torch reference in ``moe_ref``)
* :mod:`~lmkit_kernels.fp8` -- FP8 e4m3 weights with per-channel scales: quantization,
  ``scaled_mm_linear`` (W8A8 through ``torch._scaled_mm``, per-token activation scales
  from ``fp8_quant``) and the references; decode-sized products are ``gemv``'s kernel
  with ``weight_scale``
* :mod:`~lmkit_kernels.reference` -- the torch references the tests compare against
* :mod:`~lmkit_kernels.random_batch` -- random paged batches for tests and benchmarks

Importing this package imports nothing heavy; each module imports torch and triton.
"""

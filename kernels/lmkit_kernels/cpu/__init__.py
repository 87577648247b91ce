"""lmkit's C kernels for the CPU, compiled on first use (see :mod:`.build`).

* :mod:`~lmkit_kernels.cpu.row_gemv` -- ``row_gemv_linear``: float32 ``x @ w.T + b``
  for decode-sized inputs (at most four rows), one sequential weight stream per thread

Importing this package imports nothing heavy; :mod:`.row_gemv` imports torch.
"""

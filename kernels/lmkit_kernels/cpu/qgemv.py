"""``x @ dequant(w).T + b`` over GGUF-quantized weights on the CPU: the C q-GEMV kernel.

Weights arrive in their GGUF blocks (``Q8_0``, ``Q4_0``, ``Q4_1``: 32 weights per block
with fp16 scales, see ``qgemv.c`` for the layouts; the k-quants ``Q4_K`` and ``Q6_K``:
super-blocks of 256, see ``qgemv_k.c``), as a ``uint8`` tensor ``[out,
blocks * block_bytes]``, and are repacked once (:func:`pack_weight`, the same bytes
moved) into groups of 16 rows whose quantized weights interleave so that one AVX-512
VNNI instruction multiplies 4 weights of all 16 rows. For decode batches (at most
:data:`MAX_ROWS` rows) the kernel quantizes each row of ``x`` per block of 32 to int8,
as llama.cpp does, and sums integer block dot products scaled by both block scales: a
single stream reads about 100 MB of weights per token for the default model instead of
538 MB of float32 (k-quant rows are kept as they are, 16 rows a group, and their
activations quantized per 256 to Q8_K, as llama.cpp does). Larger batches (prefill) dequantize the weight to float32 in tiles of
rows and multiply with torch (:func:`dequantize_rows`), where the product is
compute-bound and the activations keep float32 precision.

Two builds, best first: AVX-512 VNNI (``vpdpbusd``) and AVX2 + FMA; the best one this
CPU runs is used (``LMKIT_CPU_ISA=avx2`` pins one), and each is self-checked against a
torch reference before first use, as :mod:`lmkit_kernels.cpu.row_gemv` does. The
products use ``torch.get_num_threads()`` threads: the caller and helper threads of the
kernel's own pool claim chunks of row groups (``qgemv.c``'s ``run_groups``: a helper
the OS has not scheduled delays nothing, and on a busy host the calls fall back to the
caller alone); results do not depend on the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lmkit_kernels.cpu.build import KernelUnavailable, bind_kernel_library
from lmkit_kernels.cpu.checks import require_kernel
from lmkit_kernels.cpu.kquants import KBLOCK_BYTES, KQTYPES, random_kblocks, reference_dequantize_k

__all__ = ["ALL_QTYPES", "BLOCK_BYTES", "BLOCK_SIZE", "BLOCK_VALUES", "ISAS", "MAX_ROWS", "QTYPES", "PackedWeight",
           "bind_linear", "dequantize_packed", "dequantize_rows", "pack_weight", "qgemv_isa", "qgemv_linear",
           "qgemv_unavailable_reason", "qgemv_variants"]

MAX_ROWS = 32  # inputs up to this many rows take the q8 dot-product kernel
DEQUANT_TILE_ROWS = 4096  # weight rows dequantized at once for larger inputs (of GROUP_ROWS)
BLOCK_SIZE = 32  # weights per block of Q8_0, Q4_0, Q4_1
GROUP_ROWS = 16  # weight rows per packed group (qgemv.c's GR)
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # name -> ggml type number, blocks of 32
ALL_QTYPES = QTYPES | KQTYPES  # and the k-quants (super-blocks of 256)
BLOCK_BYTES = {2: 18, 3: 20, 8: 34} | KBLOCK_BYTES  # ggml type number -> bytes per block
BLOCK_VALUES = {t: 256 if t in KBLOCK_BYTES else BLOCK_SIZE for t in BLOCK_BYTES}  # per block
SOURCE = Path(__file__).with_name("qgemv.c")
ABI = 5
ISAS = ("avx512vnni", "avx2")
ISA_ENV = "LMKIT_CPU_ISA"

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_GEMV = ([_I, _P, _L, _P, _P, _P, _L, _L, _L, _L, _I], _I)
_DEQUANT = ([_I, _I, _P, _L, _P, _L, _L, _P, _L, _I], None)
# type, x, ldx, res, ldr, norm weight, eps, res_out, ldo, w, b, y, ldy, m, n, k, threads
_GEMV_NORM = ([_I, _P, _L, _P, _L, _P, ctypes.c_float, _P, _L, _P, _P, _P, _L, _L, _L, _L, _I],
              _I)
# type, exp16, x, ldx, w, b, y, ldy, m, n, k, threads
_GEMV_SILU = ([_I, _P, _P, _L, _P, _P, _P, _L, _L, _L, _L, _I], _I)


@dataclass(frozen=True)
class PackedWeight:
    """A quantized weight ``[n, k]`` repacked for the kernel (:func:`pack_weight`):
    ``data`` is ``uint8 [ceil(n / 16) * group_bytes]`` in ggml type ``qtype``."""

    data: torch.Tensor
    qtype: int
    n: int
    k: int


QLinearFn = Callable[[torch.Tensor, PackedWeight, "torch.Tensor | None"], torch.Tensor]


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, dict[str, ctypes._CFuncPtr], str]:  # type: ignore[name-defined]
    lib, reason = bind_kernel_library(
        SOURCE, "lmkit_qgemv_abi", ABI, what="CPU quantized GEMV kernel",
        fallback="no quantized weights on the CPU", check=_check,
        functions={f"lmkit_qgemv_{isa}": _GEMV for isa in ISAS}
        | {f"lmkit_qgemv_norm_{isa}": _GEMV_NORM for isa in ISAS}
        | {"lmkit_qgemv_silu_avx512vnni": _GEMV_SILU}
        | {"lmkit_qgemv_isa_supported": ([ctypes.c_char_p], _I),
           "lmkit_qpack_group_bytes": ([_I, _L], _L),
           "lmkit_qpack": ([_I, _P, _L, _L, _L, _P], None),
           "lmkit_dequantize_rows": _DEQUANT})
    if lib is None:
        return None, {}, reason
    return lib, {isa: getattr(lib, f"lmkit_qgemv_{isa}") for isa in _usable(lib)}, ""


def _usable(lib: ctypes.CDLL) -> list[str]:
    supported = [isa for isa in ISAS if lib.lmkit_qgemv_isa_supported(isa.encode())]
    pin = os.environ.get(ISA_ENV, "").strip().lower()
    if pin in ("avx512f", "avx512"):  # row_gemv's name for its AVX-512 build
        pin = "avx512vnni"
    if not pin:
        if not supported:
            raise KernelUnavailable("this CPU runs neither AVX-512 VNNI nor AVX2 + FMA code")
        return supported
    if pin not in ISAS:
        raise KernelUnavailable(f"{ISA_ENV}={pin!r} is not one of {', '.join(ISAS)}")
    if pin not in supported:
        raise KernelUnavailable(f"{ISA_ENV}={pin} but this CPU does not run {pin} code")
    return [pin]


def reference_dequantize(qtype: int, weight: torch.Tensor, k: int) -> torch.Tensor:
    """A torch reference of the block layouts: ``uint8 [n, k/32 * bytes]`` -> float32
    ``[n, k]`` (k-quants: :func:`lmkit_kernels.cpu.kquants.reference_dequantize_k`).
    For tests and the self-check; :func:`dequantize_rows` is the fast one."""
    if qtype in KBLOCK_BYTES:
        return reference_dequantize_k(qtype, weight, k)
    n = weight.shape[0]
    blocks = weight.reshape(n, k // BLOCK_SIZE, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [n, nb, 1]
    if qtype == QTYPES["Q8_0"]:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, k)
    start = 4 if qtype == QTYPES["Q4_1"] else 2
    qs = blocks[..., start:].to(torch.int32)
    nib = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [n, nb, 32]
    c = blocks[..., 2:4].contiguous().view(torch.float16).float() if start == 4 else -8 * d
    return (d * nib + c).reshape(n, k)


def random_blocks(qtype: int, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Random well-formed blocks ``uint8 [n, k/32 * bytes]`` (finite fp16 scales)."""
    if qtype in KBLOCK_BYTES:
        return random_kblocks(qtype, n, k, generator)
    nb, size = k // BLOCK_SIZE, BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (n, nb, size), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(n, nb, 2, generator=generator) * 0.02 + 0.001).half()
    raw[..., 0:2] = scales[..., 0:1].contiguous().view(torch.uint8)
    if qtype == QTYPES["Q4_1"]:
        raw[..., 2:4] = (-scales[..., 1:2] * 8).contiguous().view(torch.uint8)
    return raw.reshape(n, nb * size)


def _check(lib: ctypes.CDLL) -> None:
    gen = torch.Generator().manual_seed(0)
    for isa in _usable(lib):
        fn = getattr(lib, f"lmkit_qgemv_{isa}")
        for qtype in BLOCK_BYTES:
            # 5 rows cover a pass of 4 and a tail; 37 outputs a partial group
            k = 3 * BLOCK_VALUES[qtype]
            raw = random_blocks(qtype, 37, k, gen)
            x = torch.randn(5, k, generator=gen)
            ref = x @ reference_dequantize(qtype, raw, k).t()
            w = _pack(lib, qtype, raw, k)
            out = _gemv(fn, x, w, None)
            if not torch.allclose(out, ref, rtol=0.05, atol=0.05 * float(ref.abs().max())):
                raise KernelUnavailable(
                    f"the compiled {isa} quantized kernel failed its self-check (type {qtype})")


class _Arena:
    """Packed weights allocated one after another in chunks of 2 MiB-aligned memory
    advised for transparent huge pages (``MADV_HUGEPAGE``): a decode step streams every
    weight once, and with 4 KiB pages the page walks cost a single core about 15% of
    its read rate (measured on the default model's step). Weights of a model land in
    load order, so a step also reads them roughly in address order."""

    CHUNK = 32 << 20
    HUGE = 2 << 20
    MADV_HUGEPAGE = 14

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A fresh ``uint8 [nbytes]`` tensor (64-byte aligned) inside a chunk."""
        nbytes = -(-nbytes // 64) * 64
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = self._new_chunk(max(self.CHUNK, nbytes)), 0
            out = self._chunk[self._used:self._used + nbytes]
            self._used += nbytes
            return out

    def _new_chunk(self, nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes + self.HUGE, dtype=torch.uint8)
        start = -raw.data_ptr() % self.HUGE
        chunk = raw[start:start + nbytes]
        libc = _libc()
        if libc is not None:  # advice only: without it the chunk keeps 4 KiB pages
            libc.madvise(ctypes.c_void_p(chunk.data_ptr()),
                         ctypes.c_size_t(nbytes // self.HUGE * self.HUGE), self.MADV_HUGEPAGE)
        return chunk


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_ARENA = _Arena()


def _pack(lib: ctypes.CDLL, qtype: int, weight: torch.Tensor, k: int) -> PackedWeight:
    n = weight.shape[0]
    groups = -(-n // GROUP_ROWS)
    data = _ARENA.alloc(groups * lib.lmkit_qpack_group_bytes(qtype, k))
    lib.lmkit_qpack(qtype, weight.data_ptr(), weight.stride(0), n, k, data.data_ptr())
    return PackedWeight(data, qtype, n, k)


def _gemv(fn: ctypes._CFuncPtr, x: torch.Tensor, w: PackedWeight,  # type: ignore[name-defined]
          bias: torch.Tensor | None) -> torch.Tensor:
    m, n = x.shape[0], w.n
    out = torch.empty(m, n, dtype=torch.float32)
    if fn(w.qtype, x.data_ptr(), x.stride(0), w.data.data_ptr(),
          None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, w.k,
          torch.get_num_threads()):
        raise MemoryError("the quantized GEMV kernel could not allocate its int8 activations")
    return out


def qgemv_isa() -> str:
    """The build in use (one of :data:`ISAS`), or ``""`` when the kernel is unavailable."""
    return next(iter(_library()[1]), "")


def qgemv_unavailable_reason() -> str:
    """Why the kernel is not usable (empty when it is)."""
    return _library()[2]


def _lib() -> ctypes.CDLL:
    return require_kernel(_library()[0], "CPU quantized GEMV kernel", qgemv_unavailable_reason())


def _check_weight(caller: str, qtype: int, weight: torch.Tensor, k: int) -> None:
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"{caller}: ggml type {qtype} is not one of "
                         f"{', '.join(f'{k}={v}' for k, v in ALL_QTYPES.items())}")
    block = BLOCK_VALUES[qtype]
    if k % block:
        raise ValueError(f"{caller}: k={k} is not a multiple of {block}, the block size of "
                         f"ggml type {qtype}")
    row_bytes = k // block * BLOCK_BYTES[qtype]
    if (weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != row_bytes
            or weight.stride(1) != 1 or weight.device.type != "cpu"):
        raise ValueError(f"{caller}: weight must be a CPU uint8 [n, {row_bytes}] with unit "
                         f"stride, got {weight.dtype} {tuple(weight.shape)} on {weight.device}")


def pack_weight(qtype: int, weight: torch.Tensor, k: int) -> PackedWeight:
    """GGUF rows ``uint8 [n, k / block * block_bytes]`` of ggml type ``qtype`` (one of
    :data:`ALL_QTYPES`' values) repacked for the kernel (once, at load; a copy: ``weight``
    can be dropped). Raises ``ValueError`` for a weight it does not take and
    ``RuntimeError`` when the kernel is unavailable."""
    lib = _lib()
    _check_weight("pack_weight", qtype, weight, k)
    return _pack(lib, qtype, weight, k)


def dequantize_rows(qtype: int, weight: torch.Tensor, k: int,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` (int64 indices; all rows when ``None``) of a quantized ``weight``
    in GGUF rows as float32 ``[len(rows), k]`` (the C kernel; embedding lookups)."""
    lib = _lib()
    count = weight.shape[0] if rows is None else rows.numel()
    out = torch.empty(count, k, dtype=torch.float32)
    idx = None if rows is None else rows.to(torch.int64).contiguous()
    lib.lmkit_dequantize_rows(qtype, 0, weight.data_ptr(), weight.stride(0),
                              None if idx is None else idx.data_ptr(), count, k,
                              out.data_ptr(), k, torch.get_num_threads())
    return out


def dequantize_packed(w: PackedWeight, start: int = 0, count: int | None = None
                      ) -> torch.Tensor:
    """Rows ``start .. start + count`` (all when ``count`` is ``None``; ``start`` a
    multiple of 16) of a packed weight as float32 ``[count, k]``."""
    lib = _lib()
    if start % GROUP_ROWS:
        raise ValueError(f"dequantize_packed: start={start} is not a multiple of {GROUP_ROWS}")
    count = w.n - start if count is None else min(count, w.n - start)
    out = torch.empty(count, w.k, dtype=torch.float32)
    offset = start // GROUP_ROWS * lib.lmkit_qpack_group_bytes(w.qtype, w.k)
    lib.lmkit_dequantize_rows(w.qtype, 1, w.data.data_ptr() + offset, 0, None, count, w.k,
                              out.data_ptr(), w.k, torch.get_num_threads())
    return out


def _make_linear(fn: ctypes._CFuncPtr) -> QLinearFn:  # type: ignore[name-defined]
    def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= MAX_ROWS:
            return _gemv(fn, x if x.stride(1) == 1 else x.contiguous(), w, bias)
        if w.n <= DEQUANT_TILE_ROWS:
            wf = dequantize_packed(w)
            return torch.addmm(bias, x, wf.t()) if bias is not None else x @ wf.t()
        out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
        for r0 in range(0, w.n, DEQUANT_TILE_ROWS):  # bounded float32 memory for big heads
            wf = dequantize_packed(w, r0, DEQUANT_TILE_ROWS)
            torch.mm(x, wf.t(), out=out[:, r0:r0 + wf.shape[0]])
        return out if bias is None else out.add_(bias)

    return linear


def bind_linear(w: PackedWeight) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The best build's ``(x, bias) -> x @ dequant(w).T + bias`` for one packed weight
    (a model's hot path: unchecked, like :func:`unchecked_qgemv`'s function, with the
    weight's arguments bound once). Decode batches call the C kernel straight from this
    one Python frame (a projection of a small model reads its weight in tens of us, so the
    per-call Python counts); larger ones take :func:`unchecked_qgemv`'s tile path."""
    _, fns, reason = _library()
    fn = require_kernel(next(iter(fns.values()), None), "CPU quantized GEMV kernel", reason)
    slow = _make_linear(fn)
    qtype, wptr, n, k = w.qtype, w.data.data_ptr(), w.n, w.k
    empty, threads, f32 = torch.empty, torch.get_num_threads, torch.float32

    def linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = x.shape[0]
        if m > MAX_ROWS or x.stride(1) != 1:
            return slow(x, w, bias)
        out = empty(m, n, dtype=f32)
        if fn(qtype, x.data_ptr(), x.stride(0), wptr, None if bias is None else bias.data_ptr(),
              out.data_ptr(), n, m, n, k, threads()):
            raise MemoryError("the quantized GEMV kernel could not allocate its int8 activations")
        return out

    return linear


def qgemv_variants() -> dict[str, QLinearFn]:
    """Every build this CPU runs, by ISA (best first), as unchecked linear functions
    ``(x, packed_weight, bias) -> y``; empty when the kernel is unavailable."""
    return {isa: _make_linear(fn) for isa, fn in _library()[1].items()}


def unchecked_qgemv() -> QLinearFn | None:
    """The best build's linear function for a model's hot path (the caller packed the
    weight once at load), or ``None`` when the kernel is not available."""
    return next(iter(qgemv_variants().values()), None)


def qgemv_linear(x: torch.Tensor, qtype: int, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [m, k] @ dequant(weight).T + bias`` in float32, checked (packs ``weight``
    on every call: for tests and one-off products; layers pack once with
    :func:`pack_weight` and call :func:`unchecked_qgemv`'s function).

    ``weight`` is ``uint8 [n, k / 32 * block_bytes]`` in ggml type ``qtype`` (one of
    :data:`ALL_QTYPES`' values) with unit stride along its bytes; ``x`` float32 CPU.
    Raises ``ValueError`` for inputs it does not take and ``RuntimeError`` when the
    kernel is unavailable.
    """
    fn = require_kernel(unchecked_qgemv(), "CPU quantized GEMV kernel",
                        qgemv_unavailable_reason())
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"qgemv_linear: x must be a float32 CPU [m, k], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    _check_weight("qgemv_linear", qtype, weight, x.shape[1])
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1
                             or bias.dtype != torch.float32):
        raise ValueError(f"qgemv_linear: bias must be a contiguous float32 [{weight.shape[0]}]")
    return fn(x, pack_weight(qtype, weight, x.shape[1]), bias)

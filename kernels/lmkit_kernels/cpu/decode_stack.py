"""A whole decode step of a Llama-family stack in one C call (``decode_stack.c``).

At batch 1 a SmolLM2-135M decode step on the CPU spends about a fifth of its time in
Python between the kernel calls of its 30 layers (the decoder layer's glue, ctypes
argument conversion for ~150 calls). :class:`DecodeStack` hands ``decode_stack.c`` a
plan built once per model (each layer's packed weights, norms and shapes, and the
addresses of the kernels the Python path calls) and, per step, one small struct (the
embeddings, RoPE rows, cache slots, block tables, context lengths, KV caches); the C
code then calls those same kernels in the same order with the same arguments, so its
output is the Python-sequenced path's bit for bit. The kernel libraries stay separate
builds: this one only receives function pointers (``ctypes.cast(fn, c_void_p)``).

It runs what the CPU's quantized fast path runs: every projection GGUF-packed for
:mod:`lmkit_kernels.cpu.qgemv` with the input norms folded into the QKV and gate-up
projections and SiLU-and-multiply into the down projection (the AVX-512 VNNI build),
RoPE over whole heads (:mod:`~lmkit_kernels.cpu.rope`), the paged decode kernel
(:mod:`~lmkit_kernels.cpu.paged_decode`) and the C RMSNorm for the final norm; the
model decides when that holds (:mod:`lmkit_plugins.models.cpu_decode_stack`).
``LMKIT_CPU_DECODE_STACK=0`` turns it off (for A/B checks); ``LMKIT_CPU_KERNELS=0``
too, with the other C kernels.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmkit_kernels.cpu.build import bind_kernel_library

__all__ = ["DISABLE_ENV", "MAX_ROWS", "DecodeStack", "LayerWeights", "QLinear",
           "decode_stack_disabled", "decode_stack_unavailable_reason", "make_decode_stack"]

MAX_ROWS = 32  # the folded kernels' and RoPE's decode-batch limit (qgemv.MAX_ROWS)
SOURCE = Path(__file__).with_name("decode_stack.c")
ABI = 3
DISABLE_ENV = "LMKIT_CPU_DECODE_STACK"
_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


class _Linear(ctypes.Structure):
    _fields_ = [("type", _I), ("w", _P), ("bias", _P), ("n", _L), ("k", _L)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("qkv_tail", _Linear), ("input_norm", _P), ("input_eps", _F),
                ("post_norm", _P), ("post_eps", _F)]


class _Plan(ctypes.Structure):
    _fields_ = [("num_layers", _L), ("hidden", _L), ("num_heads", _L), ("num_kv_heads", _L),
                ("head_dim", _L), ("intermediate", _L), ("block_size", _L), ("scale", _F),
                ("window", _L), ("final_norm", _P), ("final_eps", _F),
                ("qgemv", _P), ("qgemv_norm", _P), ("qgemv_silu", _P), ("exp16", _P),
                ("rope", _P), ("store_kv", _P), ("decode", _P), ("norm", _P),
                ("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("m", _L), ("x", _P), ("ldx", _L), ("cos", _P), ("sin", _P),
                ("slot_mapping", _P), ("block_tables", _P), ("ldbt", _L), ("seq_lens", _P),
                ("kv_caches", ctypes.POINTER(_P)), ("num_slots", _L), ("out", _P),
                ("work", _P), ("threads", _I), ("num_taps", _L),
                ("tap_layers", ctypes.POINTER(_L)), ("tap_out", ctypes.POINTER(_P))]


@dataclass(frozen=True)
class QLinear:
    """A packed projection as the kernels take it: ggml type number, the packed data,
    the bias (``None``: none), ``n`` outputs of ``k`` inputs
    (:class:`lmkit_kernels.cpu.qgemv.PackedWeight`'s fields)."""

    qtype: int
    data: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: fused QKV, O, fused gate-up and down projections, and the two
    norms (float32 ``[hidden]`` weights and their eps); ``qkv_tail``: the fused QKV's last
    rows when their type differs from the first ones' (``qkv`` then holds the first)."""

    qkv: QLinear
    o: QLinear
    gate_up: QLinear
    down: QLinear
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv_tail: QLinear | None = None


def decode_stack_disabled() -> bool:
    """Whether ``LMKIT_CPU_DECODE_STACK`` turns the executor off."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    return bind_kernel_library(
        SOURCE, "lmkit_decode_stack_abi", ABI, what="CPU decode-stack executor",
        fallback="the Python-sequenced decoder layers", functions={
            "lmkit_decode_stack": ([ctypes.POINTER(_Plan), ctypes.POINTER(_Step)], _I),
            "lmkit_decode_stack_work_floats": ([ctypes.POINTER(_Plan), _L], _L)})


def decode_stack_unavailable_reason() -> str:
    """Why the executor's library is not usable (empty when it is)."""
    return _library()[1]


def _address(fn: Any) -> int:
    value = ctypes.cast(fn, ctypes.c_void_p).value
    assert value, "a kernel entry point without an address"
    return value


# the ABI of each library whose entry points decode_stack.c's typedefs declare: a
# library with another ABI may have other signatures, so the executor stays off
_ABIS = {"qgemv": 5, "rope": 1, "paged_decode": 1, "rms_norm": 1}


@functools.cache
def _kernel_addresses() -> tuple[dict[str, int] | None, str]:
    """The entry points the executor calls, by role, or ``(None, why not)``."""
    from lmkit_kernels.cpu import paged_decode, qgemv, rms_norm, rope
    from lmkit_kernels.cpu.qgemv_fold import _torch_exp16

    modules = {"qgemv": qgemv, "rope": rope, "paged_decode": paged_decode,
               "rms_norm": rms_norm}
    for name, module in modules.items():
        if module.ABI != _ABIS[name]:
            return None, (f"{name}'s ABI is {module.ABI}, decode_stack.c calls ABI "
                          f"{_ABIS[name]}: update its typedefs and _ABIS")
    qlib, fns, reason = qgemv._library()
    if qlib is None:
        return None, reason
    isa = next(iter(fns), "")
    exp16 = _torch_exp16()
    if isa != "avx512vnni" or exp16 is None:
        return None, ("the SiLU-folded down projection needs qgemv's AVX-512 VNNI build and "
                      "torch's AVX-512 Sleef expf")
    libs = {"rope": rope._library(), "paged_decode": paged_decode._library(),
            "rms_norm": rms_norm._library()}
    for name, (lib, why) in libs.items():
        if lib is None:
            return None, f"the {name} kernel is unavailable: {why}"
    rope_lib, pd_lib, norm_lib = (libs[n][0] for n in ("rope", "paged_decode", "rms_norm"))
    return {"qgemv": _address(fns[isa]),
            "qgemv_norm": _address(getattr(qlib, f"lmkit_qgemv_norm_{isa}")),
            "qgemv_silu": _address(qlib.lmkit_qgemv_silu_avx512vnni), "exp16": exp16,
            "rope": _address(rope_lib.lmkit_rope_inplace),  # type: ignore[union-attr]
            "store_kv": _address(pd_lib.lmkit_store_kv),  # type: ignore[union-attr]
            "decode": _address(pd_lib.lmkit_paged_decode),  # type: ignore[union-attr]
            "norm": _address(norm_lib.lmkit_add_rms_norm)}, ""  # type: ignore[union-attr]


def _linear(q: QLinear | None) -> _Linear:
    if q is None:
        return _Linear(0, None, None, 0, 0)
    return _Linear(q.qtype, q.data.data_ptr(), None if q.bias is None else q.bias.data_ptr(),
                   q.n, q.k)


class DecodeStack:
    """The plan of one model (see the module docstring); :meth:`run` runs a step.

    Holds references to every tensor whose address the plan keeps, so the plan stays
    valid as long as this object lives (rebuild it when weights are reloaded). Runs one
    step at a time (the model runner's): the step struct and scratch are reused.
    """

    def __init__(self, layers: Sequence[LayerWeights], *, hidden: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate: int, block_size: int,
                 scale: float, window: int, final_norm: torch.Tensor, final_eps: float,
                 kernels: dict[str, int]) -> None:
        self._keep = (list(layers), final_norm)
        self.hidden, self.head_dim = hidden, head_dim
        self._layers = (_Layer * len(layers))(*[
            _Layer(_linear(w.qkv), _linear(w.o), _linear(w.gate_up), _linear(w.down),
                   _linear(w.qkv_tail), w.input_norm.data_ptr(), w.input_eps,
                   w.post_norm.data_ptr(), w.post_eps)
            for w in layers])
        self._plan = _Plan(len(layers), hidden, num_heads, num_kv_heads, head_dim,
                           intermediate, block_size, scale, window, final_norm.data_ptr(),
                           final_eps, kernels["qgemv"], kernels["qgemv_norm"],
                           kernels["qgemv_silu"], kernels["exp16"], kernels["rope"],
                           kernels["store_kv"], kernels["decode"], kernels["norm"],
                           self._layers)
        lib = _library()[0]
        assert lib is not None
        self._run, self._plan_ref = lib.lmkit_decode_stack, ctypes.byref(self._plan)
        work = lib.lmkit_decode_stack_work_floats(self._plan_ref, MAX_ROWS)
        self._work = torch.empty(work, dtype=torch.float32)
        self._step = _Step()
        self._step.work = self._work.data_ptr()
        self._step_ref = ctypes.byref(self._step)
        self._caches: list[torch.Tensor] | None = None
        self._cache_ptrs = (_P * len(layers))()

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Point the plan at ``kv_caches`` (one float32 contiguous ``[2, num_blocks,
        block_size, num_kv_heads, head_dim]`` per layer; the same list object is
        recognised on later steps)."""
        for i, cache in enumerate(kv_caches):
            self._cache_ptrs[i] = cache.data_ptr()
        self._step.kv_caches = self._cache_ptrs
        self._step.num_slots = kv_caches[0].shape[1] * kv_caches[0].shape[2]
        self._caches = kv_caches

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            kv_caches: list[torch.Tensor], taps: Sequence[int] = (),
            tapped: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The final (normed) hidden states ``[m, hidden]`` of a decode step.

        ``x``: float32 embeddings ``[m <= MAX_ROWS, hidden]`` (unit stride along the
        row); ``cos``/``sin``: contiguous ``[m, 1, head_dim]``; ``slot_mapping`` int64
        ``[m]``, ``block_tables`` int32 ``[m, max_blocks]`` (unit stride along blocks),
        ``seq_lens`` int32 ``[m]`` (contiguous): the paged decode kernel's arguments, a
        row per token. ``taps``: layer indices (below the layer count) whose incoming
        stream (the residual before the layer, ``x + res``; layer 0: ``x``) is appended
        to ``tapped`` in that order, ``[m, hidden]`` each, as the Python layers' draft-head
        taps. Unchecked (the model's hot path; the caller guarantees these).
        """
        if kv_caches is not self._caches:
            self.set_kv_caches(kv_caches)
        m = x.shape[0]
        out = torch.empty(m, self.hidden, dtype=torch.float32)
        s = self._step
        s.m, s.x, s.ldx, s.cos, s.sin = m, x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr()
        s.slot_mapping, s.block_tables = slot_mapping.data_ptr(), block_tables.data_ptr()
        s.ldbt, s.seq_lens = block_tables.stride(0), seq_lens.data_ptr()
        s.out, s.threads = out.data_ptr(), torch.get_num_threads()
        outs = [torch.empty(m, self.hidden, dtype=torch.float32) for _ in taps]
        s.num_taps = len(outs)
        if outs:  # (arrays kept alive by the locals until the call returns)
            layers = (_L * len(outs))(*taps)
            addresses = (_P * len(outs))(*[t.data_ptr() for t in outs])
            s.tap_layers, s.tap_out = layers, addresses
        if self._run(self._plan_ref, self._step_ref):
            raise MemoryError("the CPU decode-stack executor: a kernel could not allocate "
                              "its scratch memory")
        if tapped is not None:
            tapped.extend(outs)
        return out


def make_decode_stack(layers: Sequence[LayerWeights], **shape: object
                      ) -> tuple[DecodeStack | None, str]:
    """A :class:`DecodeStack` over ``layers`` (keyword arguments: its constructor's), or
    ``(None, why not)`` when it is turned off or a library it needs is unavailable."""
    if decode_stack_disabled():
        return None, f"turned off by {DISABLE_ENV}=0"
    kernels, reason = _kernel_addresses()
    if kernels is None:
        return None, reason
    if _library()[0] is None:
        return None, decode_stack_unavailable_reason()
    return DecodeStack(layers, kernels=kernels, **shape), ""  # type: ignore[arg-type]

"""Argument checks shared by the kernel launchers, and small launch helpers.

Every launcher validates its tensors here before it launches anything, so a wrong
shape, dtype, device or stride is a :class:`ValueError` naming the argument, what was
expected and what arrived -- never a silent out-of-bounds read on the device.
These checks read only tensor metadata (no device synchronisation), so launchers stay
safe to call inside CUDA-graph capture.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def dot_needs_f32(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands of ``dtype`` must be upcast to float32 before the dot.

    The interpreter computes ``tl.dot`` in numpy, which has no bfloat16: bf16 operands
    come out as garbage. On the GPU bf16 dots run natively on tensor cores.
    """
    return is_interpreting() and dtype == torch.bfloat16


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_tensor(name: str, t: object, *, ndim: int | None = None,
                 dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None, last_dim_contiguous: bool = False,
                 contiguous: bool = False) -> torch.Tensor:
    """Validate one launcher argument and return it.

    :param name: the argument's name, used in the error message.
    :param ndim: required number of dimensions.
    :param dtypes: allowed dtypes.
    :param device: the device it must be on (the launcher's main tensor's device).
    :param last_dim_contiguous: require ``stride(-1) == 1`` (kernels index the last
        dimension with unit stride and take the other strides as arguments).
    :param contiguous: require a fully contiguous tensor.
    :raises ValueError: on the first mismatch, saying how to fix it.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; "
                         f"expected one of: {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}; "
                         f"move it with .to({str(device)!r})")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape "
                         f"{tuple(t.shape)}); call .contiguous() first")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension (strides "
                         f"{t.stride()}); call .contiguous() first")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Raise ValueError unless ``t.shape`` matches ``expected`` (``None`` = any size)."""
    shape = tuple(t.shape)
    if len(shape) != len(expected) or any(
            e is not None and s != e for s, e in zip(shape, expected, strict=False)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(shape)}")


def check_scale_and_bias(x: torch.Tensor, n: int, weight_scale: torch.Tensor | None,
                         bias: torch.Tensor | None) -> None:
    """A projection's optional per-output-channel ``weight_scale`` (float32 ``[n]``,
    contiguous) and ``bias`` (``[n]`` in ``x``'s dtype, contiguous), on ``x``'s device."""
    if weight_scale is not None:
        check_tensor("weight_scale", weight_scale, ndim=1, dtypes=(torch.float32,),
                     device=x.device, contiguous=True)
        check_shape("weight_scale", weight_scale, (n,))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device, contiguous=True)
        check_shape("bias", bias, (n,))


def check_batch_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       block_tables: torch.Tensor, device: torch.device) -> int:
    """Validate a paged-attention batch's layout tensors; returns ``num_reqs``.

    :param query_start_loc: int32 ``[num_reqs + 1]``, contiguous.
    :param seq_lens: int32 ``[num_reqs]``, contiguous.
    :param block_tables: int32 ``[>= num_reqs, max_blocks]``, unit last stride.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,),
                 device=device, contiguous=True)
    num_reqs = query_start_loc.shape[0] - 1
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device,
                 contiguous=True)
    check_shape("seq_lens", seq_lens, (num_reqs,))
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device,
                 last_dim_contiguous=True)
    if block_tables.shape[0] < num_reqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_reqs} requests")
    return num_reqs


def check_slot_mapping(slot_mapping: torch.Tensor, device: torch.device,
                       **sources: torch.Tensor) -> int:
    """Validate a cache write's ``slot_mapping`` (int32 or int64 ``[num_tokens]``,
    contiguous) against the row counts of the tensors it writes from (by name, e.g.
    ``key=..., value=...``); returns ``num_tokens``.

    :raises ValueError: on a dtype, device or stride mismatch, or a source with fewer
        rows than ``slot_mapping`` has entries.
    """
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32),
                 device=device, contiguous=True)
    num_tokens = slot_mapping.shape[0]
    if any(t.shape[0] < num_tokens for t in sources.values()):
        raise ValueError(f"slot_mapping has {num_tokens} entries but {'/'.join(sources)} have "
                         f"only {'/'.join(str(t.shape[0]) for t in sources.values())} rows")
    return num_tokens

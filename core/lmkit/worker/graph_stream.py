"""The side stream every CUDA graph of this process is captured on (decode, piecewise,
draft passes), one per device; and the current stream, looked up cheaply.

torch keeps a cuBLAS workspace (32 MiB on Hopper) for every stream a matrix product ran
on, for the life of the process: capturing on a new stream per engine left one
workspace behind for every engine built and shut down in a process.
"""

from __future__ import annotations

import functools

import torch


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's capture stream for CUDA ``device`` (made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capture_stream(index)


@functools.cache
def _capture_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))


_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
# torch's C API for the current device and its current stream's raw handle (absent from
# builds without CUDA, where current_stream() is never called)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream() -> torch.cuda.Stream:
    """``torch.cuda.current_stream()`` of the current device, without its Python-level
    device lookup (tens of microseconds a call; a step records several events): the
    stream object is kept by its device and raw handle, read through torch's C API."""
    if _get_device is None or _get_raw_stream is None:  # (a torch without them: slowly)
        return torch.cuda.current_stream()
    index = _get_device()
    key = (index, _get_raw_stream(index))
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.current_stream(index)
    return stream


def record_event(event: torch.cuda.Event | None = None) -> torch.cuda.Event:
    """Record ``event`` (default: a new one) on the current stream; returns it."""
    event = torch.cuda.Event() if event is None else event
    event.record(current_stream())
    return event

"""The side stream every CUDA graph of this process is captured on (decode, piecewise,
draft passes), one per device.

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

"""CUDA-graph capture and interleaved replay timing shared by the kernel-chain benches
(``decode_chain.py``, ``overlap_probe.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` run twice eagerly (compiles, warms cuBLAS), then captured: the graph and
    the output tensor its replays write."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    return graph, out


def time_replays(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int, replays: int
                 ) -> dict[str, list[float]]:
    """Milliseconds per replay of each graph: ``rounds`` rounds in which every graph in
    turn replays once untimed, then ``replays`` times between two CUDA events."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            graph.replay()
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / replays)
    return times

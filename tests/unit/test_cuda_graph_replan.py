"""The CUDA-graph runner plans a replay only when its backend needs it: a backend that
declares ``supports_in_place_decode_metadata`` keeps the plan a graph was captured
with valid for all its replays (only the metadata buffers change), so replays skip
``plan``; other backends are planned before every replay, and eager ("padded") runs
always plan. Stand-in model, backends and graphs: the CPU cannot capture."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lmkit.worker.cuda_graphs import CudaGraphRunner


class PlannedAttention:
    supports_in_place_decode_metadata = False

    def __init__(self) -> None:
        self.plans = 0

    def plan(self, metadata) -> None:
        self.plans += 1


class InPlaceAttention(PlannedAttention):
    supports_in_place_decode_metadata = True


class StandInModel:
    def __init__(self, attn) -> None:
        self.attn = attn

    def kv_cache_groups(self, num_layers: int):
        return (SimpleNamespace(attn=self.attn),)

    def __call__(self, ids, positions, ctx):
        return torch.zeros(len(ids), 4)


class StandInGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.mark.parametrize("attention, replans", [(PlannedAttention, True),
                                                 (InPlaceAttention, False)])
def test_replays_plan_only_for_backends_that_need_it(attention, replans):
    attn = attention()
    runner = CudaGraphRunner(StandInModel(attn), [torch.zeros(1)], torch.device("cpu"),
                             max_num_seqs=4, max_model_len=64, block_size=16)
    assert runner.replan_replays is replans
    runner.use_graphs = True  # as if captured: one stand-in graph for every size
    graph = StandInGraph()
    runner._graphs = {bs: (graph, torch.zeros(bs, 4), []) for bs in runner.sizes}
    tables = np.array([[1, 2], [3, 4]], dtype=np.int32)
    for step in range(3):
        positions = np.array([20 + step, 5 + step])
        runner.run_decode(np.array([7, 8]), positions, positions + 16, positions + 1, tables)
    assert graph.replays == 3 and attn.plans == (3 if replans else 0)
    # the metadata still reaches the buffers the captured kernels read
    assert runner._seq_lens[:2].tolist() == [23, 8]
    assert runner._packed[2:4].tolist() == [22, 7]  # positions of size 2
    runner.use_graphs = False  # eager ("padded") runs always plan
    runner.run_decode(np.array([7]), np.array([3]), np.array([19]), np.array([4]), tables[:1])
    assert attn.plans == (4 if replans else 1) and graph.replays == 3

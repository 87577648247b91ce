"""The runner's persistent batch starts its rows narrow (``INITIAL_ROW_TOKENS``), not
``max_model_len`` wide, and doubles them (up to the context limit) when a request needs
more: a long-context model no longer allocates hundreds of MiB of host memory up front,
and a request past the initial width keeps every token in its place."""

from __future__ import annotations

import numpy as np
import pytest
from lmkit.api import SamplingParams
from lmkit.worker import input_batch as input_batch_module
from lmkit.worker.input_batch import CachedRequestState, InputBatch

BLOCK = 4


def _state(rid: str, prompt: list[int], num_computed: int = 0) -> CachedRequestState:
    return CachedRequestState(rid, list(prompt), [], SamplingParams(), None, None, num_computed)


def _blocks(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + -(-num_tokens // BLOCK)))


def test_rows_start_at_the_initial_width_not_the_context_limit():
    # a long-context model: 131072 tokens, 256 rows
    batch = InputBatch(256, 131072, 16, 2048)
    assert batch.token_ids.shape == (256, 4096 + 1)
    assert batch.token_ids.nbytes == 256 * 4097 * 8  # 8 MiB, not 256 MiB (131073 wide)
    assert batch.block_table.shape == (256, 4096 // 16 + 1)
    assert batch._block_tables.shape == (256, 4096 // 16 + 1)  # the pinned step copy too
    # a model whose context fits the initial width: as wide as before
    small = InputBatch(8, 100, BLOCK, 64)
    assert small.token_ids.shape == (8, 101) and small.block_table.shape == (8, 26)


def _ops(batch: InputBatch, rng: np.random.Generator) -> dict[str, list[int]]:
    """Requests short and long (longer than a narrow row), decoded past the narrow width,
    with drafts, removals (a long row moves into a short one's place) and new blocks;
    returns each live request's tokens."""
    known: dict[str, list[int]] = {}
    for rid, n in (("short", 5), ("long", 70), ("mid", 12)):
        known[rid] = rng.integers(1, 1000, n).tolist()
        batch.add_request(_state(rid, known[rid], n - 1), _blocks(100 * len(known), n + 1))
    for _ in range(40):  # decode: every row one token a step (blocks as they fill)
        for rid, tokens in known.items():
            row = batch.row_of[rid]
            new = int(rng.integers(1, 1000))
            batch.append_tokens(row, [new])
            tokens.append(new)
            batch.num_computed[row] = len(tokens) - 1
            if int(batch.num_blocks[row]) * BLOCK < len(tokens) + 1:
                batch.append_block_ids(row, [int(rng.integers(1000, 2000))])
    batch.remove_request("short")  # "mid" (the last row) moves into row 0
    del known["short"]
    return known


def test_a_request_longer_than_the_initial_width_keeps_its_tokens(monkeypatch):
    def run(initial: int | None):
        if initial is not None:
            monkeypatch.setattr(input_batch_module, "INITIAL_ROW_TOKENS", initial)
        batch = InputBatch(2, 200, BLOCK, 16)  # 3 requests: the rows grow too
        known = _ops(batch, np.random.default_rng(0))
        row = batch.row_of["long"]
        batch.write_draft_tokens(row, [7, 8, 9])
        rows = np.array([batch.row_of["mid"], row], dtype=np.int64)
        n_long = len(known["long"])
        step = batch.prepare(rows, np.array([1, 4], dtype=np.int64), 1)
        return batch, known, step, n_long

    wide, known_w, step_w, n_long = run(None)  # 200 < 4096: rows 201 wide from the start
    assert wide.token_ids.shape[1] == 201
    narrow, known_n, step_n, _ = run(8)
    assert known_n == known_w  # the same made-up tokens
    # started 9 wide, doubled (9 -> 18 -> 36 -> 72 -> 144) as the long request needed
    assert narrow.token_ids.shape[1] == 144
    assert narrow.block_table.shape[1] == 48  # 8 / BLOCK + 1 = 3, doubled (28 blocks)
    for rid, tokens in known_n.items():
        row = narrow.row_of[rid]
        assert int(narrow.num_tokens[row]) == len(tokens)
        assert narrow.token_ids[row, :len(tokens)].tolist() == tokens
        nb = int(narrow.num_blocks[row])
        assert (narrow.block_table[row, :nb].tolist()
                == wide.block_table[wide.row_of[rid], :nb].tolist())
    assert narrow.token_ids[narrow.row_of["long"], n_long:n_long + 3].tolist() == [7, 8, 9]
    # the step packs the same inputs: same tokens, positions, slots, tables
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "block_tables"):
        assert getattr(step_n, name).tolist() == getattr(step_w, name).tolist(), name
    assert step_n.input_ids.tolist() == [known_n["mid"][-1], known_n["long"][-1], 7, 8, 9]


def test_growth_doubles_up_to_the_context_limit(monkeypatch):
    monkeypatch.setattr(input_batch_module, "INITIAL_ROW_TOKENS", 16)
    batch = InputBatch(1, 100, BLOCK, 16)
    assert batch.token_ids.shape[1] == 17 and batch.block_table.shape[1] == 5
    batch.add_request(_state("r", [1, 2, 3]), [0])
    widths = []
    for t in range(4, 100):  # one token at a time, up to the context limit
        batch.append_tokens(0, [t])
        widths.append(batch.token_ids.shape[1])
    assert sorted(set(widths)) == [17, 34, 68, 101]  # doubled, then capped at 100 + 1
    assert batch.token_ids[0, :99].tolist() == list(range(1, 100))
    batch.append_block_ids(0, list(range(1, 25)))  # 25 blocks: 100 tokens
    assert batch.block_table.shape[1] == 26  # 5 -> 10 -> 20 -> 26 (100 / 4 + 1)
    batch.write_draft_tokens(0, [5, 6, 7])  # drafts past the limit: as wide as they need
    assert batch.token_ids.shape[1] == 102
    assert batch.token_ids[0, :102].tolist() == [*range(1, 100), 5, 6, 7]


@pytest.mark.slow
def test_engine_decodes_past_the_initial_width_with_the_same_tokens(tmp_path, monkeypatch):
    from lmkit.frontend.llm import LLM
    from lmkit.testing.tiny_model import make_tiny_model

    model = str(make_tiny_model(tmp_path / "tiny"))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (3, 20, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=2, max_tokens=50, ignore_eos=True)]

    def run() -> tuple[list[list[int]], int]:
        llm = LLM(model, device="cpu", dtype="float32", attention="torch", max_model_len=128,
                  num_blocks=64, block_size=BLOCK, max_num_batched_tokens=16, progress=False)
        try:
            outs = llm.generate(prompts, params)
            width = llm.engine.executor.runner.input_batch.token_ids.shape[1]
            return [list(o.outputs[0].token_ids) for o in outs], width
        finally:
            llm.shutdown()

    before, width = run()  # 128 < 4096: rows 129 wide from the start, as before
    assert width == 129
    monkeypatch.setattr(input_batch_module, "INITIAL_ROW_TOKENS", 8)
    after, width = run()
    assert width == 72  # 9 wide at first, doubled (9 -> 18 -> 36 -> 72) for 57 tokens
    assert after == before
    assert [len(t) for t in after] == [40, 30, 50]

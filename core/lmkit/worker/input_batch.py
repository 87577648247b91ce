"""The model runner's persistent view of the running requests.

:class:`InputBatch` keeps one row per request the runner holds, in preallocated numpy
arrays: its known tokens (prompt + output), how many of them are computed, its block
table. Rows stay dense (a removed row is filled by the last one), so a step's host
work is a handful of vectorised numpy operations over the scheduled rows, never a
loop over tokens. :meth:`InputBatch.prepare` turns one step's schedule into the
packed ``input_ids``, ``positions`` and ``slot_mapping`` the model and the attention
backend consume (vLLM v1's ``InputBatch`` / ``_prepare_inputs`` in spirit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmkit.api.attention import AttentionMetadata
from lmkit.api.outputs import TokenLogprob
from lmkit.api.sampling_params import SamplingParams
from lmkit.sample.sampler import make_generator

if TYPE_CHECKING:
    from lmkit.api.scheduler_output import NewRequestData, SchedulerOutput

# tokens a row holds before it first grows: rows start this wide, not max_model_len wide
# (at 131072 tokens x 256 rows, int64 token ids alone would take 256 MiB up front, for
# rows that mostly hold short requests); a longer request doubles them, up to the limit
INITIAL_ROW_TOKENS = 4096


@dataclass
class CachedRequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None
    num_computed_tokens: int
    # prompt logprobs gathered over the prefill chunks; None once sent (or not asked)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device,
                 default_eos_token_id: int | None,
                 paused: dict[str, torch.Generator] | None = None) -> CachedRequestState:
        """The runner's copy of a newly scheduled (or resumed) request: its own seeded
        generator (for a resumed request, the one it drew from before it was preempted,
        taken from ``paused``), the model's EOS unless the request names one, and room
        for prompt logprobs from its first computed position (earlier ones are prefix
        hits)."""
        params = new.sampling_params
        resumed = bool(new.output_token_ids)
        generator = paused.pop(new.req_id, None) if paused is not None else None
        if generator is None and params.seed is not None:
            generator = make_generator(params.seed, device)
        return cls(
            req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids), sampling_params=params,
            generator=generator,
            eos_token_id=(default_eos_token_id if new.eos_token_id is None
                          else new.eos_token_id),
            num_computed_tokens=new.num_computed_tokens,
            prompt_logprobs=([None] * (new.num_computed_tokens + 1)
                             if params.prompt_logprobs is not None and not resumed else None))

    @staticmethod
    def pause_generators(so: SchedulerOutput, requests: dict[str, CachedRequestState],
                         paused: dict[str, torch.Generator]) -> None:
        """Before the runner drops the states of ``so``'s preempted requests (and of those
        resent without a preemption notice), keep their seeded generators in ``paused``
        (forgetting those of finished requests): a resumed request goes on drawing where
        it stopped, so its samples are those of a run without the preemption."""
        for rid in (*so.preempted_req_ids, *(new.req_id for new in so.scheduled_new_reqs)):
            state = requests.get(rid)
            if state is not None and state.generator is not None:
                paused[rid] = state.generator
        for rid in so.finished_req_ids:
            paused.pop(rid, None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class StepInputs:
    """One step's packed inputs, as views of the batch's persistent host buffers.

    Requests appear in step order (decodes first); ``rows`` maps step order to batch rows.
    """

    rows: np.ndarray  # int64 [num_reqs], batch row of each scheduled request
    num_scheduled: np.ndarray  # int64 [num_reqs]
    cu_num_tokens: np.ndarray  # int64 [num_reqs], end of each request's tokens
    num_computed: np.ndarray  # int64 [num_reqs], computed before this step
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, num_blocks_this_step]
    num_decodes: int
    # a draft-tree verification (lmkit.worker.tree_step): per request its tree region
    # (int32, 0: causal) and per token its mask bits (int64), host; None: all causal
    tree_region: np.ndarray | None = None
    tree_mask: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_num_tokens[-1]) if len(self.cu_num_tokens) else 0

    def attention_metadata(self, dev: StepInputs | None = None) -> AttentionMetadata:
        """This step's attention metadata: the device tensors of ``dev`` (its copy on
        the model's device, :meth:`DeviceInputs.copy`; default: this step's own), the
        host copies of this step."""
        dev = self if dev is None else dev
        seq_lens = self.seq_lens.numpy()
        return AttentionMetadata(
            num_reqs=self.num_reqs, num_actual_tokens=self.num_tokens,
            max_query_len=int(self.num_scheduled.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc=dev.query_start_loc, seq_lens=dev.seq_lens,
            block_tables=dev.block_tables, slot_mapping=dev.slot_mapping,
            query_start_loc_cpu=self.query_start_loc, seq_lens_cpu=self.seq_lens,
            num_decodes=self.num_decodes, **tree_metadata(self.tree_region, self.tree_mask,
                                                          dev.slot_mapping.device))


def tree_metadata(region: np.ndarray | None, mask: np.ndarray | None,
                  device: torch.device) -> dict[str, Any]:
    """The tree fields of :class:`~lmkit.api.AttentionMetadata` for a step's tree
    regions and mask bits (host arrays), none when the step has no tree."""
    if region is None or mask is None:
        return {}
    region_cpu = torch.from_numpy(region.astype(np.int32))
    return {"tree_region_cpu": region_cpu, "tree_region": region_cpu.to(device),
            "tree_mask": torch.from_numpy(mask.astype(np.int64)).to(device)}


class InputBatch:
    """Dense rows of per-request token and block-table state, plus step buffers.

    Args:
        max_num_reqs: rows to preallocate (grows if more requests arrive).
        max_model_len: the context limit; rows start with room for
            ``min(max_model_len, INITIAL_ROW_TOKENS)`` tokens and double (up to
            ``max_model_len``) when a request needs more.
        block_size: tokens per KV block.
        max_num_tokens: step buffer capacity in tokens (grows if a step needs more).
        pin_memory: page-lock the step buffers (CUDA: asynchronous host-to-device copies).
    """

    # row arrays (numpy, [num_rows] or [num_rows, width]); reallocated by _resize_rows
    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_computed: np.ndarray
    block_table: np.ndarray
    num_blocks: np.ndarray

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 max_num_tokens: int, pin_memory: bool = False) -> None:
        self.block_size = block_size
        self.pin_memory = pin_memory
        self.req_ids: list[str] = []  # row -> request id (dense)
        self.row_of: dict[str, int] = {}
        # row widths: tokens (+1: a slot past the last known one) and block-table columns
        self.max_token_width = max_model_len + 1
        self.max_block_width = -(-max_model_len // block_size) + 1
        row_tokens = min(max_model_len, INITIAL_ROW_TOKENS)
        self._resize_rows(max(max_num_reqs, 1), row_tokens + 1,
                          -(-row_tokens // block_size) + 1)
        self._alloc_step(max(max_num_tokens, 1), max(max_num_reqs, 1))

    # ------------------------------------------------------------------ storage

    def _resize_rows(self, num_rows: int, token_width: int, block_width: int) -> None:
        """(Re)allocate the row arrays, keeping the live rows' contents."""
        n = len(self.req_ids)
        old = getattr(self, "token_ids", None)
        if old is not None:
            num_rows = max(num_rows, old.shape[0])
            token_width = max(token_width, old.shape[1])
            block_width = max(block_width, self.block_table.shape[1])
        token_ids = np.zeros((num_rows, token_width), dtype=np.int64)
        num_tokens = np.zeros(num_rows, dtype=np.int64)
        num_computed = np.zeros(num_rows, dtype=np.int64)
        block_table = np.zeros((num_rows, block_width), dtype=np.int32)
        num_blocks = np.zeros(num_rows, dtype=np.int64)
        if old is not None:
            token_ids[:n, :old.shape[1]] = old[:n]
            num_tokens[:n] = self.num_tokens[:n]
            num_computed[:n] = self.num_computed[:n]
            block_table[:n, :self.block_table.shape[1]] = self.block_table[:n]
            num_blocks[:n] = self.num_blocks[:n]
        self.token_ids, self.num_tokens, self.num_computed = token_ids, num_tokens, num_computed
        self.block_table, self.num_blocks = block_table, num_blocks

    def _token_width(self, need: int) -> int:
        """The token width for a row needing ``need`` slots: the current one doubled until
        it fits, at most :attr:`max_token_width` (never less than ``need``)."""
        return _doubled(self.token_ids.shape[1], need, self.max_token_width)

    def _block_width(self, need: int) -> int:
        """The block-table width for a row needing ``need`` columns (as :meth:`_token_width`)."""
        return _doubled(self.block_table.shape[1], need, self.max_block_width)

    def _alloc_step(self, max_num_tokens: int, max_num_reqs: int) -> None:
        # torch tensors sharing memory with numpy views: filled in numpy, handed on as torch
        def buffer(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=self.pin_memory)

        self._input_ids = buffer(max_num_tokens, dtype=torch.int64)
        self._positions = buffer(max_num_tokens, dtype=torch.int64)
        self._slot_mapping = buffer(max_num_tokens, dtype=torch.int64)
        self._query_start_loc = buffer(max_num_reqs + 1, dtype=torch.int32)
        self._seq_lens = buffer(max_num_reqs, dtype=torch.int32)
        self._block_tables = buffer(max_num_reqs, self.block_table.shape[1], dtype=torch.int32)
        self._arange = np.arange(max(max_num_tokens, self.token_ids.shape[1]), dtype=np.int64)

    # ------------------------------------------------------------------ rows

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, state: CachedRequestState, block_ids: list[int]) -> int:
        """Give ``state`` a row holding its tokens and block table; returns the row."""
        row = len(self.req_ids)
        need_tokens = state.num_tokens + 1
        need_blocks = len(block_ids)
        if (row >= self.token_ids.shape[0] or need_tokens > self.token_ids.shape[1]
                or need_blocks > self.block_table.shape[1]):
            self._resize_rows(2 * row + 1, self._token_width(need_tokens),
                              self._block_width(need_blocks))
        self.req_ids.append(state.req_id)
        self.row_of[state.req_id] = row
        n_prompt = state.num_prompt_tokens
        self.token_ids[row, :n_prompt] = state.prompt_token_ids
        self.token_ids[row, n_prompt:state.num_tokens] = state.output_token_ids
        self.num_tokens[row] = state.num_tokens
        self.num_computed[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)
        return row

    def remove_request(self, req_id: str) -> None:
        """Drop a request's row; the last row moves into the hole (rows stay dense)."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.row_of[moved] = row
            width = int(self.num_tokens[last])
            self.token_ids[row, :width] = self.token_ids[last, :width]
            self.num_tokens[row] = self.num_tokens[last]
            self.num_computed[row] = self.num_computed[last]
            nb = int(self.num_blocks[last])
            self.block_table[row, :nb] = self.block_table[last, :nb]
            self.num_blocks[row] = nb
        self.req_ids.pop()

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        """Extend a row's block table with newly allocated blocks."""
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self._resize_rows(0, 0, self._block_width(end))
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Commit sampled tokens to a row (the scheduler appends its own copy)."""
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.token_ids.shape[1]:
            self._resize_rows(0, self._token_width(end), 0)
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def write_draft_tokens(self, row: int, token_ids: list[int]) -> None:
        """Place draft tokens after a row's known tokens, uncommitted (inputs only)."""
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.token_ids.shape[1]:
            self._resize_rows(0, self._token_width(end), 0)
        self.token_ids[row, start:end] = token_ids

    # ------------------------------------------------------------------ one step

    def prepare(self, rows: np.ndarray, num_scheduled: np.ndarray, num_decodes: int
                ) -> StepInputs:
        """Build the packed inputs of one step (vectorised; O(num_tokens) numpy work).

        Request ``i`` (batch row ``rows[i]``) runs its tokens
        ``[num_computed, num_computed + num_scheduled[i])``.
        """
        num_reqs = len(rows)
        cu = np.cumsum(num_scheduled)
        total = int(cu[-1])
        if total > self._input_ids.shape[0] or num_reqs > self._seq_lens.shape[0]:
            self._alloc_step(max(total, self._input_ids.shape[0]),
                             max(num_reqs, self._seq_lens.shape[0]))
        if self._block_tables.shape[1] < self.block_table.shape[1]:
            self._alloc_step(self._input_ids.shape[0], self._seq_lens.shape[0])
        num_computed = self.num_computed[rows]
        if total == num_reqs:  # one token per request (decodes): token k is request k's
            positions, token_rows = num_computed, rows
        else:  # token k of the step belongs to request req_of[k], at offset k - start
            req_of = np.repeat(np.arange(num_reqs), num_scheduled)
            offsets = self._arange[:total] - np.repeat(cu - num_scheduled, num_scheduled)
            positions = num_computed[req_of] + offsets
            token_rows = rows[req_of]
        width = self.token_ids.shape[1]
        input_ids = self._input_ids[:total].numpy()
        np.take(self.token_ids.reshape(-1), token_rows * width + positions, out=input_ids)
        self._positions[:total].numpy()[:] = positions
        blocks = self.block_table[token_rows, positions // self.block_size]
        self._slot_mapping[:total].numpy()[:] = blocks * self.block_size + positions % self.block_size
        qsl = self._query_start_loc[:num_reqs + 1].numpy()
        qsl[0] = 0
        qsl[1:] = cu
        seq_lens = num_computed + num_scheduled
        self._seq_lens[:num_reqs].numpy()[:] = seq_lens
        num_step_blocks = max(1, int(-(-seq_lens.max() // self.block_size)))
        tables = self._block_tables[:num_reqs, :num_step_blocks]
        tables.numpy()[:] = self.block_table[rows, :num_step_blocks]
        return StepInputs(
            rows=rows, num_scheduled=num_scheduled, cu_num_tokens=cu, num_computed=num_computed,
            input_ids=self._input_ids[:total], positions=self._positions[:total],
            slot_mapping=self._slot_mapping[:total],
            query_start_loc=self._query_start_loc[:num_reqs + 1],
            seq_lens=self._seq_lens[:num_reqs], block_tables=tables, num_decodes=num_decodes)


def _doubled(width: int, need: int, cap: int) -> int:
    """``width`` doubled until it holds ``need``, capped at ``cap`` but at least ``need``
    (a row's drafts may reach past the context limit)."""
    width = max(width, 1)
    while width < need:
        width *= 2
    return max(need, min(width, cap))


class DeviceInputs:
    """Persistent device copies of a step's inputs (fixed addresses, for CUDA graphs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def wait_for_copies(self) -> None:
        """Block until the last step's host-to-device copies have read their sources."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _put(self, name: str, host: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or any(b < h for b, h in zip(buf.shape, host.shape, strict=True)):
            shape = tuple(max(2 * h, b) for h, b in zip(
                host.shape, buf.shape if buf is not None else host.shape, strict=True))
            buf = torch.zeros(shape, dtype=host.dtype, device=self.device)
            self._buffers[name] = buf
        view = buf[tuple(slice(0, h) for h in host.shape)]
        view.copy_(host, non_blocking=True)
        return view

    def copy(self, step: StepInputs) -> StepInputs:
        """Copy ``step``'s tensors into the device buffers; returns device views."""
        out = StepInputs(
            rows=step.rows, num_scheduled=step.num_scheduled, cu_num_tokens=step.cu_num_tokens,
            num_computed=step.num_computed, input_ids=self._put("input_ids", step.input_ids),
            positions=self._put("positions", step.positions),
            slot_mapping=self._put("slot_mapping", step.slot_mapping),
            query_start_loc=self._put("query_start_loc", step.query_start_loc),
            seq_lens=self._put("seq_lens", step.seq_lens),
            block_tables=self._put("block_tables", step.block_tables),
            num_decodes=step.num_decodes)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

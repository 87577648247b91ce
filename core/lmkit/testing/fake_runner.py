"""A deterministic fake model runner for scheduler tests.

:class:`FakeRunner` knows requests only through each :class:`SchedulerOutput` (as the
real runner does). It writes every computed token id into a fake paged KV memory at
the slots the block tables give, and "samples" the next token from the history it
reads back from that memory with :func:`next_token`. A wrong block table, a bad
prefix-cache hit, a lost token after preemption or a request scheduled past its known
tokens therefore gives a different token or a :class:`RunnerViolation`, and greedy
outputs must equal :func:`reference_output`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.api.scheduler_output import SchedulerOutput

VOCAB = 1000


class RunnerViolation(Exception):
    """A scheduler output that a real model runner could not execute."""


def next_token(history: list[int]) -> int:
    """The fake model: a deterministic function of the whole token history."""
    h = 1469598103
    for t in history:
        h = ((h ^ (t + 1)) * 1099511628211) & 0xFFFFFFFFFFFF
    return h % VOCAB


def reference_output(prompt: list[int], max_tokens: int, eos: int | None = None,
                     max_model_len: int = 1 << 30) -> list[int]:
    """What the fake model generates for ``prompt`` alone (the EOS token included)."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens and len(tokens) < max_model_len:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if tok == eos:
            break
    return out


@dataclass
class _State:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


class FakeRunner:
    """Executes scheduler outputs against a fake paged KV memory (see the module doc)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.states: dict[str, _State] = {}

    def _read(self, st: _State, length: int) -> list[int]:
        bs = self.block_size
        return [self.kv[st.block_ids[p // bs]][p % bs] for p in range(length)]  # type: ignore[misc]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; raises :class:`RunnerViolation` on an impossible output."""
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(rid, None)
        for nd in so.scheduled_new_reqs:
            if nd.req_id in self.states:
                raise RunnerViolation(f"request {nd.req_id!r} was sent as new while the runner "
                                      "still holds it (not finished or preempted first)")
            self.states[nd.req_id] = _State(list(nd.prompt_token_ids) + list(nd.output_token_ids),
                                            list(nd.block_ids), nd.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                 cached.num_computed_tokens, strict=True):
            st = self.states.get(rid)
            if st is None:
                raise RunnerViolation(f"request {rid!r} was sent as cached but the runner "
                                      "never received it (or was told it finished)")
            if num_computed != st.num_computed:
                raise RunnerViolation(f"request {rid!r}: num_computed_tokens {num_computed} "
                                      f"but the runner computed {st.num_computed}")
            st.block_ids.extend(new_blocks)
        out = ModelRunnerOutput()
        bs = self.block_size
        for rid, n in so.num_scheduled_tokens.items():
            st = self.states.get(rid)
            if st is None:
                raise RunnerViolation(f"request {rid!r} was scheduled without its data")
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            seq = st.tokens + list(drafts)
            start, end = st.num_computed, st.num_computed + n
            if n <= 0 or end > len(seq):
                raise RunnerViolation(f"request {rid!r}: {n} tokens scheduled from position "
                                      f"{start}, but it has only {len(seq)} tokens")
            if len(st.block_ids) * bs < end:
                raise RunnerViolation(f"request {rid!r}: no KV slot for position {end - 1} "
                                      f"({len(st.block_ids)} blocks of {bs})")
            for pos in range(start, end):
                block_id = st.block_ids[pos // bs]
                if block_id == 0:
                    raise RunnerViolation(f"request {rid!r}: position {pos} maps to the null "
                                          "block 0, which must never hold tokens")
                self.kv[block_id][pos % bs] = seq[pos]
            sampled: list[int] = []
            if end >= len(st.tokens):  # reached the last known token: sample and verify
                for i in range(len(drafts) + 1):
                    sampled.append(next_token(self._read(st, len(st.tokens) + i)))
                    if i < len(drafts) and drafts[i] != sampled[-1]:
                        break
            rejected = len(drafts) + 1 - len(sampled) if sampled and drafts else 0
            st.num_computed = end - rejected
            st.tokens.extend(sampled)
            out.req_ids.append(rid)
            out.sampled_token_ids.append(sampled)
        return out

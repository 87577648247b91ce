"""Bitmask rows of one request for one step, draft positions included.

With speculative decoding the target model scores ``1 + k`` positions of a request in
one step: after its last accepted token, and after each of its ``k`` draft tokens. Each
position gets its own bitmask row, the grammar's mask at that point (vLLM v1's layout).
The grammar is advanced over the drafts to fill the rows and rolled back afterwards, so
its state only ever reflects accepted tokens: the tokens the step finally keeps are
accepted after the step (:meth:`StructuredOutputManager.advance`). Nothing else needs
to roll back when drafts are rejected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lmkit.api.structured_output import Grammar


def fill_rows(grammar: Grammar, bitmask: torch.Tensor, first_row: int,
              draft_token_ids: list[int]) -> int:
    """Fill ``bitmask[first_row + j]`` with the mask after the first ``j`` drafts, for
    ``j = 0 .. len(draft_token_ids)``; returns how many drafts the grammar allows.

    Rows after the first draft the grammar refuses keep their content (all tokens
    allowed from :func:`lmkit.sample.bitmask.allocate_bitmask`): that draft cannot be
    sampled at its own position (its row forbids it), so it and every later position
    are rejected by verification whatever their rows say. The grammar ends in the state
    it started in.
    """
    grammar.fill_bitmask(bitmask, first_row)
    num_valid = 0
    for token in draft_token_ids:
        if grammar.is_terminated() or not grammar.accept_tokens([token]):
            break
        num_valid += 1
        grammar.fill_bitmask(bitmask, first_row + num_valid)
    if num_valid:
        grammar.rollback(num_valid)
    return num_valid

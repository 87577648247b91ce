"""Bitmask rows of one request for one step, draft positions included, and the other
calls the structured-output manager makes into a request's grammar during a step.

With speculative decoding the target model scores ``1 + k`` positions of a request in
one step: after its last accepted token, and after each of its ``k`` draft tokens. Each
position gets its own bitmask row, the grammar's mask at that point (vLLM v1's layout).
The grammar is advanced over the drafts to fill the rows and rolled back afterwards, so
its state only ever reflects accepted tokens: the tokens the step finally keeps are
accepted after the step (:meth:`StructuredOutputManager.advance`). Nothing else needs
to roll back when drafts are rejected.

:class:`PlainRows` fills the rows of requests without drafts in one backend call; when
that call raises it falls back to each grammar alone, so that one faulty grammar fails
its own request, not the step. :class:`TrimDrafts` is the phase that cuts a
proposer's drafts to what the grammars allow. A draft tree's rows follow each node's
path (:func:`fill_tree_rows`); its drafts are not cut (only a prefix of the nodes could
go, and a refused node is never accepted anyway: its parent's row forbids it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmkit.api.structured_output import Grammar
from lmkit.engine.phases import StepPhase
from lmkit.errors import InvalidRequestError
from lmkit.plugin_host.faults import BrokenContract, raised_in
from lmkit.structured.constraint import PARAM

if TYPE_CHECKING:
    import torch

    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.api.structured_output import StructuredOutputBackend
    from lmkit.spec_decode.tree import DraftTree
    from lmkit.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


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


def fill_tree_rows(grammar: Grammar, bitmask: torch.Tensor, first_row: int,
                   draft_token_ids: list[int], tree: DraftTree) -> None:
    """The rows of a request whose drafts are the first nodes of a draft tree
    (``speculative.tree``): ``bitmask[first_row + j]`` gets the mask after the drafts on
    the path to node ``j`` (row 0: the root's, after the accepted tokens only).

    A node whose path the grammar refuses keeps its row as it is: it cannot be reached,
    since the row of the parent of the first refused node forbids that draft, so
    verification never accepts it. The grammar ends in the state it started in.
    """
    grammar.fill_bitmask(bitmask, first_row)
    for node in range(1, len(draft_token_ids) + 1):
        path = [draft_token_ids[c - 1] for c in tree.path_to(node)]
        taken = 0
        for token in path:
            if grammar.is_terminated() or not grammar.accept_tokens([token]):
                break
            taken += 1
        if taken == len(path):
            grammar.fill_bitmask(bitmask, first_row + node)
        if taken:
            grammar.rollback(taken)


def fill_draft_rows(grammar: Grammar, bitmask: torch.Tensor, first_row: int,
                    draft_token_ids: list[int], tree: DraftTree | None) -> None:
    """:func:`fill_rows` for chains of drafts, :func:`fill_tree_rows` for a tree's."""
    if tree is None:
        fill_rows(grammar, bitmask, first_row, draft_token_ids)
    else:
        fill_tree_rows(grammar, bitmask, first_row, draft_token_ids, tree)


def count_valid_drafts(grammar: Grammar, draft_token_ids: list[int]) -> int:
    """How many leading ``draft_token_ids`` ``grammar`` allows; it is left as it was."""
    n = 0
    for token in draft_token_ids:
        if grammar.is_terminated() or not grammar.accept_tokens([token]):
            break
        n += 1
    if n:
        grammar.rollback(n)
    return n


class PlainRows:
    """Fills the rows of a step's requests without drafts in one
    ``backend.fill_bitmasks`` call. When that raises (logged, naming the backend
    ``label``), each grammar fills its own row, so that a faulty grammar fails only its
    own request; if none of them raises alone, the backend's batch fill is what is
    broken, and from then on the rows are always filled one grammar at a time."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.use_backend = True  # False once the backend's batch fill proved broken

    def fill(self, backend: StructuredOutputBackend, grammars: Sequence[Grammar],
             bitmask: torch.Tensor, rows: Sequence[int]) -> dict[int, Exception]:
        """Fill ``bitmask[rows[i]]`` for ``grammars[i]``; returns ``{i: error}`` of the
        grammars that raised (their rows are not valid), empty when every row is filled."""
        batch_error = None
        if self.use_backend:
            try:
                backend.fill_bitmasks(grammars, bitmask, rows)
                return {}
            except Exception as e:
                batch_error = e
        errors: dict[int, Exception] = {}
        for i, (grammar, row) in enumerate(zip(grammars, rows, strict=True)):
            try:
                grammar.fill_bitmask(bitmask, row)
            except Exception as e:
                errors[i] = e
        if batch_error is not None and not errors:
            self.use_backend = False
            logger.error("%s; each grammar fills its own row from now on", raised_in(
                self.label, batch_error, f"filling {len(rows)} bitmask rows"),
                exc_info=batch_error)
        return errors


def checked_grammar(grammar: Any, label: str, constraint: str) -> Grammar:
    """``grammar`` (what the backend ``label`` compiled ``constraint`` into) if it is a
    :class:`Grammar`; raises :class:`InvalidRequestError` naming the backend's mistake
    otherwise (the request is refused as for any failed compilation)."""
    if not isinstance(grammar, Grammar):
        raise InvalidRequestError(
            f"{label} compiled the {constraint} constraint into {type(grammar).__name__}, not "
            "a lmkit.api.Grammar (compile / new_grammar must return one): a bug in the "
            "backend", param=PARAM, code="constraint_compile_failed")
    return grammar


def check_accepted(accepted: Any, grammar: Grammar) -> bool:
    """What ``grammar.accept_tokens`` returned, if it is a bool; else
    :class:`BrokenContract` (a forgotten ``return`` must not read as a refusal)."""
    if accepted is True or accepted is False:
        return accepted
    raise BrokenContract(f"{type(grammar).__qualname__}.accept_tokens returned "
                         f"{accepted!r}; it must return True (accepted) or False (refused, "
                         "state unchanged)")


class TrimDrafts(StepPhase):
    """After the proposer set drafts: keep only what each request's grammar allows."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager

    def after_model_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           outputs: list[EngineCoreOutput]) -> None:
        """:meth:`StructuredOutputManager.trim_draft_tokens`."""
        self.manager.trim_draft_tokens()

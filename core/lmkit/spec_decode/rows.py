"""The sampling rows of a step with drafts: one row per position a request samples at.

A request with ``k`` drafts samples at ``k + 1`` consecutive hidden rows (its last
known token and each draft, see :mod:`lmkit.sample.rejection`). Each row gets the
request's parameters, and as "output so far" its output extended by the drafts before
that position, so penalties and the min_tokens ban act at every position as they would
one token at a time. :func:`sampling_rows` builds those per-row lists in O(rows) Python:
the extended outputs are :class:`DraftExtendedTokens` views, not copies, and a request
whose output is only read for its length, already past ``min_tokens`` (no penalties),
gets its output itself at every row; so a step costs nothing per token of context
unless a penalty or a bad word actually reads the tokens. A step whose requests are all
:func:`is_plain_greedy` needs no per-row lists at all: the runner verifies it with
:func:`~lmkit.sample.drafts.verify_greedy` straight from the logits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    from lmkit.spec_decode.tree import DraftTree


class DraftExtendedTokens(Sequence[int]):
    """``base + drafts[:num_drafts]`` as a read-only view (``base`` is not copied).

    Args:
        base: the request's output tokens (not modified; read when iterated).
        drafts: its draft tokens.
        num_drafts: how many of ``drafts`` come after ``base`` at this position.
    """

    __slots__ = ("base", "drafts", "num_drafts")

    def __init__(self, base: Sequence[int], drafts: Sequence[int], num_drafts: int) -> None:
        self.base = base
        self.drafts = drafts
        self.num_drafts = num_drafts

    def __len__(self) -> int:
        return len(self.base) + self.num_drafts

    def __iter__(self) -> Iterator[int]:
        return chain(self.base, islice(self.drafts, self.num_drafts))

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return list(self)[index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} tokens")
        base = len(self.base)
        return self.base[index] if index < base else self.drafts[index - base]

    def __repr__(self) -> str:
        return f"DraftExtendedTokens({list(self)!r})"


@dataclass
class SamplingRows:
    """Per sampling row, what :meth:`SamplingMetadata.build
    <lmkit.sample.metadata.SamplingMetadata.build>` needs about its request."""

    params: list[Any] = field(default_factory=list)
    prompts: list[Sequence[int]] = field(default_factory=list)
    outputs: list[Sequence[int]] = field(default_factory=list)
    generators: list[Any] = field(default_factory=list)
    eos_token_ids: list[int | None] = field(default_factory=list)


def hidden_rows(plan: Sequence[tuple[Any, int, Sequence[int]]]) -> slice | list[int]:
    """The hidden rows the sampling rows read, in order: ``slice(a, b)`` when they are
    ``a, a + 1, ..., b - 1`` (e.g. every token of a verification step: no gather), else
    the row indices.

    Args:
        plan: per sampling request ``(state, first hidden row, drafts)``.
    """
    rows: list[int] = []
    for _, first_row, drafts in plan:
        rows.extend(range(first_row, first_row + len(drafts) + 1))
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        return slice(rows[0], rows[-1] + 1)
    return rows


def sampling_rows(plan: Sequence[tuple[Any, int, Sequence[int]]],
                  tree: DraftTree | None = None) -> SamplingRows:
    """The sampling rows of a step.

    Args:
        plan: per sampling request ``(state, first hidden row, drafts)``, where ``state``
            has ``sampling_params``, ``prompt_token_ids``, ``output_token_ids``,
            ``generator`` and ``eos_token_id`` (the runner's ``CachedRequestState``).
        tree: the drafts are the first nodes of this draft tree: a node's row comes
            after the drafts on the path to it, not after every earlier draft.

    Returns:
        ``len(drafts) + 1`` rows per request, in plan order.
    """
    out = SamplingRows()
    for state, _, drafts in plan:
        n = len(drafts) + 1
        output, params = state.output_token_ids, state.sampling_params
        out.params.extend([params] * n)
        out.prompts.extend([state.prompt_token_ids] * n)
        if (params.needs_penalties or len(output) < params.min_tokens
                or params.bad_words_token_ids):
            out.outputs.append(output)
            if tree is None:
                out.outputs.extend(DraftExtendedTokens(output, drafts, j) for j in range(1, n))
            else:
                for j in range(1, n):
                    path = [drafts[c - 1] for c in tree.path_to(j)]
                    out.outputs.append(DraftExtendedTokens(output, path, len(path)))
        else:  # only read for its length, and that is past min_tokens at every row
            out.outputs.extend([output] * n)
        out.generators.extend([state.generator] * n)
        out.eos_token_ids.extend([state.eos_token_id] * n)
    return out


def is_plain_greedy(params: Any, num_output_tokens: int) -> bool:
    """Whether the argmax of the raw logits is exactly what ``params`` sample next:
    greedy, no logprobs, logit bias, penalties, allowed token ids, bad words or logits
    processors, ``min_tokens`` reached. (A grammar bitmask is applied to the logits
    before sampling, so it does not matter here; processors the config applies to every
    request are the runner's to check.)"""
    return (params.temperature == 0.0 and params.logprobs is None and not params.logit_bias
            and not params.needs_penalties and num_output_tokens >= params.min_tokens
            and not params.allowed_token_ids and not params.bad_words_token_ids
            and not params.logits_processors)

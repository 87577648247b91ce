"""Why a constrained request produced a token its grammar refuses: its own fault or
the engine's.

The sampler masks a constrained request's logits with the grammar's bitmask and with
the request's own token rules: ``allowed_token_ids``, EOS and ``stop_token_ids`` while
below ``min_tokens``, ``bad_words``. When together they leave no token, every logit is
``-inf`` and whatever the sampler then draws breaks the grammar. That is the request's
fault (its parameters contradict each other): :func:`explain_refused_tokens` names the
parameter, and the request ends with a :class:`~lmkit.errors.RequestFaultError`
(``no_allowed_token``; 400 from the server). A refused token while some token was
allowed is an engine fault (a mask not applied).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmkit.errors import NO_ALLOWED_TOKEN
from lmkit.structured.constraint import PARAM

if TYPE_CHECKING:
    import torch

    from lmkit.api.request import Request
    from lmkit.api.structured_output import Grammar


@dataclass(frozen=True, slots=True)
class Refusal:
    """How a request whose new tokens its grammar refused ends: ``message`` (the
    output's ``stop_reason``), and for the request's own fault the error ``code`` and
    the ``param`` to change (both ``None`` for an engine fault)."""

    message: str
    code: str | None = None
    param: str | None = None


def explain_refused_tokens(grammar: Grammar, request: Request, new_token_ids: list[int],
                           constraint: str, vocab_size: int) -> Refusal:
    """Why ``grammar`` refused ``new_token_ids`` (the step's tokens of ``request``,
    already appended to its output): whether the grammar's mask at the first refused
    token and the request's own token rules there left any token at all.

    ``constraint`` describes the constraint for messages. The grammar is left in the
    state it was in (the tokens it accepts are rolled back).
    """
    num_ok = 0  # the tokens before the refused one, each allowed where it was drawn
    for token in new_token_ids:
        if grammar.is_terminated() or not grammar.accept_tokens([token]):
            break
        num_ok += 1
    try:
        allowed = _grammar_mask(grammar, vocab_size)
    finally:
        if num_ok:
            grammar.rollback(num_ok)
    output = request.output_token_ids
    before = output[:max(0, len(output) - len(new_token_ids) + num_ok)]
    where = ("at the first output token" if not before
             else f"after {len(before)} output token{'s' if len(before) > 1 else ''}")
    grammar_ids = allowed.nonzero().flatten().tolist()
    if not grammar_ids:
        return Refusal(f"the {constraint} constraint allows no token of this model's "
                       f"vocabulary {where}; change the constraint", NO_ALLOWED_TOKEN, PARAM)
    return _own_rules_refusal(request, before, grammar_ids, constraint, where) or Refusal(
        f"the model produced tokens {new_token_ids} that the {constraint} constraint does "
        f"not allow, although the request's own parameters left tokens allowed {where} "
        "(was the bitmask applied, or did a logits processor forbid every allowed token?)")


def _grammar_mask(grammar: Grammar, vocab_size: int) -> torch.Tensor:
    """bool ``[vocab_size]``: the tokens ``grammar`` allows in its current state."""
    from lmkit.sample.bitmask import allocate_bitmask, unpack_bitmask

    bitmask = allocate_bitmask(1, vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0]


def _own_rules_refusal(request: Request, before: list[int], grammar_ids: list[int],
                       constraint: str, where: str) -> Refusal | None:
    """The request's fault when its own token rules (as the sampler applies them after
    ``before``) forbid all of ``grammar_ids``; ``None`` when some token is left."""
    p = request.sampling_params
    candidates = grammar_ids
    subject = f"the {constraint} constraint"
    if p.allowed_token_ids:
        allowed_ids = set(p.allowed_token_ids)
        candidates = [t for t in grammar_ids if t in allowed_ids]
        if not candidates:
            return Refusal(
                f"allowed_token_ids {shown_ids(p.allowed_token_ids)} and {subject} have no "
                f"token in common {where}: the constraint allows only token ids "
                f"{shown_ids(grammar_ids)} there; allow some of them, or drop one of the two",
                NO_ALLOWED_TOKEN, "allowed_token_ids")
        return bans_refusal(request, before, candidates, f"both allowed_token_ids and "
                            f"{subject} allow", where, "loosen the constraint")
    return bans_refusal(request, before, candidates, f"{subject} allows", where,
                        "loosen the constraint")


def bans_refusal(request: Request, before: Sequence[int], candidates: Sequence[int],
                 allows: str, where: str, remedy: str) -> Refusal | None:
    """The request's fault when its own bans after ``before`` (EOS and stop tokens below
    ``min_tokens``, bad words; :func:`~lmkit.sample.metadata.banned_next_tokens`) forbid
    every one of ``candidates``, the tokens its other rules leave (``allows`` says whose:
    ``"allowed_token_ids [1, 2] allow"``; ``remedy`` the other way out); ``None`` when
    some token is left. The ``param`` is ``min_tokens`` or ``bad_words``."""
    from lmkit.sample.metadata import bad_words_banned, banned_next_tokens

    p = request.sampling_params
    banned = banned_next_tokens(p, before, request.eos_token_id)
    if len(candidates) > len(banned) or any(t not in banned for t in candidates):
        return None
    bad = set(bad_words_banned(p.bad_words_token_ids or (), before))
    by_min = [t for t in candidates if t not in bad]  # banned only while below min_tokens
    by_bad = [t for t in candidates if t in bad]
    if by_min and by_bad:
        return Refusal(
            f"min_tokens = {p.min_tokens} and bad_words together forbid every token {allows} "
            f"{where} (token ids {shown_ids(candidates)}: ending the output, which "
            f"min_tokens forbids before {p.min_tokens} tokens, or completing a bad word); "
            f"lower min_tokens, remove the bad word or {remedy}", NO_ALLOWED_TOKEN,
            "min_tokens")
    if by_min:
        return Refusal(
            f"min_tokens = {p.min_tokens} is more than {allows}: {where} the only tokens left "
            f"(token ids {shown_ids(candidates)}) end the output, which min_tokens forbids "
            f"before {p.min_tokens} tokens; lower min_tokens (to {len(before)} or less for "
            f"this output) or {remedy}", NO_ALLOWED_TOKEN, "min_tokens")
    return Refusal(
        f"bad_words forbid every token {allows} {where} (token ids {shown_ids(candidates)}); "
        f"remove the bad word or {remedy}", NO_ALLOWED_TOKEN, "bad_words")


def shown_ids(token_ids: Sequence[int], limit: int = 8) -> str:
    """``[1, 2, 3]``, or the first ``limit`` ids and how many more."""
    ids = list(token_ids)
    if len(ids) <= limit:
        return str(ids)
    return f"[{', '.join(map(str, ids[:limit]))}, ... ({len(ids) - limit} more)]"

"""Checking what a proposer plugin returned before any draft reaches the scheduler.

:func:`check_proposal` takes a :class:`~lmkit.api.Proposal` apart per request. What
spoils the whole answer (not a ``Proposal``, not one entry per request) raises
:class:`ProposalError` for every request of the batch; what spoils one request's drafts
(an id outside the vocabulary, a value that is not an integer, a draft distribution of
the wrong shape or without mass on its draft) is returned per request, so only that
request fails. The usual answer, lists of in-range Python ints, is checked with a few
C-level passes over the batch's drafts; requests are looked at one by one only when
those find something, or when the proposer gives draft distributions.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from lmkit.api.spec_decode import Proposal
from lmkit.errors import PluginError


class ProposalError(PluginError):
    """A proposer's answer that fails requests: ``failed`` maps each request id to why
    (the message names the proposer)."""

    def __init__(self, message: str, failed: Mapping[str, str]) -> None:
        super().__init__(message)
        self.failed = dict(failed)


@dataclass
class CheckedProposal:
    """:func:`check_proposal`'s result, per request in batch order: ``drafts`` (empty
    for a request in ``bad``), ``probs`` (``None`` where none or bad), ``bad`` (request
    id -> why its drafts were refused) and the longest draft list before the cut to
    ``k``."""

    drafts: list[list[int]]
    probs: list[Any]
    bad: dict[str, str]
    longest: int


def check_proposal(proposal: Any, req_ids: Sequence[str], k: int, vocab_size: int,
                   label: str) -> CheckedProposal:
    """Each request's drafts, cut to ``k``, from what a proposer (``label`` names it)
    returned for ``req_ids``.

    Raises:
        ProposalError: for every request, when the answer as a whole is malformed.
    """
    n = len(req_ids)
    if not isinstance(proposal, Proposal):
        raise _whole(label, req_ids, f"returned {type(proposal).__name__}, not "
                     "lmkit.api.Proposal")
    drafts, probs = proposal.draft_token_ids, proposal.draft_probs
    if not isinstance(drafts, (list, tuple)) or (
            probs is not None and not isinstance(probs, (list, tuple))):
        what = "draft_token_ids" if not isinstance(drafts, (list, tuple)) else "draft_probs"
        value = drafts if what == "draft_token_ids" else probs
        raise _whole(label, req_ids, f"returned Proposal.{what} as {type(value).__name__}; "
                     "it must be a list with one entry per request, in batch.req_ids order")
    if len(drafts) != n or (probs is not None and len(probs) != n):
        raise _whole(label, req_ids, f"returned {len(drafts)} draft lists" + (
            f" and {len(probs)} draft_probs entries" if probs is not None else "")
            + f" for {n} requests; it must return one per request (empty for none)")
    if set(map(type, drafts)) <= {list}:  # the usual answer: lists of Python ints
        longest = max(map(len, drafts), default=0)
        out = list(map(list, drafts)) if longest <= k else [d[:k] for d in drafts]
        flat = list(chain.from_iterable(out))
        if not flat or (set(map(type, flat)) == {int} and min(flat) >= 0
                        and max(flat) < vocab_size):
            checked = CheckedProposal(out, list(probs or [None] * n), {}, longest)
            if probs is not None:
                _check_probs(checked, req_ids, vocab_size, label)
            return checked
    checked = CheckedProposal([], list(probs or [None] * n), {}, 0)
    for i, (rid, d) in enumerate(zip(req_ids, drafts, strict=True)):
        draft, problem = _one_request(d, k, vocab_size)
        checked.longest = max(checked.longest, len(d) if hasattr(d, "__len__") else 0)
        if problem is not None:
            checked.bad[rid] = f"{label}, for request {rid!r}, {problem}"
            checked.probs[i] = None
        checked.drafts.append(draft)
    if probs is not None:
        _check_probs(checked, req_ids, vocab_size, label)
    return checked


def _whole(label: str, req_ids: Sequence[str], problem: str) -> ProposalError:
    message = f"{label} {problem}"
    return ProposalError(message, dict.fromkeys(req_ids, message))


def _one_request(d: Any, k: int, vocab_size: int) -> tuple[list[int], str | None]:
    """One request's drafts as Python ints (numpy and 0-d integer tensors converted),
    or ``([], why)``."""
    if isinstance(d, (str, bytes, Mapping)) or not isinstance(d, Iterable):
        return [], (f"returned drafts as {type(d).__name__}; each request's drafts must "
                    "be a list of token ids")
    draft: list[int] = []
    for t in list(d)[:k]:
        try:
            if isinstance(t, bool):
                raise TypeError
            draft.append(operator.index(t))
        except TypeError:
            return [], (f"drafted {t!r} ({type(t).__name__}); draft token ids must be "
                        "integers")
    bad = next((t for t in draft if not 0 <= t < vocab_size), None)
    if bad is not None:
        return [], (f"drafted token id {bad}, outside the model's vocabulary "
                    f"[0, {vocab_size})")
    return draft, None


def _check_probs(checked: CheckedProposal, req_ids: Sequence[str], vocab_size: int,
                 label: str) -> None:
    """Refuse the requests whose draft distribution cannot be the one their drafts were
    drawn from: not a float ``[>= num drafts, <= vocab]`` tensor, or no mass on a draft
    (rejection sampling would then accept that draft whatever the target says)."""
    import torch

    picked: list[tuple[int, torch.Tensor]] = []
    for i, (draft, p) in enumerate(zip(checked.drafts, checked.probs, strict=True)):
        if p is None or not draft:
            continue
        problem = None
        if not isinstance(p, torch.Tensor) or p.dim() != 2 or not p.is_floating_point():
            problem = (f"gave draft_probs {_describe(p)}; expected a float tensor "
                       f"[{len(draft)}, vocab]")
        elif p.shape[0] < len(draft) or not 0 < p.shape[1] <= vocab_size:
            problem = (f"gave draft_probs of shape {tuple(p.shape)} for {len(draft)} drafts; "
                       f"expected [{len(draft)}, vocab <= {vocab_size}]")
        elif max(draft) >= p.shape[1]:
            problem = (f"drafted token id {max(draft)}, outside its draft distribution's "
                       f"{p.shape[1]} tokens")
        if problem is None:
            rows = torch.arange(len(draft), device=p.device)
            picked.append((i, p[rows, torch.tensor(draft, device=p.device)]))
        else:
            _refuse(checked, req_ids[i], i, f"{label}, for request {req_ids[i]!r}, {problem}")
    device = picked[0][1].device if picked else None
    if not picked or bool((torch.cat([m.to(device, torch.float32) for _, m in picked]) > 0)
                          .all()):
        return  # one host sync for the whole batch
    for i, mass in picked:
        if not bool((mass > 0).all()):
            j = int((mass > 0).logical_not().nonzero()[0])
            _refuse(checked, req_ids[i], i,
                    f"{label}, for request {req_ids[i]!r}, drafted token id "
                    f"{checked.drafts[i][j]} at draft position {j} with draft probability "
                    f"{float(mass[j])}; draft_probs must give each draft the positive "
                    "probability it was drawn with")


def _refuse(checked: CheckedProposal, rid: str, i: int, message: str) -> None:
    checked.bad[rid] = message
    checked.drafts[i] = []
    checked.probs[i] = None


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    return type(value).__name__ + (f" of shape {tuple(shape)}, dtype {dtype}"
                                   if shape is not None else "")

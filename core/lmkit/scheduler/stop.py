"""Stop checks applied as sampled tokens are appended to a request, and ending one
that had nothing left to sample (:func:`end_without_allowed_token`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmkit.api.request import Request, RequestStatus
from lmkit.errors import NO_ALLOWED_TOKEN

if TYPE_CHECKING:
    from lmkit.structured.fault import Refusal

logger = logging.getLogger(__name__)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether ``request`` must finish after its latest output token; sets its status.

    In order: EOS (unless ``ignore_eos``) and ``stop_token_ids`` end it as
    FINISHED_STOPPED, but only once ``min_tokens`` outputs exist (``stop_reason`` is the
    stop token; ``None`` for EOS); then reaching ``request.max_tokens`` outputs or
    ``max_model_len`` tokens in all ends it as FINISHED_LENGTH. A stop token on the last
    allowed position therefore reports "stop", as the model did choose to stop.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    max_tokens = request.max_tokens
    if (max_tokens is not None and num_output >= max_tokens) or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def append_and_check_stop(
    request: Request, token_ids: Sequence[int], max_model_len: int
) -> list[int]:
    """Append sampled ``token_ids`` to ``request`` one at a time, stopping at the first
    stop condition (later tokens are dropped). Returns the tokens actually appended."""
    for n, token_id in enumerate(token_ids, 1):
        request.append_output_token_ids([token_id])
        if check_stop(request, max_model_len):
            return list(token_ids[:n])
    return list(token_ids)


def end_without_allowed_token(request: Request, new_token_ids: Sequence[int],
                              grammar_bitmask: Any = None) -> Refusal:
    """End ``request`` with an error: the sampler found every logit ``-inf`` at its next
    position (after ``new_token_ids``, the step's valid tokens, already appended), so
    nothing was left to sample (:attr:`~lmkit.api.ModelRunnerOutput.no_allowed_token`).
    Sets ``FINISHED_ERROR`` and ``stop_reason`` (the message); returns why
    (:func:`explain_no_allowed_token`)."""
    refusal = explain_no_allowed_token(request, new_token_ids, grammar_bitmask)
    request.status = RequestStatus.FINISHED_ERROR
    request.stop_reason = refusal.message
    return refusal


def explain_no_allowed_token(request: Request, new_token_ids: Sequence[int],
                             grammar_bitmask: Any = None) -> Refusal:
    """Why nothing was left to sample for ``request`` after its output so far: its own
    token rules (``allowed_token_ids`` all forbidden by ``min_tokens`` or ``bad_words``),
    its structured-output constraint against them
    (:func:`~lmkit.structured.fault.explain_refused_tokens`, given the step's
    ``grammar_bitmask`` for its width), or its logits processors: a
    :data:`~lmkit.errors.NO_ALLOWED_TOKEN` fault naming the parameter. Anything else is
    an engine fault (``code`` ``None``)."""
    from lmkit.structured.fault import Refusal, explain_refused_tokens

    state = request.structured_output
    output = request.output_token_ids
    where = ("at the first output token" if not output
             else f"after {len(output)} output token{'s' if len(output) > 1 else ''}")
    refusal: Refusal | None = None
    if state is not None and state.grammar is not None and grammar_bitmask is not None:
        try:
            refusal = explain_refused_tokens(state.grammar, request, list(new_token_ids),
                                             state.constraint.describe(),
                                             grammar_bitmask.shape[-1] * 32)
        except Exception:  # a plugin's grammar failed: its manager reports that
            logger.exception("request %s: explaining with its grammar failed",
                             request.request_id)
    if refusal is None or refusal.code is None:
        refusal = _own_rules_refusal(request, where)
    if refusal is not None:
        return refusal
    processors = request.sampling_params.logits_processors
    if processors:
        return Refusal(
            f"no token was left to sample {where}: the logits processors {processors} "
            "forbade every token the request's other parameters allow; check their "
            "arguments (extra_args) or drop them", NO_ALLOWED_TOKEN, "logits_processors")
    return Refusal(
        f"every logit was -inf {where}, although the request's own parameters left tokens "
        "allowed (a logits processor the engine applies to every request, or -inf logits "
        "from the model?)")


def _own_rules_refusal(request: Request, where: str) -> Refusal | None:
    """The request's fault when ``min_tokens`` and ``bad_words`` forbid every one of its
    ``allowed_token_ids`` after its output so far; ``None`` when some is left."""
    from lmkit.structured.fault import bans_refusal, shown_ids

    allowed = sorted(set(request.sampling_params.allowed_token_ids or ()))
    if not allowed:
        return None
    return bans_refusal(request, request.output_token_ids, allowed,
                        f"allowed_token_ids {shown_ids(allowed)} allow", where,
                        "allow other tokens")

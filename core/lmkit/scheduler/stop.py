"""Stop checks applied as sampled tokens are appended to a request."""

from __future__ import annotations

from collections.abc import Sequence

from lmkit.api.request import Request, RequestStatus


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

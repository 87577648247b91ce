"""How a decode step launched ahead (:mod:`lmkit.worker.gpu_lookahead`) draws its tokens:
which requests it may sample for, and the draw itself (no host sync on the way)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.row_cache import with_row_tokens
from lmkit.spec_decode.rows import is_plain_greedy

if TYPE_CHECKING:
    from lmkit.api.model import CausalLM
    from lmkit.api.sampling_kernels import PenaltyRows
    from lmkit.api.sampling_params import SamplingParams
    from lmkit.sample.sampler import Sampler
    from lmkit.worker.input_batch import CachedRequestState


def greedy_plain(p: SamplingParams, num_output_tokens: int) -> bool:
    """Greedy sampling that the argmax of the raw logits reproduces exactly (and no
    grammar, whose bitmask the lookahead does not apply)."""
    return is_plain_greedy(p, num_output_tokens) and p.structured_outputs is None


def samples_ahead(p: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a launched step draws what the normal step would, with the runner's
    sampler: greedy or random (a seeded request's generator is rewound when its launched
    step is not taken); temperature, the top-k / top-p / min-p filters, penalties, logit
    bias and allowed ids, whose tensors are kept per request; no logprobs, bad words
    (they follow the unread token), logits processors, pending ``min_tokens`` or
    grammar."""
    return (p.logprobs is None and not p.bad_words_token_ids and not p.logits_processors
            and num_output_tokens >= p.min_tokens and p.structured_outputs is None)


def count_unread(penalties: PenaltyRows, unread: torch.Tensor) -> PenaltyRows:
    """``penalties`` with the token each row's request drew in the step before, still on
    the device (``unread``, one per request in step order), counted for this step only."""
    return with_row_tokens(penalties, unread.index_select(0, penalties.rows))


def draw_ahead(sampler: Sampler | None, states: list[CachedRequestState], order: list[str],
               model: CausalLM, hidden: torch.Tensor, unread: torch.Tensor | None
               ) -> torch.Tensor:
    """A launched step's tokens for the requests ``states`` (ids ``order``) from the
    ``model``'s final ``hidden`` states: the argmax (the sampler kernels',
    :meth:`~lmkit.api.SamplingKernels.argmax`) of its greedy logits
    (:meth:`~lmkit.api.CausalLM.compute_greedy_logits`) where every one is plain greedy
    (or there is no ``sampler``: ``torch.argmax``), else the sampler's draw from its
    float32 logits with the requests' kept tensors, their penalty counts plus ``unread``
    (the tokens the step before drew, not yet in the output lists; ``None``: they are).
    Uploads are asynchronous: the host does not wait for the device."""
    if sampler is None or all(is_plain_greedy(s.sampling_params, len(s.output_token_ids))
                              for s in states):
        logits = model.compute_greedy_logits(hidden)
        return logits.argmax(dim=-1) if sampler is None else sampler.kernels.argmax(logits)
    logits = model.compute_logits(hidden)
    vocab, device = logits.shape[-1], logits.device
    md = SamplingMetadata.build(
        [s.sampling_params for s in states], [s.prompt_token_ids for s in states],
        [s.output_token_ids for s in states], [s.generator for s in states],
        [s.eos_token_id for s in states], vocab, device,
        sampler.request_cache(vocab, device), order)
    if md.penalties is not None and unread is not None:
        md.penalties = count_unread(md.penalties, unread)
    return sampler(logits, md).sampled_token_ids

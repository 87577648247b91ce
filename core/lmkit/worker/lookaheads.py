"""Which steps a model runner launches ahead of scheduling, chosen once its decode graphs
are captured: plain decode steps (:class:`~lmkit.worker.gpu_lookahead.DecodeLookahead`)
and a draft head's chain verifications (:class:`~lmkit.worker.spec_lookahead.
SpecLookahead`; a draft tree's verifications run normally, so none is reserved slots for,
:func:`~lmkit.worker.spec_lookahead.spec_lookahead_slots`). Nothing is launched ahead when
a logits processor applied to every request may change the greedy argmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lmkit.worker.gpu_lookahead import DecodeLookahead
from lmkit.worker.spec_lookahead import SpecLookahead

if TYPE_CHECKING:
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack
    from lmkit.sample.sampler import Sampler
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit.worker.input_batch import CachedRequestState, InputBatch


def build_lookaheads(config: LMKitConfig, stack: ResolvedStack,
                     graphs: CudaGraphRunner | None, model: Any, input_batch: InputBatch,
                     requests: dict[str, CachedRequestState], max_model_len: int,
                     drafter: DraftRunner | None, sampler: Sampler, affects_greedy: bool
                     ) -> tuple[DecodeLookahead | None, SpecLookahead | None]:
    """The runner's decode lookahead and speculative lookahead (each ``None`` where it
    does not apply; the arguments are the runner's own). On CUDA the argmax they launch
    is compiled here, at the greedy logits' dtype, so that no request waits for it."""
    if affects_greedy:
        graphs = None
    args = (config, stack, graphs, model, input_batch, requests, max_model_len, drafter)
    decode = DecodeLookahead.maybe(*args, sampler=sampler)
    spec = SpecLookahead.maybe(*args, sampler.kernels)
    if graphs is not None and graphs.device.type == "cuda" and (decode or spec):
        with torch.inference_mode():
            sampler.kernels.argmax(model.compute_greedy_logits(graphs.hidden_like(1)))
    return decode, spec

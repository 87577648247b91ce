"""Whether and how the model runner captures its decode CUDA graphs
(:class:`~lmkit.worker.cuda_graphs.CudaGraphRunner`): :func:`maybe_capture`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from lmkit.worker.cuda_graphs import CudaGraphRunner
from lmkit.worker.flat_steps import flat_step_tokens
from lmkit.worker.tree_step import tree_graphs

if TYPE_CHECKING:
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack

logger = logging.getLogger(__name__)


def maybe_capture(config: LMKitConfig, stack: ResolvedStack, model: Any,
                  kv_caches: list[torch.Tensor], device: torch.device,
                  max_model_len: int,
                  aux_layers: tuple[int, ...] = ()) -> CudaGraphRunner | None:
    """Capture decode graphs of ``model`` over ``kv_caches`` when they apply, else ``None``.

    They apply on CUDA, unless ``executor.enforce_eager`` is set or the attention
    backend's spec does not declare ``cuda_graphs`` (then decode runs eagerly). With a
    speculative proposer in the stack, verification steps (``1 + k`` tokens per
    request) are replayed too, flattened, and so are short steps of a causal model
    (``executor.flat_step_max_tokens``); ``aux_layers`` (an EAGLE-3 head's target
    layers) are captured as extra outputs.
    """
    if device.type != "cuda" or config.executor.enforce_eager:
        return None
    attention = stack.get("attention")
    if attention is None or "cuda_graphs" not in attention.spec.caps.features:
        name = attention.name if attention is not None else "none"
        logger.info("attention backend %s cannot be captured in CUDA graphs: decode runs "
                    "eagerly", name)
        return None
    spec_k = (config.speculative.num_speculative_tokens
              if stack.get("speculative") is not None else 0)
    flat_tokens = flat_step_tokens(config.executor.flat_step_max_tokens, model, len(kv_caches))
    graphs = CudaGraphRunner(model, kv_caches, device, config.scheduler.max_num_seqs,
                             max_model_len, config.cache.block_size, max_query_len=1 + spec_k,
                             aux_layers=aux_layers, flat_tokens=flat_tokens,
                             tree=tree_graphs(config))
    graphs.capture()
    return graphs

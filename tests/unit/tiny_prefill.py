"""One request's prefill through a tiny bf16 model on the CPU (shared by the fold routing
tests): ``num_tokens`` tokens over blocks ``0..`` of a fresh paged cache of 4-token
blocks, one cache per layer."""

from __future__ import annotations

import torch
from lmkit.api import AttentionMetadata, ForwardContext


def prefill_hidden(model, num_tokens: int, num_layers: int) -> torch.Tensor:
    """The model's hidden states ``[num_tokens, hidden]`` for ids ``7 * i % 64``."""
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    blocks = -(-num_tokens // 4)
    md = AttentionMetadata(num_reqs=1, num_actual_tokens=num_tokens, max_query_len=num_tokens,
                           max_seq_len=num_tokens, query_start_loc=qsl, seq_lens=seq_lens,
                           block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                           slot_mapping=torch.arange(num_tokens), query_start_loc_cpu=qsl,
                           seq_lens_cpu=seq_lens)
    caches = [torch.zeros(model.attn.kv_cache_shape(blocks), dtype=torch.bfloat16)
              for _ in range(num_layers)]
    model.attn.plan(md)
    ids = torch.arange(num_tokens) * 7 % 64
    with torch.inference_mode():
        return model(ids, torch.arange(num_tokens), ForwardContext(model.attn, caches))

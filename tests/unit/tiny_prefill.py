"""A tiny bf16 Llama and one request's prefill through it on the CPU (shared by the fold
and SwiGLU-epilogue routing tests): ``num_tokens`` tokens over blocks ``0..`` of a fresh
paged cache of 4-token blocks, one cache per layer."""

from __future__ import annotations

import torch
from lmkit.api import AttentionMetadata, ForwardContext


def tiny_llama(seed: int = 0, **config):
    """A 2-layer bf16 Llama (hidden 64, vocabulary 64) on the CPU with Triton attention,
    weights drawn with ``seed`` (norm weights near 1); ``config`` overrides its config."""
    from lmkit.api import ModelBuildContext
    from lmkit_plugins.attention.triton_backend import TritonAttention
    from lmkit_plugins.models import llama
    from transformers import LlamaConfig

    hf = LlamaConfig(**{"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
                        "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
                        **config})
    ctx = ModelBuildContext(dtype=torch.bfloat16, device=torch.device("cpu"), block_size=4,
                            attention_cls=TritonAttention)
    model = llama.LlamaForCausalLM(hf, ctx)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1
                    else 0.2 * torch.randn(p.shape, generator=g))
    return model


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

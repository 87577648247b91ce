"""Real model shapes for random-weight test and benchmark models (no weights, no hub)."""

from __future__ import annotations

from typing import Any

#: DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), as transformers'
#: ``DeepseekV2Config`` keyword arguments: 27 layers, the first dense, then MLA
#: (``kv_lora_rank`` 512, no q-LoRA, YaRN factor 40) + 64 routed experts of 1408 (top-6)
#: and 2 shared ones; 15.7B parameters.
DEEPSEEK_V2_LITE: dict[str, Any] = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
    n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy",
    n_group=1, topk_group=1, num_experts_per_tok=6, first_k_dense_replace=1,
    norm_topk_prob=False, max_position_embeddings=163840, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1,
                                          mscale=0.707, mscale_all_dim=0.707,
                                          original_max_position_embeddings=4096),
    tie_word_embeddings=False, attention_bias=False)

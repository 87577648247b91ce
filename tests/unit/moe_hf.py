"""Hugging Face transformers' MoE modules at tiny sizes, and lmkit's
:class:`~lmkit_plugins.models.moe.SparseMoE` loaded with their weights under checkpoint
names: shared by the routing tests and the fused-kernel interpreter tests."""

from __future__ import annotations

from dataclasses import replace

import torch
import transformers
from lmkit_plugins.models.llama import LlamaDims
from lmkit_plugins.models.moe import DEEPSEEK_EXPERT_NAMES, MIXTRAL_EXPERT_NAMES, SparseMoE
from lmkit_plugins.models.moe_routing import MoERouting

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=4)


def mixtral_config(**kw):
    return transformers.MixtralConfig(**{**SMALL, "num_local_experts": 6,
                                         "num_experts_per_tok": 2, **kw})


def deepseek_v2_config(**kw):
    return transformers.DeepseekV2Config(**{
        **SMALL, "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
        "n_shared_experts": 2, "routed_scaling_factor": 1.5, "norm_topk_prob": False, **kw})


def deepseek_v3_config(**kw):
    return transformers.DeepseekV3Config(**{
        **SMALL, "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 24,
        "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "q_lora_rank": None, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, **kw})


def hf_moe_block(family: str, **kw):
    """``(config, HF MoE module with random weights)`` for ``mixtral``, ``v2``, ``v3``."""
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Moe
        cfg = mixtral_config(**kw)
    elif family == "v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Moe
        cfg = deepseek_v2_config(**{"topk_method": "group_limited_greedy", "n_group": 4,
                                    "topk_group": 2, **kw})
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Moe
        cfg = deepseek_v3_config(**kw)
    return cfg, randomize(Moe(cfg), seed=3)


def randomize(module, seed=0):
    """Random weights (and a random V3 correction bias) in place; the module, in eval."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return module.eval()


def checkpoint_tensors(hf_moe, prefix, expert_names=DEEPSEEK_EXPERT_NAMES):
    """An HF MoE module's weights under checkpoint names (experts split per expert)."""
    gate_name, up_name, down_name = expert_names
    out = {}
    for name, t in hf_moe.state_dict().items():
        if name == "experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.{gate_name}.weight"] = t[e, :inter]
                out[f"{prefix}.experts.{e}.{up_name}.weight"] = t[e, inter:]
        elif name == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.{down_name}.weight"] = t[e]
        else:
            out[f"{prefix}.{name}"] = t
    return out


def sparse_moe_like(cfg, hf_moe, tp=None) -> SparseMoE:
    """lmkit's block for ``cfg`` (``tp``'s shard), loaded through its checkpoint-name
    loaders."""
    mixtral = cfg.model_type == "mixtral"
    dims = LlamaDims.from_hf(cfg)
    shared = 0
    if not mixtral:
        dims = replace(dims, intermediate_size=cfg.moe_intermediate_size)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    ours = SparseMoE(dims, MoERouting.from_hf(cfg), torch.float32, torch.device("cpu"),
                     shared_intermediate_size=shared, tp=tp)
    names = MIXTRAL_EXPERT_NAMES if mixtral else DEEPSEEK_EXPERT_NAMES
    targets = ours.weight_targets("model.layers.1.mlp", names)
    tensors = checkpoint_tensors(hf_moe, "model.layers.1.mlp", names)
    assert set(targets) == set(tensors)
    with torch.no_grad():
        for name, t in tensors.items():
            targets[name](t)
    return ours

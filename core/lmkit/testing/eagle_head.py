"""A random EAGLE-1/2 draft head for a target model directory (tests of ``--speculative
eagle`` on :mod:`lmkit.testing.tiny_model`'s tiny Llama).

The head is laid out as EAGLE checkpoints are (``config.json`` and a safetensors file
with ``fc`` and ``layers.N.*``, no embedding or LM head: those are the target's). With
``copy_feature`` its ``fc`` passes the target's feature through (plus noise) and its
layer adds little, so it drafts roughly "what the target would say one position
earlier": right often enough on a tiny model's repetitive greedy output that tests see
both accepted and rejected drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
               "vocab_size", "head_dim", "rope_scaling", "rope_parameters")


def make_tiny_eagle_head(directory: str | Path, target_dir: str | Path, *, seed: int = 0,
                         num_layers: int = 1, copy_feature: bool = True,
                         with_embedding: bool = False, hidden_size: int | None = None,
                         vocab_size: int | None = None, layer_std: float = 0.02,
                         constant_draft: int | None = None) -> Path:
    """Write a random EAGLE head for the model at ``target_dir`` to ``directory``.

    Args:
        seed: same seed, same weights.
        num_layers: decoder layers (EAGLE-1/2 heads have one).
        copy_feature: ``fc`` starts as ``[0 | I]`` (the target's feature passes through).
        with_embedding: also write ``embed_tokens.weight`` (else the target's is shared).
        hidden_size, vocab_size: override the target's (to make a head that does not fit).
        layer_std: the spread of the decoder layer's weights; larger makes the drafts
            depend more on the head's attention over its KV cache (tests of that cache).
        constant_draft: a head that always drafts this token id (``fc`` and the layer
            zero, ``fc.bias`` along the target's embedding row of the token): with a
            token the target often samples, drafts are often accepted and often
            rejected (tests of the sampled path).
    """
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = {k: target[k] for k in CONFIG_KEYS if target.get(k) is not None}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama",
                  num_hidden_layers=num_layers, tie_word_embeddings=False)
    if hidden_size is not None:
        config["hidden_size"] = hidden_size
        config["intermediate_size"] = 2 * hidden_size
        config.pop("head_dim", None)
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(seed)

    if constant_draft is not None:
        layer_std = 0.0

    def rand(*shape: int, std: float = layer_std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    fc = rand(h, 2 * h, std=0.02)
    if copy_feature:
        fc[:, h:] += torch.eye(h)
    bias = torch.zeros(h)
    if constant_draft is not None:
        fc = torch.zeros(h, 2 * h)
        bias = 10.0 * _target_embedding(Path(target_dir))[constant_draft]
    tensors = {"fc.weight": fc, "fc.bias": bias}
    for i in range(num_layers):
        p = f"layers.{i}"
        tensors.update({
            f"{p}.self_attn.q_proj.weight": rand(heads * head_dim, h),
            f"{p}.self_attn.k_proj.weight": rand(kv_heads * head_dim, h),
            f"{p}.self_attn.v_proj.weight": rand(kv_heads * head_dim, h),
            f"{p}.self_attn.o_proj.weight": rand(h, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": rand(inter, h),
            f"{p}.mlp.up_proj.weight": rand(inter, h),
            f"{p}.mlp.down_proj.weight": rand(h, inter),
            f"{p}.post_attention_layernorm.weight": torch.ones(h),
        })
        if i > 0:
            tensors[f"{p}.input_layernorm.weight"] = torch.ones(h)
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(config["vocab_size"], h, std=0.2)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def _target_embedding(target_dir: Path):
    """The target's input embedding ``[vocab, hidden]`` (its LM head too: tied)."""
    from safetensors.torch import load_file

    for path in sorted(target_dir.glob("*.safetensors")):
        weights = load_file(str(path))
        for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
            if name in weights:
                return weights[name].float()
    raise FileNotFoundError(f"no embed_tokens.weight in {target_dir}/*.safetensors")


def make_tiny_eagle3_head(directory: str | Path, target_dir: str | Path, *, seed: int = 0,
                          layer_ids: tuple[int, ...] = (0, 1, 1),
                          draft_vocab_size: int | None = 200, layer_std: float = 0.3,
                          fc_inputs: int | None = None) -> Path:
    """Write a random EAGLE-3 head for the model at ``target_dir`` to ``directory``
    (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``; the embedding is
    the target's).

    Args:
        layer_ids: the target layers it fuses (``eagle_config.eagle_aux_hidden_state_
            layer_ids``; the tiny model has 2 layers, too few for the default taps).
        draft_vocab_size: its draft vocabulary, a random subset of the target's ids
            mapped by ``d2t``; ``None``: the target's vocabulary, no maps.
        fc_inputs: override ``fc``'s input width (to make a head that does not fit).
    """
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = {k: target[k] for k in CONFIG_KEYS if target.get(k) is not None}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(layer_ids)})
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = layer_std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    num_draft = vocab if draft_vocab_size is None else draft_vocab_size
    tensors = {
        "fc.weight": rand(h, fc_inputs or len(layer_ids) * h, std=0.2),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "lm_head.weight": rand(num_draft, h, std=0.5),
    }
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm",
                 "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = torch.ones(h)
    if draft_vocab_size is not None:
        ids = torch.randperm(vocab, generator=gen)[:num_draft].sort().values
        tensors["d2t"] = ids - torch.arange(num_draft)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
        config["draft_vocab_size"] = num_draft
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory

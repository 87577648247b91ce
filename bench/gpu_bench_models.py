"""Random-weight model directories of real shapes for the GPU benchmarks (no hub access).

Each model is a transformers config of the real model's shape plus random bf16 weights
written with safetensors (sharded, with the index HF reads), the byte-level tokenizer
of :mod:`lmkit.testing.tiny_model` and a generation config. Weights are drawn directly
on the fastest device (no HF model is instantiated, so an 8B model is written in
seconds), from ``N(0, 0.02)`` with unit norms: the engine's speed does not depend on
the values, and the activations stay finite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

MODELS = ("qwen3-0.6b", "llama-3.1-8b", "tiny-qwen3", "tiny-llama")
SHARD_BYTES = 4 * 2**30


def hf_config(name: str) -> Any:
    """The transformers config of ``name`` (one of :data:`MODELS`)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(eos_token_id=256, bos_token_id=None, pad_token_id=256)
    if name == "qwen3-0.6b":
        return Qwen3Config(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                           vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                           max_position_embeddings=40960, rope_theta=1000000.0, **common)
    if name == "llama-3.1-8b":
        return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                           tie_word_embeddings=False, rms_norm_eps=1e-5,
                           max_position_embeddings=131072, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192},
                           **common)
    if name == "tiny-qwen3":  # --smoke: the same code paths at toy size
        return Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128,
                           vocab_size=1024, tie_word_embeddings=True,
                           max_position_embeddings=4096, **common)
    if name == "tiny-llama":
        return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, vocab_size=1024,
                           tie_word_embeddings=False, max_position_embeddings=4096,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 1024},
                           **common)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """HF checkpoint tensor names and shapes of ``config``'s model (from a meta-device
    instance: no memory is allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def model_facts(config: Any) -> dict[str, Any]:
    """Sizes the bandwidth accounting needs: weight bytes one decode step reads (every
    matrix; the embedding table only when it is also the LM head) and KV bytes per
    cached token (bf16)."""
    shapes = weight_shapes(config)
    total = sum(math.prod(s) for s in shapes.values()) * 2
    embed = math.prod(shapes["model.embed_tokens.weight"]) * 2
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    return {"param_bytes": total, "decode_weight_bytes": total if tied else total - embed,
            "kv_bytes_per_token": kv_per_token, "num_params": total // 2}


def write_model(name: str, directory: Path, seed: int = 0) -> Path:
    """Write model ``name`` with random bf16 weights to ``directory``; return it. A
    directory that already holds the model (written by an earlier run with the same
    ``seed``) is reused as it is."""
    from lmkit.testing.tiny_model import make_byte_tokenizer
    from safetensors.torch import save_file

    directory = Path(directory)
    stamp = directory / "lmkit-bench-model.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"name": name, "seed": seed}:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(name)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    index: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_no = 0, 0
    files: list[tuple[str, dict[str, torch.Tensor]]] = []

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_no
        if shard:
            files.append((f"model-{shard_no:05d}.safetensors", shard))
            shard, shard_bytes, shard_no = {}, 0, shard_no + 1

    for tensor_name, shape in weight_shapes(config).items():
        if len(shape) == 1:  # norms
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0, 0.02,
                                                                               generator=gen)
        shard[tensor_name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    for i, (fname, tensors) in enumerate(files):
        final = fname.replace(f"{i:05d}", f"{i + 1:05d}-of-{len(files):05d}")
        save_file({k: v.cpu() for k, v in tensors.items()}, str(directory / final),
                  metadata={"format": "pt"})
        index.update({k: final for k in tensors})
    total = sum(t.numel() * 2 for _, ts in files for t in ts.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    config.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    make_byte_tokenizer().save_pretrained(directory)
    stamp.write_text(json.dumps({"name": name, "seed": seed}))
    return directory

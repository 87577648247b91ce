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
from lmkit.testing.model_shapes import DEEPSEEK_V2_LITE

MODELS = ("qwen3-0.6b", "llama-3.1-8b", "llama-3.1-70b", "deepseek-v2-lite", "tiny-qwen3",
          "tiny-llama", "tiny-deepseek-v2")
SHARD_BYTES = 4 * 2**30
#: the same structure at toy size (--smoke): dense first layer, MLA, MoE, YaRN
TINY_DEEPSEEK_V2 = dict(
    DEEPSEEK_V2_LITE, vocab_size=1024, hidden_size=64, intermediate_size=128,
    moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
    qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2,
    max_position_embeddings=20480,  # YaRN's factor 40 over 512 original positions
    rope_scaling=dict(DEEPSEEK_V2_LITE["rope_scaling"], original_max_position_embeddings=512))


def hf_config(name: str, num_layers: int | None = None) -> Any:
    """The transformers config of ``name`` (one of :data:`MODELS`); ``num_layers``
    replaces the number of decoder layers (a smaller model of the same shape)."""
    config = _hf_config(name)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        config.num_hidden_layers = num_layers
    return config


def _hf_config(name: str) -> Any:
    from transformers import DeepseekV2Config, LlamaConfig, Qwen3Config

    common = dict(eos_token_id=256, bos_token_id=None, pad_token_id=256)
    if name == "deepseek-v2-lite":
        return DeepseekV2Config(**DEEPSEEK_V2_LITE, **common)
    if name == "tiny-deepseek-v2":
        return DeepseekV2Config(**TINY_DEEPSEEK_V2, **common)
    if name == "qwen3-0.6b":
        return Qwen3Config(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                           vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                           max_position_embeddings=40960, rope_theta=1000000.0, **common)
    llama31 = dict(num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                   rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}, **common)
    if name == "llama-3.1-8b":
        return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                           intermediate_size=14336, **llama31)
    if name == "llama-3.1-70b":  # beyond one GPU: --tp 2 with --load-format dummy
        return LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                           intermediate_size=28672, **llama31)
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
    """HF checkpoint tensor names and shapes of ``config``'s model (lmkit's dummy-weight
    loader's, :func:`lmkit.loading.dummy.checkpoint_shapes`)."""
    from lmkit.loading.dummy import checkpoint_shapes

    return checkpoint_shapes(config)


def read_bytes(name: str, shape: tuple[int, ...], quantization: str | None) -> int:
    """Bytes a step reads of checkpoint tensor ``name``: bf16, or with ``quantization``
    ``"fp8"`` the projections the ``fp8`` method quantizes (its ``PROJECTION`` names;
    ``"fp8-lm-head"``: and the LM head) as 1 byte per weight plus a float32 scale per
    output row."""
    if quantization in ("fp8", "fp8-lm-head"):
        from lmkit_plugins.quantization.fp8_checkpoint import PROJECTION

        if (PROJECTION.search(name) and ".experts." not in name) or (
                quantization == "fp8-lm-head" and name == "lm_head.weight"):
            return math.prod(shape) + 4 * shape[0]
    elif quantization not in (None, "none"):
        raise ValueError(f"no byte accounting for quantization {quantization!r}; known: "
                         "none, fp8, fp8-lm-head")
    return math.prod(shape) * 2


def model_facts(config: Any, quantization: str | None = None,
                kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Sizes the bandwidth accounting needs: weight bytes one decode step reads (every
    matrix; the embedding table only when it is also the LM head; of a MoE model's
    routed experts none: ``moe`` gives their sizes, and the benchmark adds the experts a
    step's batch is expected to touch), as stored under ``quantization``
    (:func:`read_bytes`), and KV bytes per cached token (bf16; MLA models cache one
    latent of ``kv_lora_rank + qk_rope_head_dim`` per layer; one byte per value with
    ``kv_cache_dtype`` ``fp8``). ``param_bytes``: the bf16 checkpoint's size."""
    shapes = weight_shapes(config)
    total = sum(read_bytes(n, s, quantization) for n, s in shapes.items())
    embed = math.prod(shapes["model.embed_tokens.weight"]) * 2
    tied = bool(getattr(config, "tie_word_embeddings", False))
    layers = config.num_hidden_layers
    kv_elem = 1 if kv_cache_dtype == "fp8" else 2
    if getattr(config, "kv_lora_rank", None):  # MLA: the latent cache
        kv_per_token = layers * (config.kv_lora_rank + config.qk_rope_head_dim) * kv_elem
    else:
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        kv_per_token = layers * 2 * config.num_key_value_heads * head_dim * kv_elem
    decode = total if tied else total - embed
    num_params = sum(math.prod(s) for s in shapes.values())
    facts: dict[str, Any] = {"param_bytes": num_params * 2, "kv_bytes_per_token": kv_per_token,
                             "num_params": num_params, "num_hidden_layers": layers,
                             "quantization": quantization or "none",
                             "kv_cache_dtype": kv_cache_dtype}
    expert_names = [n for n in shapes if ".mlp.experts." in n]
    if expert_names:
        experts_bytes = sum(read_bytes(n, shapes[n], quantization) for n in expert_names)
        moe_layers = len({n.split(".mlp.experts.")[0] for n in expert_names})
        num_experts = config.n_routed_experts
        decode -= experts_bytes
        facts["moe"] = {"layers": moe_layers, "experts": num_experts,
                        "top_k": config.num_experts_per_tok,
                        "expert_bytes": experts_bytes // (moe_layers * num_experts)}
    facts["decode_weight_bytes"] = decode
    # the matrix products' FLOPs per token (gpu_run_profile): every 2-D weight but the
    # embedding and the LM head, which runs only where a token is sampled
    head = config.vocab_size * config.hidden_size
    facts["lm_head_params"] = head
    facts["linear_params"] = sum(
        math.prod(s) for n, s in shapes.items()
        if len(s) == 2 and n not in ("model.embed_tokens.weight", "lm_head.weight"))
    return facts


def expected_expert_bytes(moe: dict[str, Any], batch: int) -> float:
    """Bytes of routed experts a decode step of ``batch`` tokens reads, expected under
    uniform routing: ``E * (1 - (1 - k / E) ** batch)`` distinct experts per MoE layer."""
    experts, top_k = moe["experts"], moe["top_k"]
    touched = experts * (1.0 - (1.0 - top_k / experts) ** batch)
    return moe["layers"] * touched * moe["expert_bytes"]


def write_model(name: str, directory: Path, seed: int = 0, num_layers: int | None = None,
                weights: bool = True) -> Path:
    """Write model ``name`` (with ``num_layers`` decoder layers if given) with random bf16
    weights to ``directory``; return it. A directory that already holds the model
    (written by an earlier run with the same ``seed`` and layers) is reused as it is.
    ``weights=False`` writes its config and tokenizer only, for engines that draw
    random weights themselves (``load_format dummy``: shapes too large to write)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    stamp = directory / "lmkit-bench-model.json"
    want: dict[str, Any] = {"name": name, "seed": seed}
    if num_layers is not None:
        want["num_hidden_layers"] = num_layers
    if not weights:
        want["weights"] = False
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(name, num_layers)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    if not weights:
        return _write_files(directory, config, stamp, want)
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
    return _write_files(directory, config, stamp, want)


def _write_files(directory: Path, config: Any, stamp: Path, want: dict[str, Any]) -> Path:
    """A model directory's files besides its weights, and the stamp that marks it done."""
    from lmkit.testing.tiny_model import make_byte_tokenizer

    config.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    make_byte_tokenizer().save_pretrained(directory)
    stamp.write_text(json.dumps(want))
    return directory

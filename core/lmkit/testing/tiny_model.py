"""A tiny random model directory (Llama architecture, byte-level tokenizer) for tests
that need a real engine: executors, proposers end to end, schedulers in the engine;
:func:`make_tiny_deepseek` writes a DeepSeek-V2/V3 one (MLA + MoE) the same way.

The tokenizer maps each UTF-8 byte to one token (ids 0-255, GPT-2's byte alphabet),
plus ``<|endoftext|>`` (256, EOS). Its vocabulary is small enough for brute-force
checks over every token (structured output).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
NUM_BYTE_TOKENS = 256


def make_byte_tokenizer():
    """A ``PreTrainedTokenizerFast``: one token per byte, then ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    vocab[EOS] = NUM_BYTE_TOKENS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False)


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to character ``ch``."""
    return _BYTE_OF_CHAR[ch]


def _byte_alphabet() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    for n, b in enumerate(extra):
        chars[b] = chr(256 + n)
    return {ch: b for b, ch in chars.items()}


_BYTE_OF_CHAR = _byte_alphabet()


def make_tiny_model(directory: str | Path, *, vocab_size: int = 320, num_layers: int = 2,
                    hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                    max_position_embeddings: int = 512, seed: int = 0) -> Path:
    """Write a random-weight ``LlamaForCausalLM`` (safetensors) and the byte tokenizer
    to ``directory``; return it. Same seed, same weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    eos_id = NUM_BYTE_TOKENS
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=max_position_embeddings,
                         initializer_range=0.2, tie_word_embeddings=True,
                         eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return directory


def make_tiny_qwen3(directory: str | Path, seed: int = 0) -> Any:
    """Write a random-weight two-layer ``Qwen3ForCausalLM`` (hidden 64, q/k norms, head
    dim 32, tied embeddings) and the byte tokenizer to ``directory``; return the model
    (transformers', in eval mode: the reference the tests compare with)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=512, initializer_range=0.1,
                         tie_word_embeddings=True, eos_token_id=NUM_BYTE_TOKENS,
                         bos_token_id=None, pad_token_id=NUM_BYTE_TOKENS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    return model


def make_tiny_bert_classifier(directory: str | Path, num_labels: int, *, seed: int = 0,
                              initializer_range: float = 0.2,
                              label_names: list[str] | None = None,
                              problem_type: str | None = None) -> Any:
    """Write a random-weight two-layer ``BertForSequenceClassification`` (hidden 32) with
    ``num_labels`` labels (named ``label_names``, else transformers' ``LABEL_i``) and the
    byte tokenizer to ``directory``; return the model (transformers', in eval mode).
    The weights come from ``torch.manual_seed(seed)``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    labels: dict[str, Any] = {"num_labels": num_labels}
    if label_names is not None:
        labels = {"id2label": dict(enumerate(label_names)),
                  "label2id": {n: i for i, n in enumerate(label_names)}}
    config = BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, initializer_range=initializer_range,
                        problem_type=problem_type, **labels)
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    return model


def make_tiny_deepseek(directory: str | Path, version: int = 3, *, q_lora_rank: int | None = 32,
                       vocab_size: int = 320, seed: int = 0, **overrides: object) -> Path:
    """Write a random-weight ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``
    (MLA with or without q-LoRA, a dense first layer then MoE layers with a shared
    expert, YaRN RoPE on V3) and the byte tokenizer to ``directory``; return it.
    ``overrides`` replace config values (e.g. DeepSeek-V2-Lite's shapes on a GPU)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    eos_id = NUM_BYTE_TOKENS
    values: dict[str, object] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, initializer_range=0.2,
        tie_word_embeddings=False, eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id)
    if version == 3:
        values.update(n_group=2, topk_group=1, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    values.update(overrides)
    config_cls = getattr(transformers, f"DeepseekV{version}Config")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config_cls(**values), dtype=torch.float32)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return directory


def load_tiny_model(directory: str | Path, model_cls: Any, attention_cls: Any, *,
                    dtype: Any = None, device: Any = "cpu", block_size: int = 16) -> Any:
    """``model_cls`` built over the checkpoint in ``directory`` (its ``config.json``) with
    ``attention_cls`` and its weights loaded, in eval mode: the model as the runner
    builds it, for tests that drive a model directly (default float32 on the CPU)."""
    import torch

    from lmkit.api.model import ModelBuildContext
    from lmkit.loading.weights import iterate_weights, load_hf_config

    ctx = ModelBuildContext(dtype=dtype or torch.float32, device=torch.device(device),
                            block_size=block_size, attention_cls=attention_cls)
    model = model_cls(load_hf_config(directory), ctx)
    model.load_weights(iterate_weights(directory))
    return model.eval()

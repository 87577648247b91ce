"""A tiny random model directory (Llama architecture, byte-level tokenizer) for tests
that need a real engine: executors, proposers end to end, schedulers in the engine.

The tokenizer maps each UTF-8 byte to one token (ids 0-255, GPT-2's byte alphabet),
plus ``<|endoftext|>`` (256, EOS). Its vocabulary is small enough for brute-force
checks over every token (structured output).
"""

from __future__ import annotations

import json
from pathlib import Path

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

"""Shared fixtures for unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The real SmolLM2-135M-Instruct tokenizer (byte-level BPE, 49152 ids, chat template),
    from the default model that the alias source fetched into lmkit's cache."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)

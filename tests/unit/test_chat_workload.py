"""``lmkit.benchmarking.workload.chat_workload``: the built-in chat prompts or given
texts, seeded order, rendered with the chat template."""

from __future__ import annotations

import pytest
from lmkit.benchmarking.prompts import CHAT_PROMPTS
from lmkit.benchmarking.workload import chat_workload


class Tokenizer:
    """Renders a chat as its last message (no template) and encodes characters."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _texts(wl):
    return ["".join(map(chr, p)) for p in wl.prompts]


def test_given_texts_replace_the_built_in_prompts(monkeypatch):
    monkeypatch.setattr("lmkit.text.chat.render_chat", lambda tok, msgs: msgs[-1]["content"])
    given = ["first held-out prompt", "second one", "third"]
    wl = chat_workload(Tokenizer(), 7, 16, seed=3, texts=given)
    texts = _texts(wl)
    assert len(texts) == 7 and set(texts) == set(given)  # cycled over the three
    assert sorted(texts) == sorted(given * 2 + given[:1])
    assert wl.output_lens == [16] * 7 and "3 given prompts" in wl.describe()
    assert _texts(chat_workload(Tokenizer(), 7, 16, seed=3, texts=given)) == texts  # seeded
    builtin = _texts(chat_workload(Tokenizer(), 5, 16, seed=3))
    assert set(builtin) <= set(CHAT_PROMPTS) and "given" not in chat_workload(
        Tokenizer(), 5, 16).describe()


def test_no_texts_is_refused():
    with pytest.raises(ValueError, match="no prompt texts"):
        chat_workload(Tokenizer(), 2, 8, texts=[])

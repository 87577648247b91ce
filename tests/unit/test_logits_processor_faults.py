"""A plugin logits processor that raises or answers with the wrong shape is named in a
PluginError, never sampled from: narrowed logits would otherwise be sampled as if they
were the whole vocabulary (silently wrong tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lmkit.errors import PluginError
from lmkit.sample.draws import adjust_logits


class Narrowing:
    def apply(self, logits, slots):
        return logits[:, :10]


class Raising:
    def apply(self, logits, slots):
        raise RuntimeError("state not initialised")


class NoAnswer:
    def apply(self, logits, slots):
        logits[:, 0] = 1.0  # in place, but forgets to return it


class Doubling:
    def apply(self, logits, slots):
        return logits * 2


def metadata(*processors):
    return SimpleNamespace(bias_rows=None, bias_token_ids=None, bias_values=None,
                           banned_rows=None, banned_token_ids=None, allowed_rows=None,
                           allowed_mask=None, penalties=None,
                           processor_slots=torch.zeros(2, dtype=torch.int64),
                           logits_processors=list(processors))


@pytest.mark.parametrize("processor,expected", [
    (Narrowing(), "apply() returned a tensor of shape (2, 10); it must return the "
                  "logits' shape (2, 32)"),
    (NoAnswer(), "apply() returned NoneType"),
    (Raising(), "raised RuntimeError"),
])
def test_a_faulty_processor_is_named(processor, expected):
    with pytest.raises(PluginError) as info:
        adjust_logits(torch.zeros(2, 32), metadata(Doubling(), processor))
    message = str(info.value)
    assert f"logits processor {type(processor).__qualname__} ({__name__})" in message
    assert expected in message


def test_a_sound_processor_chain_is_applied():
    logits = torch.ones(2, 32)
    assert torch.equal(adjust_logits(logits, metadata(Doubling(), Doubling())),
                       torch.full((2, 32), 4.0))

"""Fixtures of the EAGLE tests: the tiny random Llama, random EAGLE / EAGLE-3 heads for
it, and its greedy outputs without speculation (module-scoped: each test module builds
its own)."""

from __future__ import annotations

import pytest
from eagle_engine import COMMON, GREEDY, PROMPTS, tokens
from lmkit import LLM
from lmkit.testing.eagle_head import make_tiny_eagle3_head, make_tiny_eagle_head
from lmkit.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-eagle"))


@pytest.fixture(scope="module")
def head(tiny, tmp_path_factory):
    # weights large enough that the drafts depend on the head's attention (its KV cache)
    return make_tiny_eagle_head(tmp_path_factory.mktemp("eagle-head"), tiny, layer_std=0.3)


@pytest.fixture(scope="module")
def head3(tiny, tmp_path_factory):
    return make_tiny_eagle3_head(tmp_path_factory.mktemp("eagle3-head"), tiny)


@pytest.fixture(scope="module")
def heads(head, head3):
    return {"eagle": head, "eagle3": head3}


@pytest.fixture(scope="module")
def baseline(tiny):
    with LLM(str(tiny), num_blocks=96, **COMMON) as llm:
        return tokens(llm.generate(PROMPTS, GREEDY))

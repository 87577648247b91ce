"""The prompt forms ``LLM.generate`` accepts (vLLM's: text, token ids, ``{"prompt": ...}``,
``{"prompt_token_ids": ...}``, lists of these) and the TypeError for anything else."""

from __future__ import annotations

import numpy as np
import pytest
from lmkit import LLM, SamplingParams
from lmkit.frontend.llm import as_prompt_list
from lmkit.testing.tiny_model import make_tiny_model


@pytest.mark.parametrize(("given", "expected"), [
    ("hi", ["hi"]),
    ({"prompt": "hi"}, ["hi"]),
    ({"prompt_token_ids": [1, 2]}, [[1, 2]]),
    ([1, 2, 3], [[1, 2, 3]]),  # a flat list of ints is one prompt
    ([np.int64(4), 5], [[4, 5]]),
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ([{"prompt_token_ids": [7]}, {"prompt": "x"}, "y", [8, 9]], [[7], "x", "y", [8, 9]]),
    ([], []),
])
def test_accepted_forms(given, expected):
    assert as_prompt_list(given) == expected


@pytest.mark.parametrize(("given", "words"), [
    (42, ["of type int", "accepted:", "{'prompt_token_ids': [int, ...]}"]),
    (None, ["of type NoneType", "accepted:"]),
    ([b"bytes"], ["prompt 0 of type bytes", "accepted:"]),
    (["ok", 3.5], ["prompt 1 of type float"]),
    ([[1, "2"]], ["prompt 0 of type list", "[1, '2']"]),
    ({"prompt_ids": [1]}, ["keys ['prompt_ids']", "exactly one of 'prompt'"]),
    ({"prompt": "a", "prompt_token_ids": [1]}, ["keys ['prompt', 'prompt_token_ids']"]),
    ({"prompt": "a", "multi_modal_data": {}}, ["other vLLM keys are not supported"]),
    ({"prompt": [1, 2]}, ["'prompt' of type list", "must be a str"]),
    ({"prompt_token_ids": "12"}, ["'prompt_token_ids' of type str", "must be a list of ints"]),
    ([True, False], ["prompt 0 of type bool"]),  # booleans are not token ids
])
def test_refused_forms_name_what_was_given(given, words):
    with pytest.raises(TypeError) as info:
        as_prompt_list(given)
    for word in words:
        assert word in str(info.value)


def test_generate_takes_vllm_prompt_dicts(tmp_path):
    """The dict forms reach the engine: same greedy output as text and token ids."""
    llm = LLM(str(make_tiny_model(tmp_path / "tiny")), device="cpu", dtype="float32",
              max_model_len=64, num_blocks=32, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.encode("abcabc")
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt": "abcabc"}, ids, "abcabc"], greedy)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3] and len(tokens[0]) == 4
    streamed = list(llm.stream({"prompt_token_ids": ids}, greedy))
    assert streamed[-1].outputs[0].token_ids == tokens[0]
    with pytest.raises(TypeError, match="accepted:"):
        llm.generate([{"text": "abcabc"}], greedy)
    llm.shutdown()

"""Engine features under ``--tp 2`` over NCCL (two or more GPUs), one check each, in
float32 so that greedy tokens compare exactly (triton attention, which CUDA graphs
capture): decode CUDA graphs (replayed with their all-reduces inside) give the eager
tokens; ngram speculation gives plain decoding's tokens and drafts; an EAGLE-3 head
hosted on every rank gives TP=1's tokens and acceptance, drafting chains or a tree; a
regex constraint holds and gives TP=1's tokens."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

from lmkit import LLM, SamplingParams  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402

# repetitive prompts: the ngram proposer finds matches in them
PROMPTS = ["one two three one two three one two three one two",
           "abc abc abc abc abc abc abc", "x", "the same prefix twice: the same prefix"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head size 64: the triton backend's smallest (it declares cuda_graphs; under `auto`
    # a smaller head would fall back to one that runs eagerly)
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tp-features"), hidden_size=512,
                           num_heads=8, num_kv_heads=4, num_layers=4)


def run(model_dir, params, **settings):
    with LLM(str(model_dir), device="cuda", dtype="float32", attention="triton",
             progress=False, **settings) as llm:
        outs = llm.generate(PROMPTS, params)
        return llm.engine.stats(), [o.outputs[0] for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_tp2_cuda_graphs_equal_eager(model_dir):
    _, eager = run(model_dir, GREEDY, tensor_parallel_size=2, enforce_eager=True)
    _, graphs = run(model_dir, GREEDY, tensor_parallel_size=2)
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager]
    assert all(len(c.token_ids) == 64 for c in graphs)


def test_tp2_ngram_speculation_equals_plain_decoding(model_dir):
    _, plain = run(model_dir, GREEDY, tensor_parallel_size=1)
    stats, spec = run(model_dir, GREEDY, tensor_parallel_size=2, speculative="ngram",
                      num_speculative_tokens=3,
                      **{"speculative.options": {"prompt_lookup_min": 1,
                                                 "prompt_lookup_max": 2}})
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert stats["spec_num_draft_tokens"] > 0


def test_tp2_structured_output_holds_and_equals_tp1(model_dir):
    pattern = r"(yes|no), [0-9]{3}!"
    params = SamplingParams(temperature=0.0, max_tokens=32,
                            structured_outputs={"regex": pattern})
    _, one = run(model_dir, params, tensor_parallel_size=1)
    _, two = run(model_dir, params, tensor_parallel_size=2)
    assert [c.text for c in two] == [c.text for c in one]
    for c in two:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text


@pytest.mark.parametrize("tree", [None, [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]],
                         ids=["chain", "tree"])
def test_tp2_eagle3_head_on_every_rank_equals_tp1(model_dir, tmp_path, tree):
    from lmkit.testing.eagle_head import make_tiny_eagle3_head

    head = make_tiny_eagle3_head(tmp_path / "head", model_dir)
    spec = dict(speculative="eagle3", speculative_model=str(head),  # a tree: drafted and
                **({"num_speculative_tokens": 3} if tree is None  # walked alike on every rank
                   else {"speculative_tree": tree}))
    stats_one, one = run(model_dir, GREEDY, tensor_parallel_size=1, **spec)
    stats_two, two = run(model_dir, GREEDY, tensor_parallel_size=2, **spec)
    assert [c.token_ids for c in two] == [c.token_ids for c in one]
    assert stats_two["spec_num_draft_tokens"] == stats_one["spec_num_draft_tokens"] > 0
    assert stats_two["spec_num_accepted_tokens"] == stats_one["spec_num_accepted_tokens"]

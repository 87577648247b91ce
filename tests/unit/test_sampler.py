"""Sampler maths on crafted logits: greedy, filters, penalties, bias, min_tokens."""

from __future__ import annotations

import math

import pytest
import torch
from lmkit.api.sampling_params import SamplingParams
from lmkit.errors import InvalidRequestError
from lmkit.sample.filters import apply_min_p, apply_top_k, apply_top_k_top_p
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.penalties import apply_penalties, build_penalty_tensors
from lmkit.sample.sampler import Sampler, adjust_logits, compute_probs

CPU = torch.device("cpu")


def build(params, vocab, prompts=None, outputs=None, eos=None, generators=None):
    n = len(params)
    return SamplingMetadata.build(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        generators or [None] * n, eos if eos is not None else [None] * n, vocab, CPU)


def kept(probs_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs_row > 0).flatten().tolist())


def log_probs(*ps: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in ps], dtype=torch.float32)


def test_greedy_is_argmax_with_first_index_on_ties():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 5.0, 5.0], [-2.0, -1.0, -3.0, -1.0]])
    md = build([SamplingParams(temperature=0.0)] * 3, 4)
    assert md.all_greedy and md.temperature is None
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [1, 0, 1]
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_verify_greedy_takes_the_first_index_on_ties():
    from lmkit.sample.drafts import verify_greedy

    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 5.0, 5.0], [-2.0, -1.0, -3.0, -1.0]])
    out = verify_greedy(logits, [[], [0]])  # a plain decode, then one draft (accepted)
    assert out.token_ids == [[1], [0, 1]] and out.num_accepted == [0, 1]
    wide = torch.full((1, 49152), -1.0)
    wide[0, [7, 30000, 49151]] = 2.0
    assert verify_greedy(wide, [[]]).token_ids == [[7]]


def test_verify_greedy_takes_the_given_argmax():
    """With ``argmax`` (the engine's sampling kernels' on CUDA) the targets are its
    indices; asked to report rows with nothing allowed it keeps ``max`` (it needs the
    maxima)."""
    from lmkit.sample.drafts import verify_greedy

    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    seen = []

    def last_index(x):  # a stand-in that disagrees with torch, to see which one ran
        seen.append(tuple(x.shape))
        return torch.full((x.shape[0],), x.shape[1] - 1, dtype=torch.int64)

    assert verify_greedy(logits, [[], []], argmax=last_index).token_ids == [[2], [2]]
    assert seen == [(2, 3)]
    out = verify_greedy(logits, [[], []], check_no_token=True, argmax=last_index)
    assert out.token_ids == [[1], [0]] and seen == [(2, 3)]


def test_greedy_rows_in_mixed_batch_are_argmax_and_input_is_untouched():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5, top_k=3) for i in range(6)]
    for _ in range(5):
        out = Sampler()(logits, build(params, 50))
        assert out.sampled_token_ids[::2].tolist() == logits[::2].argmax(-1).tolist()
    assert torch.equal(logits, before)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k(logits.clone(), torch.tensor([2, 5]), max_top_k=2)
    assert torch.isinf(out[0]).tolist() == [True, False, True, False, True]
    assert torch.equal(out[1], logits[1])  # k == vocab: off
    md = build([SamplingParams(top_k=3), SamplingParams(top_k=0)], 5)
    probs = compute_probs(logits.clone(), md)
    assert kept(probs[0]) == {1, 2, 3}
    assert kept(probs[1]) == {0, 1, 2, 3, 4}
    assert probs.sum(-1).allclose(torch.ones(2))


def test_top_p_keeps_smallest_set_reaching_p():
    logits = log_probs(0.1, 0.5, 0.15, 0.25).repeat(3, 1)
    md = build([SamplingParams(top_p=0.4), SamplingParams(top_p=0.7),
                SamplingParams(top_p=0.8)], 4)
    probs = compute_probs(logits.clone(), md)
    assert kept(probs[0]) == {1}
    assert kept(probs[1]) == {1, 3}
    assert kept(probs[2]) == {1, 2, 3}
    # Renormalised over the kept set.
    assert probs[1, 1].item() == pytest.approx(0.5 / 0.75, rel=1e-5)


def test_top_p_is_measured_after_top_k():
    logits = log_probs(0.4, 0.3, 0.2, 0.1).unsqueeze(0)
    both = apply_top_k_top_p(logits.clone(), torch.tensor([3]), torch.tensor([0.75]))
    only_p = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.75]))
    # After top-k the mass is renormalised: 0.4/0.9 + 0.3/0.9 = 0.78 >= 0.75.
    assert kept(both.softmax(-1)[0]) == {0, 1}
    assert kept(only_p.softmax(-1)[0]) == {0, 1, 2}


def test_min_p_threshold_is_relative_to_top_probability():
    logits = log_probs(0.5, 0.3, 0.15, 0.05).unsqueeze(0)
    out = apply_min_p(logits.clone(), torch.tensor([0.2]))  # threshold 0.1
    assert torch.isinf(out[0]).tolist() == [False, False, False, True]
    md = build([SamplingParams(min_p=0.5), SamplingParams(min_p=0.0)], 4)
    probs = compute_probs(logits.repeat(2, 1), md)
    assert kept(probs[0]) == {0, 1}
    assert kept(probs[1]) == {0, 1, 2, 3}


def test_filters_are_skipped_when_no_row_uses_them():
    md = build([SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)], 8)
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.penalties is None and not md.needs_logit_adjustment
    assert md.temperature.tolist() == pytest.approx([0.7, 1.0])


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    probs = compute_probs(logits.clone(), build([SamplingParams(temperature=0.5)], 3))
    assert probs.allclose((logits / 0.5).softmax(-1))


def test_penalty_arithmetic():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 1.0, 0.5]] * 2)
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
    ]
    prompts = [[0, 1], [0, 1]]
    outputs = [[2, 3, 3], [2, 3, 3]]
    pen = build_penalty_tensors(params, prompts, outputs, 6, CPU)
    out = apply_penalties(logits.clone(), pen)
    # Repetition: prompt and output tokens, positive divided, negative multiplied.
    assert out[0].tolist() == [1.0, -4.0, 1.5, -2.0, 1.0, 0.5]
    # Frequency/presence: output tokens only (token 2 once, token 3 twice).
    assert out[1].tolist() == pytest.approx([2.0, -2.0, 3.0 - 0.5 - 0.25, -1.0 - 1.0 - 0.25,
                                             1.0, 0.5])


def test_penalties_change_the_greedy_choice_and_skip_unpenalised_rows():
    logits = torch.tensor([[3.0, 2.5, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.0)]
    md = build(params, 3, prompts=[[0], [0]])
    assert md.penalties.rows.tolist() == [0]  # the other row is not read
    assert md.penalties.row_seen().tolist() == [[True, False, False]]
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1, 0]
    md = build([SamplingParams(temperature=0.0, presence_penalty=1.0)], 3, prompts=[[2]],
               outputs=[[0]])
    # no repetition penalty: the prompt is not scanned
    assert md.penalties.row_seen().tolist() == [[True, False, False]]
    assert Sampler()(logits[:1], md).sampled_token_ids.tolist() == [1]


def test_logit_bias_applies_to_greedy_and_random_rows():
    logits = torch.zeros(2, 10)
    logits[:, 0] = 5.0
    params = [SamplingParams(temperature=0.0, logit_bias={7: 10.0}),
              SamplingParams(temperature=1.0, logit_bias={0: -100.0, 4: 100.0})]
    out = Sampler()(logits, build(params, 10))
    assert out.sampled_token_ids.tolist() == [7, 4]
    adjusted = adjust_logits(logits.clone(), build(params, 10))
    assert adjusted[0, 7].item() == 10.0 and adjusted[1, 0].item() == -95.0


def test_logit_bias_outside_vocab_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="logit_bias names token id 12") as exc:
        build([SamplingParams(logit_bias={12: 1.0})], 10)
    assert exc.value.param == "logit_bias"


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 6)
    logits[:, 5] = 10.0  # EOS is by far the most likely
    logits[:, 4] = 9.0  # then a stop token id
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[4]),
        SamplingParams(temperature=0.0, min_tokens=0),
    ]
    outputs = [[1, 1], [1, 1, 1], [1], []]
    md = build(params, 6, outputs=outputs, eos=[5, 5, 5, 5])
    out = Sampler()(logits, md)
    # Row 0 is short of min_tokens: EOS and 4 banned; row 1 reached it; row 2 keeps EOS
    # (ignore_eos) but still bans its stop token id; row 3 has no minimum.
    assert out.sampled_token_ids.tolist() == [0, 5, 5, 5]
    assert md.banned_rows.tolist() == [0, 0, 2]


def test_shapes_are_checked():
    md = build([SamplingParams()], 4)
    with pytest.raises(ValueError, match="num_rows=1"):
        Sampler()(torch.zeros(2, 4), md)
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [], [[]], [None], [None], 4, CPU)


def test_top_p_candidate_path_matches_full_sort():
    from lmkit.sample.filters import _top_p_by_sort

    torch.manual_seed(3)
    vocab = 3000
    # Peaked rows (nucleus well inside the 256 candidates) and flat rows (nucleus of
    # thousands of tokens: the sort fallback), in one batch.
    logits = torch.cat([torch.randn(4, vocab) * 4, torch.randn(3, vocab) * 0.05])
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.9, 0.3, 1.0])
    got = apply_top_k_top_p(logits.clone(), None, top_p)
    want = _top_p_by_sort(logits.clone(), top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    num_kept = (~torch.isinf(got)).sum(-1).tolist()
    assert num_kept[3] == num_kept[6] == vocab  # top_p = 1: off
    assert num_kept[4] > 256 and 1 <= num_kept[0] < 256


def test_penalties_go_through_the_samplers_kernels():
    from lmkit.api import TorchSamplingKernels

    class Recording(TorchSamplingKernels):
        def apply_penalties(self, logits, penalties):
            calls.append(penalties)
            return super().apply_penalties(logits, penalties)

    calls: list = []
    sampler = Sampler(Recording(device=CPU))
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5)] * 2
    md = build(params, 3, prompts=[[0], [0]])
    logits = torch.tensor([[3.0, 2.5, 0.0]] * 2)
    assert sampler(logits, md).sampled_token_ids.tolist() == [1, 1]
    assert len(calls) == 1 and calls[0] is md.penalties
    # the all-greedy verification path too
    rows = build(params + params[:1], 3, prompts=[[0]] * 3)
    drafted = sampler.sample_requests(torch.cat([logits, logits[:1]]), rows, [[1], []])
    assert len(calls) == 2 and calls[1] is rows.penalties and drafted.token_ids == [[1, 1], [1]]

"""The host side of a verification step: sampling rows without copies of the output
(:mod:`lmkit.spec_decode.rows`) and the all-greedy verification path of
:class:`~lmkit.sample.sampler.Sampler` (one argmax, one device-to-host copy), checked against the
general path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lmkit.api.sampling_params import SamplingParams
from lmkit.sample.draws import adjust_logits
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import Sampler
from lmkit.spec_decode.rows import (
    DraftExtendedTokens,
    hidden_rows,
    is_plain_greedy,
    sampling_rows,
)

CPU = torch.device("cpu")
VOCAB = 24


def test_draft_extended_tokens_reads_like_the_concatenation():
    base, drafts = [5, 6, 7], [1, 2, 3]
    view = DraftExtendedTokens(base, drafts, 2)
    want = base + drafts[:2]
    assert len(view) == 5 and list(view) == want
    assert [view[i] for i in range(-5, 5)] == want + want
    assert view[1:4] == want[1:4] and view.count(6) == 1 and 2 in view and 3 not in view
    with pytest.raises(IndexError):
        view[5]
    base.append(9)  # a view, not a copy
    assert list(view) == [5, 6, 7, 9, 1, 2]


def _state(output, **params):
    return SimpleNamespace(sampling_params=SamplingParams(temperature=0.0, **params),
                           prompt_token_ids=[1, 2], output_token_ids=output, generator=None,
                           eos_token_id=0)


def test_sampling_rows_copy_nothing_and_extend_outputs_where_read():
    plain, penalised, short = [3] * 50, [4, 5], [6]
    plan = [(_state(plain), 0, [8, 9]), (_state(penalised, repetition_penalty=1.5), 3, [10]),
            (_state(short, min_tokens=3), 5, [11, 12])]
    assert hidden_rows(plan) == slice(0, 8)
    rows = sampling_rows(plan)
    # only read for its length, already past min_tokens: the same list at every row
    assert all(o is plain for o in rows.outputs[:3])
    assert [list(o) for o in rows.outputs[3:]] == [[4, 5], [4, 5, 10], [6], [6, 11],
                                                   [6, 11, 12]]
    assert len(rows.params) == len(rows.prompts) == len(rows.generators) == 8
    assert hidden_rows([(_state([]), 0, []), (_state([]), 4, [1])]) == [0, 4, 5]


def test_plain_greedy_is_what_the_raw_argmax_samples():
    def plain(num_output_tokens=5, **kw):
        return is_plain_greedy(SamplingParams(temperature=0.0, **kw), num_output_tokens)

    assert plain() and plain(min_tokens=5) and plain(structured_outputs={"regex": "a+"})
    assert not plain(min_tokens=6) and not plain(logprobs=0) and not plain(logit_bias={1: 1})
    assert not plain(presence_penalty=0.5) and not plain(repetition_penalty=1.1)
    assert not is_plain_greedy(SamplingParams(temperature=0.5), 5)


def test_metadata_from_rows_equals_metadata_from_copies():
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.2, min_tokens=4)
    output, drafts = [3, 4, 3], [4, 7, 9]
    rows = sampling_rows([(SimpleNamespace(sampling_params=params, prompt_token_ids=[2, 3],
                                           output_token_ids=output, generator=None,
                                           eos_token_id=1), 0, drafts)])
    copies = [output + drafts[:j] for j in range(4)]
    got = SamplingMetadata.build(rows.params, rows.prompts, rows.outputs, rows.generators,
                                 rows.eos_token_ids, VOCAB, CPU)
    want = SamplingMetadata.build([params] * 4, [[2, 3]] * 4, copies, [None] * 4, [1] * 4,
                                  VOCAB, CPU)
    logits = torch.randn(4, VOCAB)
    assert torch.equal(adjust_logits(logits.clone(), got), adjust_logits(logits.clone(), want))
    assert torch.equal(got.penalties.row_seen(), want.penalties.row_seen())
    assert torch.equal(got.penalties.row_counts(), want.penalties.row_counts())
    assert torch.equal(got.banned_rows, want.banned_rows)  # min_tokens 4: 3 tokens at row 0
    assert got.banned_rows.tolist() == [0]


def _verify(logits, params, drafts):
    rows = sampling_rows([(_state([1, 2, 3]), 0, d) for d in drafts])
    md = SamplingMetadata.build([params] * len(rows.params), rows.prompts, rows.outputs,
                                rows.generators, rows.eos_token_ids, VOCAB, CPU)
    return Sampler().sample_requests(logits, md, drafts)


@pytest.mark.parametrize("bias", [None, {5: 3.0, 7: -2.0}])
def test_greedy_fast_path_matches_the_general_path(bias):
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        drafts = [torch.randint(0, VOCAB, (int(k),), generator=g).tolist()
                  for k in torch.randint(0, 5, (6,), generator=g)]
        num_rows = sum(map(len, drafts)) + len(drafts)
        logits = torch.randn(num_rows, VOCAB, generator=g) * 3
        if bias:
            logits[:, 5] -= 3.0  # the bias decides some argmaxes
        # make drafts right at a random prefix of their rows, so runs get accepted
        targets = logits.clone()
        for tok, b in (bias or {}).items():
            targets[:, tok] += b
        top, start = targets.argmax(-1).tolist(), 0
        for d in drafts:
            keep = int(torch.randint(0, len(d) + 1, (1,), generator=g))
            d[:keep] = top[start:start + keep]
            start += len(d) + 1
        fast = _verify(logits, SamplingParams(temperature=0.0, logit_bias=bias), drafts)
        general = _verify(logits, SamplingParams(temperature=0.0, logit_bias=bias,
                                                 logprobs=1), drafts)  # logprobs: general
        assert fast.logprobs is None and general.logprobs is not None
        assert fast.token_ids == general.token_ids, trial
        assert fast.num_accepted == general.num_accepted, trial
        assert fast.num_accepted == [len(t) - 1 for t in fast.token_ids]


def test_speculation_pauses_after_steps_with_a_large_batch():
    from lmkit.api import Proposal, SpecProposer
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.request import Request, RequestStatus
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.config.schema import LMKitConfig
    from lmkit.spec_decode.manager import ProposerManager

    class Sevens(SpecProposer):
        def __init__(self):
            self.calls = []

        def propose(self, batch):
            self.calls.append(list(batch.num_new_tokens))
            return Proposal([[7, 7] for _ in batch.req_ids])

    assert LMKitConfig.model_validate(
        {"speculative": {"disable_by_batch_size": 2}}).speculative.disable_by_batch_size == 2
    requests = []
    for rid in "abc":
        r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=20))
        r.status = RequestStatus.RUNNING
        requests.append(r)
    proposer = Sevens()
    m = ProposerManager(proposer, "sevens", 2, vocab_size=100, disable_by_batch_size=2)
    for r in requests:
        m.add_request(r)

    def step(running):
        for r in running:
            r.append_output_token_ids([4])
            r.num_computed_tokens = r.num_tokens - 1
        so = SchedulerOutput(num_scheduled_tokens={r.request_id: 1 for r in running})
        m.after_step(so, ModelRunnerOutput(), [EngineCoreOutput(r.request_id, [4])
                                               for r in running])

    step(requests)  # 3 running > 2: nothing proposed
    assert proposer.calls == [] and all(r.spec_token_ids == [] for r in requests)
    assert m.get_stats()["spec_num_steps_off"] == 1
    step(requests[:2])  # 2 running: drafts, and the proposer sees every token since
    assert proposer.calls == [[5, 5]] and requests[0].spec_token_ids == [7, 7]


def test_disable_by_batch_size_through_the_engine(tmp_path):
    from lmkit import LLM
    from lmkit.testing.tiny_model import make_tiny_model

    model = str(make_tiny_model(tmp_path))
    common = dict(device="cpu", dtype="float32", max_model_len=256, num_blocks=96,
                  block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["abcabcabcabc", "0123401234", "the cat sat on the mat; the cat"]
    with LLM(model, **common) as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(model, speculative="ngram", **{"speculative.disable_by_batch_size": 2},
             **common) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
    assert got == base
    assert stats["spec_num_steps_off"] > 0  # three running: off

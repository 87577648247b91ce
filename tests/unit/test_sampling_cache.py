"""The runner's per-request sampling tensors (lmkit.sample.row_cache.SamplingCache): the
logits a step adjusts with them equal those of tensors built afresh, step after step, as
requests grow, draft, leave and come back; bad ids are refused as before."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from lmkit import SamplingParams
from lmkit.errors import InvalidRequestError
from lmkit.sample.draws import adjust_logits
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.row_cache import SamplingCache, SlotTable
from lmkit.spec_decode.rows import DraftExtendedTokens

CPU = torch.device("cpu")
VOCAB = 40


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(6)
    if kind == 0:
        return SamplingParams(temperature=0.0, repetition_penalty=rng.choice([1.3, 0.8]))
    if kind == 1:
        return SamplingParams(temperature=0.7, frequency_penalty=0.4, presence_penalty=0.3)
    if kind == 2:
        return SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=-0.5)
    if kind == 3:
        return SamplingParams(temperature=0.5, allowed_token_ids=rng.sample(range(VOCAB), 5))
    if kind == 4:
        return SamplingParams(temperature=0.0, logit_bias={rng.randrange(VOCAB): 3.0,
                                                           rng.randrange(VOCAB): -2.5})
    return SamplingParams(temperature=0.9)


def _adjusted(logits, params, prompts, outputs, cache=None, keys=None):
    md = SamplingMetadata.build(params, prompts, outputs, [None] * len(params),
                                [None] * len(params), VOCAB, CPU, cache, keys)
    return adjust_logits(logits.clone(), md)


def test_cached_rows_adjust_the_logits_as_fresh_ones_step_after_step():
    rng = random.Random(0)
    cache = SamplingCache(VOCAB, CPU)
    live: dict[str, tuple[SamplingParams, list[int], list[int]]] = {}
    for step in range(40):
        for rid in [r for r in live if rng.random() < 0.1]:  # finished
            del live[rid]
            cache.forget(rid)
        while len(live) < 6:  # new requests
            live[f"r{step}-{len(live)}"] = (_params(rng), rng.choices(range(VOCAB), k=8), [])
        if step % 7 == 3:  # a request re-added after preemption: a new output list
            rid = next(iter(live))
            p, prompt, out = live[rid]
            live[rid] = (p, prompt, list(out))
        keys, params, prompts, outputs = [], [], [], []
        for rid, (p, prompt, out) in live.items():
            drafts = rng.choices(range(VOCAB), k=rng.randrange(3))
            for j in range(len(drafts) + 1):
                keys.append(rid)
                params.append(p)
                prompts.append(prompt)
                outputs.append(out if j == 0 else DraftExtendedTokens(out, drafts, j))
        logits = torch.randn(len(params), VOCAB)
        fresh = _adjusted(logits, params, prompts, [list(o) for o in outputs])
        cached = _adjusted(logits, params, prompts, outputs, cache, keys)
        assert torch.equal(cached, fresh), f"step {step}"
        for _, _, out in live.values():  # each request generates 1-3 tokens
            out.extend(rng.choices(range(VOCAB), k=rng.randrange(1, 4)))
    assert 0 < len(cache) <= 6 + 1


def _counts(cache, out, prompt=(1,), params=None):
    # one row's penalty counts (drafts included) and seen tokens
    params = params or SamplingParams(frequency_penalty=1.0)
    t = cache.penalty_rows(["a"], [params], [list(prompt)], [out], [0])
    return t.row_counts()[0], t.row_seen()[0]


def test_penalty_counts_take_only_the_new_tokens():
    cache = SamplingCache(VOCAB, CPU)
    out = [3, 3]
    counts, seen = _counts(cache, out)
    assert counts[3].item() == 2 and seen.nonzero().flatten().tolist() == [3]  # prompt not seen
    out.append(3)
    assert _counts(cache, out)[0][3].item() == 3
    # a draft row counts its drafts on its own copy, not in the request's counts
    counts, seen = _counts(cache, DraftExtendedTokens(out, [3, 5], 2))
    assert counts[3].item() == 4 and counts[5].item() == 1 and seen[5].item()
    counts, seen = _counts(cache, out)
    assert counts[5].item() == 0 and not seen[5].item()
    out[:] = [5]  # shorter than counted (rebuilt): counted afresh
    counts, seen = _counts(cache, out)
    assert counts[3].item() == 0 and counts[5].item() == 1 and not seen[3].item()
    rep = SamplingParams(repetition_penalty=1.2)  # a repetition penalty sees the prompt
    assert _counts(SamplingCache(VOCAB, CPU), [4], (7,), rep)[1].nonzero().flatten().tolist() \
        == [4, 7]


def test_slots_are_reused_and_tables_grow_by_doubling():
    table = SlotTable(3, torch.int32, CPU)
    slots = [table.take() for _ in range(5)]
    assert slots == [0, 1, 2, 3, 4] and table.data.shape == (8, 3)
    table.data[2] = 7
    table.free(2)
    assert table.take() == 2 and table.data[2].tolist() == [0, 0, 0]  # zeroed when taken
    cache = SamplingCache(VOCAB, CPU)
    for i in range(3):
        cache.allowed_slot(f"r{i}", SamplingParams(allowed_token_ids=[i]))
    cache.forget("r0")
    cache.forget("r2")
    assert len(cache) == 1
    assert cache.allowed_slot("r9", SamplingParams(allowed_token_ids=[9])) in (0, 2)


@pytest.mark.parametrize("field,value", [("logit_bias", {VOCAB: 1.0}),
                                         ("allowed_token_ids", [1, VOCAB + 3])])
def test_ids_outside_the_vocabulary_are_refused_with_the_parameter(field, value):
    params = [SamplingParams(**{field: value})]
    for cache in (None, SamplingCache(VOCAB, CPU)):
        with pytest.raises(InvalidRequestError, match=f"{field} names token id") as err:
            SamplingMetadata.build(params, [[1]], [[]], [None], [None], VOCAB, CPU,
                                   cache, ["r"] if cache else None)
        assert err.value.param == field


def test_a_new_params_object_under_an_old_id_rebuilds_its_entry():
    cache = SamplingCache(VOCAB, CPU)
    logits = torch.zeros(1, VOCAB)
    first = SamplingParams(logit_bias={4: 5.0})
    assert _adjusted(logits, [first], [[1]], [[]], cache, ["r"])[0, 4].item() == 5.0
    second = SamplingParams(logit_bias={6: 5.0})
    out = _adjusted(logits, [second], [[1]], [[]], cache, ["r"])
    assert out[0, 4].item() == 0.0 and out[0, 6].item() == 5.0


def test_the_dense_path_cuda_takes_adjusts_as_the_cpu_scan_does():
    from lmkit.sample.penalties import _apply_dense, _apply_scanned

    rng = random.Random(1)
    cache = SamplingCache(VOCAB, CPU)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(presence_penalty=-0.7), SamplingParams(temperature=0.3),
              SamplingParams(repetition_penalty=0.7)]
    out = [rng.choices(range(VOCAB), k=9) for _ in params]
    outputs = [out[0], DraftExtendedTokens(out[0], [1, 2], 2), out[1], out[2], out[3]]
    keys, rows_params = ["a", "a", "b", "c", "d"], [params[0]] * 2 + params[1:]
    md = SamplingMetadata.build(rows_params, [[5, 6]] * 5, outputs, [None] * 5, [None] * 5,
                                VOCAB, CPU, cache, keys)
    logits = torch.randn(5, VOCAB) * 3
    dense = _apply_dense(logits.clone(), md.penalties)
    assert torch.equal(dense, _apply_scanned(logits.clone(), md.penalties))
    assert torch.equal(dense[3], logits[3])  # no penalty: untouched
    assert not torch.equal(dense[1], logits[1])


def _engine_params(i: int, n_prompt: int) -> SamplingParams:
    extra = [dict(repetition_penalty=1.4, presence_penalty=0.5),
             dict(frequency_penalty=0.6, logit_bias={65: 2.0, 66: 1.5}),
             dict(allowed_token_ids=list(range(60, 90)), repetition_penalty=0.8),
             dict(temperature=0.9, seed=7, presence_penalty=1.0)][i % 4]
    return SamplingParams(**{"temperature": 0.0, **extra}, max_tokens=56 - n_prompt,
                          ignore_eos=True)


def test_engine_outputs_with_kept_tensors_do_not_depend_on_batching_preemption_or_drafts(
        tmp_path):
    """Requests with penalties, bias and allowed ids decode the same tokens alone, all
    together, crowded into a KV pool that preempts them (re-added: counts rebuilt), and
    with ngram drafts (rows extended by drafts): no request's kept tensors leak into
    another's or go stale."""
    from lmkit import LLM
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny")
    common = dict(device="cpu", dtype="float32", max_model_len=64, progress=False)
    prompts = [[(13 * i + 5 * j) % 250 + 1 for j in range(3 + 4 * i)] for i in range(8)]
    params = [_engine_params(i, len(p)) for i, p in enumerate(prompts)]
    with LLM(str(tiny), **common) as llm:
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids
                 for p, sp in zip(prompts, params, strict=True)]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    with LLM(str(tiny), num_blocks=8, block_size=16, **common) as tight:
        crowded = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
        assert tight.stats()["num_preemptions"] > 0
    assert crowded == alone
    with LLM(str(tiny), speculative="ngram", num_speculative_tokens=3, **common) as spec:
        drafted = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
        assert spec.stats()["spec_num_draft_tokens"] > 0
    greedy = [i for i, sp in enumerate(params) if sp.temperature == 0.0]
    assert [drafted[i] for i in greedy] == [alone[i] for i in greedy]


def test_a_step_passes_the_kept_penalty_tables_not_copies():
    from lmkit.sample.row_cache import with_row_tokens

    cache = SamplingCache(VOCAB, CPU)
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(temperature=0.2),
              SamplingParams(repetition_penalty=1.3)]
    keys, prompts, outputs = ["a", "b", "c"], [[1], [2], [3]], [[4, 4], [5], [6]]
    for _ in range(2):
        md = SamplingMetadata.build(params, prompts, outputs, [None] * 3, [None] * 3, VOCAB,
                                    CPU, cache, keys)
        p = md.penalties
        # no [rows, vocab] copy of the seen table per step: the cache's own tables
        assert p.seen.data_ptr() == cache._seen.data.data_ptr()
        assert p.counts.data_ptr() == cache._counts.data.data_ptr()
        assert p.rows.tolist() == [0, 2] and p.repetition.tolist() == pytest.approx([1, 1, 1.3])
    # a token drawn but not yet read (a step launched ahead) counts for that step alone
    seen, counts = p.seen.clone(), p.counts.clone()
    ahead = with_row_tokens(p, torch.tensor([7, 8]))
    assert torch.equal(p.seen, seen) and torch.equal(p.counts, counts) and p.draft_counts is None
    read = SamplingMetadata.build(params, prompts, [[4, 4, 7], [5], [6, 8]], [None] * 3,
                                  [None] * 3, VOCAB, CPU).penalties
    assert torch.equal(ahead.row_seen(), read.row_seen())
    assert torch.equal(ahead.row_counts(), read.row_counts())
    logits = torch.randn(3, VOCAB)
    assert torch.equal(adjust_logits(logits.clone(), replace(md, penalties=ahead)),
                       adjust_logits(logits.clone(), replace(md, penalties=read)))

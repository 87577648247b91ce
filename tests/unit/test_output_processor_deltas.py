"""OutputProcessor: per-step deltas and cumulative fields, with and without stop strings,
for ``n`` completions and for several outputs of one request in one engine message; the
``"delta"`` and ``"final"`` output kinds against the cumulative one."""

from __future__ import annotations

import pytest
from lmkit.api.outputs import EngineCoreOutput, TokenLogprob
from lmkit.api.request import Request
from lmkit.api.sampling_params import SamplingParams
from lmkit.frontend.output_processor import OutputProcessor
from lmkit.testing.tiny_model import make_byte_tokenizer


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, logprob=-1.0, rank=1)


def test_two_outputs_of_one_request_in_one_step_fold_into_one_delta():
    tok = make_byte_tokenizer()
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=10, logprobs=0)
    proc.add_request(Request("r", _ids(tok, "hi"), params), "hi")
    a, b = _ids(tok, "ab"), _ids(tok, "cd")
    step = proc.process_outputs([
        EngineCoreOutput("r", a, new_logprobs=[_lp(i) for i in a]),
        EngineCoreOutput("r", b, new_logprobs=[_lp(i) for i in b]),
    ])
    (out,) = step.request_outputs
    (c,) = out.outputs
    assert (c.delta_text, c.text) == ("abcd", "abcd")
    assert c.delta_token_ids == a + b == c.token_ids
    assert [lp.token_id for lp in c.delta_logprobs] == a + b  # none dropped
    step = proc.process_outputs([EngineCoreOutput("r", _ids(tok, "e"), finish_reason="length",
                                                  new_logprobs=[_lp(_ids(tok, "e")[0])])])
    (c,) = step.request_outputs[0].outputs
    assert (c.delta_text, c.text, c.finish_reason) == ("e", "abcde", "length")
    assert step.request_outputs[0].finished and not proc.has_unfinished()


def test_n_completions_report_every_child_with_only_the_changed_ones_delta():
    tok = make_byte_tokenizer()
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=10, n=2)
    for i in (1, 0):  # added out of order: outputs come back by index
        proc.add_request(Request(f"p-{i}", [1], params), None, parent_id="p", index=i, n=2)
    step = proc.process_outputs([EngineCoreOutput("p-1", _ids(tok, "x"))])
    (out,) = step.request_outputs
    assert [c.index for c in out.outputs] == [0, 1]
    assert [(c.delta_text, c.text) for c in out.outputs] == [("", ""), ("x", "x")]
    assert out.outputs[0].delta_token_ids == [] and not out.finished
    step = proc.process_outputs([EngineCoreOutput("p-0", _ids(tok, "y"), finish_reason="stop"),
                                 EngineCoreOutput("p-1", _ids(tok, "z"), finish_reason="length")])
    (out,) = step.request_outputs
    assert [(c.delta_text, c.text) for c in out.outputs] == [("y", "y"), ("z", "xz")]
    assert out.finished and not proc.has_unfinished()


def test_stop_string_split_over_steps_is_held_and_cut():
    tok = make_byte_tokenizer()
    proc = OutputProcessor(tok)
    proc.add_request(Request("r", [1], SamplingParams(max_tokens=20, stop=["END"])), None)
    texts = []
    aborts = []
    for piece in ("ab", "E", "N", "Dxx"):
        step = proc.process_outputs([EngineCoreOutput("r", _ids(tok, piece))])
        texts += [c.delta_text for o in step.request_outputs for c in o.outputs]
        aborts += step.abort_ids
    assert "".join(texts) == "ab" and texts[1:3] == ["", ""]
    assert aborts == ["r"] and not proc.has_unfinished()


def _kind_run(kind: str):
    """Two parents (one with n=2, one with a stop string) of output ``kind`` fed the same
    steps; every RequestOutput each step returned, the abort ids and the progress."""
    tok = make_byte_tokenizer()
    proc = OutputProcessor(tok)
    pair = SamplingParams(max_tokens=10, n=2, logprobs=0)
    for i in (0, 1):
        proc.add_request(Request(f"p-{i}", [1], pair), None, parent_id="p", index=i, n=2,
                         kind=kind)
    proc.add_request(Request("s", [1], SamplingParams(max_tokens=10, stop=["END"])), "q",
                     kind=kind)
    steps = [[("p-0", "ab", None), ("p-1", "c", None), ("s", "xxE", None)],
             [("p-0", "d", "length"), ("p-1", "e", None), ("s", "NDyy", None)],
             [("p-1", "f", "stop")]]
    seen, aborted, progress = [], [], []
    for step in steps:
        outs = [EngineCoreOutput(rid, _ids(tok, text), finish_reason=reason,
                                 new_logprobs=[_lp(i) for i in _ids(tok, text)])
                for rid, text, reason in step]
        got = proc.process_outputs(outs)
        seen.append(got.request_outputs)
        aborted += got.abort_ids
        progress.append(got.progress)
    assert not proc.has_unfinished()
    return seen, aborted, progress


def _fields(c) -> tuple:
    return (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
            [lp.token_id for lp in c.logprobs or ()])


def test_final_kind_returns_just_the_finished_parents_whole():
    every, every_aborts, every_progress = _kind_run("cumulative")
    final, final_aborts, progress = _kind_run("final")
    # per step: only parents that finished in it (the stop string ends "s" in step 2;
    # "p" only once both its completions are done, in step 3)
    assert [[o.request_id for o in outs] for outs in final] == [[], ["s"], ["p"]]
    assert final_aborts == every_aborts == ["s"]  # the stop string still aborts
    last = {o.request_id: o for outs in every for o in outs if o.finished}
    for outs in final:
        for out in outs:
            ref = last[out.request_id]
            assert out.finished and out.prompt == ref.prompt
            assert [_fields(c) for c in out.outputs] == [_fields(c) for c in ref.outputs]
    assert last["s"].outputs[0].text == "xx" and last["p"].outputs[1].text == "cef"
    # the tokens each step gave every "final" parent, for its metrics ("s": the step its
    # stop string matched keeps only the tokens up to the match: "ND" of "NDyy")
    assert progress == [{"p": 3, "s": 3}, {"p": 2, "s": 2}, {"p": 1}]
    assert every_progress == [{}, {}, {}]


def test_delta_kind_outputs_concatenate_to_the_cumulative_ones():
    every, every_aborts, _ = _kind_run("cumulative")
    delta, delta_aborts, _ = _kind_run("delta")
    assert delta_aborts == every_aborts
    assert [[o.request_id for o in outs] for outs in delta] == [
        [o.request_id for o in outs] for outs in every]
    joined: dict[tuple[str, int], list] = {}
    for d_outs, c_outs in zip(delta, every, strict=True):
        for d, c in zip(d_outs, c_outs, strict=True):
            assert d.finished == c.finished
            for dc, cc in zip(d.outputs, c.outputs, strict=True):
                # the cumulative fields hold the step's part, the same as the deltas
                assert (dc.text, dc.token_ids) == (cc.delta_text, cc.delta_token_ids)
                assert (dc.delta_text, dc.delta_token_ids) == (dc.text, dc.token_ids)
                assert (dc.finish_reason, dc.stop_reason) == (cc.finish_reason,
                                                              cc.stop_reason)
                text, ids, lps = joined.setdefault((d.request_id, dc.index), ["", [], []])
                joined[d.request_id, dc.index] = [text + dc.text, ids + dc.token_ids,
                                                  lps + list(dc.logprobs or ())]
    last = {o.request_id: o for outs in every for o in outs if o.finished}
    for (rid, index), (text, ids, lps) in joined.items():
        ref = last[rid].outputs[index]
        assert (text, ids, [lp.token_id for lp in lps]) == (
            ref.text, ref.token_ids, [lp.token_id for lp in ref.logprobs or ()])
    assert joined["p", 1][0] == "cef" and joined["s", 0][0] == "xx"


def test_an_unknown_output_kind_is_refused_by_name():
    proc = OutputProcessor(make_byte_tokenizer())
    with pytest.raises(ValueError, match=r"unknown output kind 'deltas'; known: cumulative, "
                                         r"delta, final"):
        proc.add_request(Request("r", [1], SamplingParams()), None, kind="deltas")
    assert not proc.has_unfinished()

"""Conformance suite for speculative-decoding proposers (:class:`lmkit.api.SpecProposer`).

The proposer is built as ``cls(config, options=...)`` with ``num_speculative_tokens``
k, and given batches of token histories: repetitive ones (where prompt-lookup
proposers find matches), random ones, very short ones and an empty batch.
Properties:

* ``valid drafts``: one draft list per request, at most ``k`` tokens each (for every k
  from 1 to 5), every id an ``int`` in ``[0, vocab_size)``; ``draft_probs``, when
  given, are ``[num_drafts, vocab]`` distributions giving their draft positive mass;
* ``deterministic``: the same batch gives the same drafts twice, and on a fresh
  instance;
* ``incremental updates``: histories growing over steps (``num_new_tokens`` set) give
  the drafts a fresh instance gives for the whole histories;
* ``inputs untouched``: ``propose`` does not modify the token lists it is given;
* ``remove_requests``: forgetting some requests, then proposing for the others and for
  new ones, works and stays deterministic;
* ``end to end``: with a model directory and the proposer installed as a plugin,
  greedy outputs of ``LLM`` with the proposer equal those without it (verification
  in the core makes every proposer lossless).

Use :func:`check_spec_proposer`, or subclass :class:`SpecProposerConformance` and
define a ``spec_proposer`` fixture returning the spec or class.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    NotApplicable,
    Target,
    resolve_target,
    run_checks,
    skip_if_not_applicable,
)

SUITE = "spec proposer"
VOCAB_SIZE = 1000


def batches(seed: int = 0) -> list[tuple[str, list[str], list[list[int]]]]:
    """(description, request ids, token histories) of the batches the suite proposes for."""
    rng = random.Random(seed)
    phrase = [rng.randrange(VOCAB_SIZE) for _ in range(7)]
    repetitive = [(phrase * 4)[: 20 + i] for i in range(3)]
    randoms = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(5, 60))] for _ in range(3)]
    return [
        ("three repetitive histories (a 7-token phrase repeated)", ["a", "b", "c"], repetitive),
        ("three random histories of 5-60 tokens", ["d", "e", "f"], randoms),
        ("one-token and two-token histories", ["g", "h"], [[5], [5, 5]]),
        ("mixed", ["a", "e", "g"], [repetitive[0], randoms[1], [5]]),
        ("an empty batch", [], []),
    ]


def _config(k: int) -> Any:
    from lmkit.config.schema import LMKitConfig

    return LMKitConfig.model_validate({"speculative": {"backend": "auto",
                                                       "num_speculative_tokens": k}})


def _build(t: Target, k: int, prop: str = "construction") -> Any:
    """The proposer built as ``cls(config, options=opts)`` with ``k`` draft tokens."""
    return t.build(SUITE, "speculative", prop, f"num_speculative_tokens {k}", _config(k),
                   options=t.options)


def _input(req_ids: list[str], tokens: list[list[int]], k: int,
           num_new_tokens: list[int] | None) -> Any:
    from dataclasses import fields

    from lmkit.api.spec_decode import ProposerInput

    if num_new_tokens is not None and "num_new_tokens" in {f.name for f in fields(ProposerInput)}:
        return ProposerInput(list(req_ids), tokens, k, num_new_tokens=num_new_tokens)
    return ProposerInput(list(req_ids), tokens, k)


def _propose(t: Target, prop: str, proposer: Any, k: int, desc: str, req_ids: list[str],
             tokens: list[list[int]], num_new_tokens: list[int] | None = None
             ) -> list[list[int]]:
    where = f"{desc}, k={k}"
    try:
        proposal = proposer.propose(_input(req_ids, tokens, k, num_new_tokens))
    except Exception as e:
        raise t.fail(SUITE, prop, where, f"propose() raised {type(e).__name__}: {e}") from e
    drafts = proposal.draft_token_ids
    if len(drafts) != len(req_ids):
        raise t.fail(SUITE, prop, where, f"{len(drafts)} draft lists for {len(req_ids)} requests")
    for rid, d in zip(req_ids, drafts, strict=True):
        if len(d) > k:
            raise t.fail(SUITE, prop, where, f"request {rid!r} got {len(d)} drafts, over k={k}")
        bad = [x for x in d if type(x) is not int or not 0 <= x < VOCAB_SIZE]
        if bad:
            raise t.fail(SUITE, prop, where, f"request {rid!r} got invalid token ids {bad[:4]} "
                         f"(ints in [0, {VOCAB_SIZE}) expected)")
    if proposal.draft_probs is not None:
        _check_probs(t, prop, where, req_ids, drafts, proposal.draft_probs)
    return [list(d) for d in drafts]


def _check_probs(t: Target, prop: str, where: str, req_ids: list[str], drafts: list[list[int]],
                 probs: list[Any]) -> None:
    if len(probs) != len(req_ids):
        raise t.fail(SUITE, prop, where, f"{len(probs)} draft_probs entries for {len(req_ids)} "
                     "requests")
    for rid, d, p in zip(req_ids, drafts, probs, strict=True):
        if p is None:
            continue
        if p.dim() != 2 or p.shape[0] != len(d):
            raise t.fail(SUITE, prop, where, f"request {rid!r}: draft_probs shape "
                         f"{tuple(p.shape)}; expected [{len(d)}, vocab]")
        rows = p.float().cpu()
        if bool((rows < 0).any()) or bool(((rows.sum(-1) - 1).abs() > 1e-3).any()):
            raise t.fail(SUITE, prop, where, f"request {rid!r}: draft_probs rows are not "
                         "probability distributions")
        for i, tok in enumerate(d):
            if tok >= rows.shape[1] or float(rows[i, tok]) <= 0:
                raise t.fail(SUITE, prop, where, f"request {rid!r}: draft {i} (token {tok}) "
                             "has no probability mass in its draft distribution")


def valid_drafts(t: Target) -> None:
    for k in range(1, 6):
        proposer = _build(t, k)
        for desc, req_ids, tokens in batches():
            _propose(t, "valid drafts", proposer, k, desc, req_ids, tokens)


def deterministic(t: Target) -> None:
    k = 4
    first, again = _build(t, k), _build(t, k)
    for desc, req_ids, tokens in batches():
        a = _propose(t, "deterministic", first, k, desc, req_ids, tokens)
        b = _propose(t, "deterministic", first, k, desc, req_ids, tokens)
        c = _propose(t, "deterministic", again, k, desc, req_ids, tokens)
        if not a == b == c:
            raise t.fail(SUITE, "deterministic", f"{desc}, k={k}",
                         f"drafts differ between calls: {a}, then {b}, fresh instance {c}")


def incremental(t: Target) -> None:
    """Histories that grow step by step (with ``num_new_tokens``) give the drafts a
    fresh instance gives for the whole histories."""
    k, rng = 3, random.Random(5)
    proposer = _build(t, k)
    _, req_ids, histories = batches()[3]
    grown = [list(h[:3]) for h in histories]
    seen = [0] * len(grown)
    for step in range(12):
        for h, full in zip(grown, histories, strict=True):
            h.extend(full[len(h):len(h) + rng.randint(1, 3)] or [rng.randrange(VOCAB_SIZE)])
        new = [len(h) - n for h, n in zip(grown, seen, strict=True)]
        seen = [len(h) for h in grown]
        desc = f"step {step + 1} of growing histories (new tokens {new})"
        got = _propose(t, "incremental updates", proposer, k, desc, req_ids, grown, new)
        want = _propose(t, "incremental updates", _build(t, k), k, desc, req_ids, grown)
        if got != want:
            raise t.fail(SUITE, "incremental updates", f"{desc}, k={k}",
                         f"drafts {got} after incremental updates; a fresh instance given the "
                         f"whole histories drafts {want}")


def inputs_untouched(t: Target) -> None:
    proposer = _build(t, 3)
    for desc, req_ids, tokens in batches():
        before = copy.deepcopy(tokens)
        _propose(t, "inputs untouched", proposer, 3, desc, req_ids, tokens)
        if tokens != before:
            raise t.fail(SUITE, "inputs untouched", desc, "propose() modified the token lists")


def remove_requests(t: Target) -> None:
    k = 3
    proposer, fresh = _build(t, k), _build(t, k)
    (desc1, ids1, tok1), (desc2, ids2, tok2) = batches()[0], batches()[1]
    _propose(t, "remove_requests", proposer, k, desc1, ids1, tok1)
    _propose(t, "remove_requests", proposer, k, desc2, ids2, tok2)
    try:
        proposer.remove_requests({ids1[0], ids2[1], "never-seen"})
    except Exception as e:
        raise t.fail(SUITE, "remove_requests", f"remove {ids1[0]!r}, {ids2[1]!r}, an unknown id",
                     f"remove_requests raised {type(e).__name__}: {e}") from e
    ids, toks = [ids1[1], "new", ids2[0]], [tok1[1], tok2[2], tok2[0]]
    got = _propose(t, "remove_requests", proposer, k, "after remove_requests", ids, toks)
    want = _propose(t, "remove_requests", fresh, k, "a fresh instance", ids, toks)
    if got != want:
        raise t.fail(SUITE, "remove_requests", "the same batch after remove_requests",
                     f"drafts {got} differ from a fresh instance's {want}")


def greedy_with_and_without(t: Target, suite: str, model_dir: str | Path,
                            **speculative: Any) -> dict[str, float]:
    """Run ``LLM`` greedily over a few prompts without and then with the registered
    proposer ``t.spec`` (``speculative`` adds settings, e.g. ``speculative_model``);
    fail on the first prompt whose outputs differ, else return the speculating engine's
    stats.

    :raises NotApplicable: ``t`` is a class, or its name is not registered.
    """
    if t.spec is None:
        raise NotApplicable("a class was given: the engine selects proposers by registered name")
    from lmkit import LLM, SamplingParams
    from lmkit.plugin_host.manager import PluginHost

    names = PluginHost.load().registry.names("speculative")
    if t.spec.name not in names:
        raise NotApplicable(f"{t.spec.name!r} is not registered by an installed plugin "
                            f"(registered: {', '.join(names) or 'none'})")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["abcabcabcabcabc", "the cat sat on the mat, the cat sat on", "x", "0123456789"]
    common: dict[str, Any] = dict(device="cpu", dtype="float32", max_model_len=256,
                                  num_blocks=128, block_size=4)
    with LLM(str(model_dir), **common) as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(str(model_dir), speculative=t.spec.name, num_speculative_tokens=3,
             **speculative, **common) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
    for prompt, a, b in zip(prompts, base, got, strict=True):
        if a != b:
            raise t.fail(suite, "end to end", f"greedy, prompt {prompt!r}, k=3",
                         f"with the proposer: {b}; without: {a}")
    return stats


def end_to_end(t: Target, model_dir: str | Path | None) -> None:
    """Greedy outputs of ``LLM`` with the proposer equal those without it."""
    if model_dir is None:
        raise NotApplicable("no model_dir given")
    stats = greedy_with_and_without(t, SUITE, model_dir)
    drafts = sum(v for k, v in stats.items() if "draft" in k and isinstance(v, (int, float)))
    if not drafts:
        raise NotApplicable("the engine reported no draft tokens for these prompts (no "
                            "'*draft*' counter in engine stats, or zero): nothing was verified")


def _checks(t: Target, model_dir: str | Path | None) -> dict[str, Callable[[], None]]:
    return {CONSTRUCTOR_PROPERTY: lambda: _build(t, 3, CONSTRUCTOR_PROPERTY),
            "valid drafts": lambda: valid_drafts(t), "deterministic": lambda: deterministic(t),
            "inputs untouched": lambda: inputs_untouched(t),
            "incremental updates": lambda: incremental(t),
            "remove_requests": lambda: remove_requests(t),
            "end to end": lambda: end_to_end(t, model_dir)}


def check_spec_proposer(proposer: Any, options: Any = None, model_dir: str | Path | None = None,
                        only: Iterable[str] | None = None) -> dict[str, str]:
    """Run every proposer property against ``proposer`` (a Spec, Registration or
    SpecProposer subclass). ``model_dir`` enables the end-to-end property.

    :raises ConformanceFailure: naming the first failing property and its batch.
    :raises TypeError: ``proposer`` is runner-hosted (a draft head): use
        :func:`lmkit.testing.runner_proposer.check_runner_proposer`.
    """
    from lmkit.api.spec_decode import RunnerProposer

    t = resolve_target(proposer, options)
    if isinstance(t.cls, type) and issubclass(t.cls, RunnerProposer):
        raise TypeError(f"{t.name} is a runner-hosted proposer (lmkit.api.RunnerProposer); "
                        "check it with lmkit.testing.runner_proposer.check_runner_proposer")
    return run_checks(_checks(t, model_dir), set(only) if only is not None else None)


class SpecProposerConformance:
    """pytest base class: one test per proposer property. Define a ``spec_proposer``
    fixture returning the spec or class; set ``model_dir`` (a path) to run the
    end-to-end property."""

    model_dir: str | Path | None = None

    def _check(self, spec_proposer: Any, prop: str) -> None:
        skip_if_not_applicable(_checks(resolve_target(spec_proposer), self.model_dir)[prop])

    def test_constructor_signature(self, spec_proposer: Any) -> None:
        self._check(spec_proposer, CONSTRUCTOR_PROPERTY)

    def test_valid_drafts(self, spec_proposer: Any) -> None:
        self._check(spec_proposer, "valid drafts")

    def test_deterministic(self, spec_proposer: Any) -> None:
        self._check(spec_proposer, "deterministic")

    def test_incremental_updates(self, spec_proposer: Any) -> None:
        self._check(spec_proposer, "incremental updates")

    def test_inputs_untouched(self, spec_proposer: Any) -> None:
        self._check(spec_proposer, "inputs untouched")

    def test_remove_requests(self, spec_proposer: Any) -> None:
        self._check(spec_proposer, "remove_requests")

    def test_end_to_end(self, spec_proposer: Any) -> None:
        self._check(spec_proposer, "end to end")

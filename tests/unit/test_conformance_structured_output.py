"""The structured-output conformance suite against a small pure-Python choice backend:
the correct one passes; versions with a wrong bitmask, a no-op rollback or a partial
multi-token accept fail, naming the constraint and the text so far."""

from __future__ import annotations

import pytest
import torch
from lmkit.api import Caps, Grammar, InvalidRequestError, Spec, StructuredOutputBackend
from lmkit.testing import ConformanceFailure
from lmkit.testing.structured_output import check_structured_output_backend


class ChoiceGrammar(Grammar):
    """Byte-level matching of one of several strings (token id = byte, EOS last)."""

    def __init__(self, choices: list[bytes], eos: int) -> None:
        self.choices, self.eos = choices, eos
        self.tokens: list[int] = []

    def _prefix(self) -> bytes:
        return bytes(t for t in self.tokens if t != self.eos)

    def allowed(self) -> set[int]:
        if self.is_terminated():
            return {self.eos}
        p = self._prefix()
        out = {c[len(p)] for c in self.choices if c.startswith(p) and len(c) > len(p)}
        return out | ({self.eos} if p in self.choices else set())

    def accept_tokens(self, token_ids):
        saved = list(self.tokens)
        for tok in token_ids:
            if tok not in self.allowed():
                self.tokens = saved
                return False
            self.tokens.append(tok)
        return True

    def rollback(self, num_tokens):
        del self.tokens[len(self.tokens) - num_tokens:]

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for tok in self.allowed():
            word, bit = divmod(tok, 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def is_terminated(self):
        return bool(self.tokens) and self.tokens[-1] == self.eos


class ChoiceBackend(StructuredOutputBackend):
    grammar_cls = ChoiceGrammar

    def __init__(self, tokenizer, vocab_size, options=None):
        self.eos = tokenizer.eos_token_id

    def compile(self, kind, spec):
        if kind != "choice":
            raise InvalidRequestError(f"unsupported constraint {kind!r}")
        return self.grammar_cls([c.encode() for c in spec], self.eos)


class AlwaysAllowsEOS(ChoiceGrammar):
    def allowed(self):
        return super().allowed() | {self.eos}


class NoRollback(ChoiceGrammar):
    def rollback(self, num_tokens):
        pass


class PartialAccept(ChoiceGrammar):
    def accept_tokens(self, token_ids):
        for tok in token_ids:
            if tok not in self.allowed():
                return False  # keeps the tokens accepted before the bad one
            self.tokens.append(tok)
        return True


def spec(grammar_cls) -> Spec:
    backend = type(f"{grammar_cls.__name__}Backend", (ChoiceBackend,),
                   {"grammar_cls": grammar_cls})
    return Spec(name=grammar_cls.__name__, target=lambda: backend, caps=Caps({"choice"}))


def test_a_correct_choice_backend_passes():
    results = check_structured_output_backend(spec(ChoiceGrammar))
    assert results == {
        "constructor signature": "passed",
        "bitmask, accept, rollback and termination per state": "passed",
        "language": "passed",
        "multi-token accept and rollback": "passed",
        "invalid constraints": "not applicable: ChoiceGrammar claims neither regex nor "
                               "json_schema",
        "shared compilation and batch filling": "passed",
    }


@pytest.mark.parametrize(("grammar_cls", "message"), [
    (AlwaysAllowsEOS, "after ''\n  EOS is allowed but '' is not a complete match"),
    (NoRollback, "accept_tokens([109]) then rollback(1) did not restore"),
])
def test_broken_grammars_fail_per_state(grammar_cls, message):
    with pytest.raises(ConformanceFailure) as exc:
        check_structured_output_backend(spec(grammar_cls))
    assert "fails property 'bitmask, accept, rollback and termination per state'" in str(exc.value)
    assert 'choice constraint ["yes", "no", "maybe"]' in str(exc.value)
    assert message in str(exc.value)


def test_a_partial_multi_token_accept_fails():
    with pytest.raises(ConformanceFailure, match="refused multi-token accept_tokens changed"):
        check_structured_output_backend(spec(PartialAccept),
                                        only=["multi-token accept and rollback"])


def test_bitmask_helper_sets_sign_bits_correctly():
    g = ChoiceGrammar([bytes([31, 63])], eos=256)
    mask = torch.zeros(1, 10, dtype=torch.int32)
    g.fill_bitmask(mask, 0)
    assert int(mask[0, 0]) == -(1 << 31)


class SharedStateBackend(ChoiceBackend):
    """Hands every request the same grammar object: requests would share their state."""

    def compile_shared(self, kind, spec):
        return self.compile(kind, spec)

    def new_grammar(self, shared):
        return shared


def test_grammars_sharing_state_fail_the_shared_compilation_property():
    broken = Spec(name="shared-state", target=lambda: SharedStateBackend, caps=Caps({"choice"}))
    with pytest.raises(ConformanceFailure, match="must not share state"):
        check_structured_output_backend(broken, only=["shared compilation and batch filling"])

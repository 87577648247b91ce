"""Built-in speculative-decoding proposers: ``ngram`` (prompt lookup), ``eagle`` and
``eagle3`` (EAGLE-1/2 and EAGLE-3 draft heads, run in the model runner: ``--speculative
eagle --speculative-model DIR``).

Speculation is off unless named: ``--speculative ngram --num-speculative-tokens K``, or in a config file
``speculative: {backend: ngram, num_speculative_tokens: 4, options: {prompt_lookup_max: 4,
prompt_lookup_min: 3}}``.
"""

from typing import Literal

from lmkit.api import Caps, Needs, Spec, hookimpl
from pydantic import BaseModel, ConfigDict, Field, model_validator

LMKIT_PLUGIN_API = ">=1.0,<2"


class NgramOptions(BaseModel):
    """Options of the ``ngram`` proposer."""

    model_config = ConfigDict(extra="forbid")

    prompt_lookup_max: int = Field(
        4, ge=1, le=64, description="Longest suffix (in tokens) looked up in the request's "
        "prompt and output; tried first.")
    prompt_lookup_min: int = Field(
        3, ge=1, le=64, description="Shortest suffix looked up; shorter matches propose "
        "nothing (1-2 token matches are mostly chance in open-ended text).")

    @model_validator(mode="after")
    def _ordered(self) -> "NgramOptions":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        return self


class EagleOptions(BaseModel):
    """Options of the ``eagle`` and ``eagle3`` proposers."""

    model_config = ConfigDict(extra="forbid")

    draft_sampling: Literal["auto", "greedy"] = Field(
        "auto", description="How the head drafts for requests with temperature > 0: "
        "'auto' samples each draft from the head's distribution after the request's "
        "temperature, min-p, top-k and top-p, and verifies it against that distribution "
        "(more drafts accepted); 'greedy' drafts the head's argmax for every request. "
        "Greedy requests always get argmax drafts; outputs follow the target either way.")


@hookimpl
def register_spec_proposers(register):
    register(Spec(
        name="ngram", target="lmkit_plugins.spec.ngram:NgramProposer", priority=10,
        options=NgramOptions,
        caps=Caps(values={"max_k": set(range(1, 65))}),
        stack_needs={"attention": Needs({"multi_token_query"})},
        description="Prompt lookup: drafts what followed the latest earlier match of the "
                    "last n tokens (CPU, no draft model).",
    ))
    register(Spec(
        name="eagle", target="lmkit_plugins.spec.eagle:EagleProposer", priority=5,
        options=EagleOptions,
        caps=Caps(features={"hidden_states", "own_kv_cache"},
                  values={"max_k": set(range(1, 65))}),
        stack_needs={"attention": Needs({"multi_token_query"})},
        description="EAGLE-1/2 draft head (speculative.model): drafts on the device in the "
                    "model runner from the target's hidden states.",
    ))
    register(Spec(
        name="eagle3", target="lmkit_plugins.spec.eagle3:Eagle3Proposer", priority=5,
        options=EagleOptions,
        caps=Caps(features={"hidden_states", "own_kv_cache"},
                  values={"max_k": set(range(1, 65))}),
        stack_needs={"attention": Needs({"multi_token_query"})},
        description="EAGLE-3 draft head (speculative.model): fuses three target layers, "
                    "drafts over its own vocabulary (d2t) in the model runner.",
    ))


_DRAFT_HEADS = ("eagle", "eagle3")


@hookimpl
def configure(config):
    # a draft-head proposer named without a usable head directory is refused here, so
    # that `lmkit config check` and `lmkit serve` (before binding) say the same thing
    name = config.speculative.backend.lower()
    if name in _DRAFT_HEADS:
        from lmkit_plugins.spec.head_checkpoint import HeadCheckpoint

        HeadCheckpoint(config, name)


@hookimpl
def register_commands(app):
    from lmkit_plugins.spec.cli import register

    register(app)

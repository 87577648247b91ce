"""The extension points ("kinds") and the hook that registers each.

One name per extension point, used everywhere: the kind in the registry and in
``lmkit plugins list``, the config section (``speculative:``), the ``LLM(...)`` keyword
(``LLM(speculative="ngram")``), the CLI flag (``--speculative``) and the scaffold kind
(``lmkit plugin new --kind speculative``). Old spellings are accepted, with a
deprecation message, only where users already have them (:data:`KIND_ALIASES` here, the
CLI's and the scaffold's own).
"""

from __future__ import annotations

import warnings
from typing import Literal

Kind = Literal[
    "scheduler",
    "attention",
    "executor",
    "speculative",
    "structured_output",
    "offload",
    "quantization",
    "model",
    "model_source",
    "logits_processor",
    "pooler",
]

# kind -> the register-callback hook that contributes specs of that kind
REGISTER_HOOKS: dict[str, str] = {
    "scheduler": "register_schedulers",
    "attention": "register_attention_backends",
    "executor": "register_executors",
    "speculative": "register_spec_proposers",
    "structured_output": "register_structured_output_backends",
    "offload": "register_offload_managers",
    "quantization": "register_quantization_methods",
    "model": "register_models",
    "model_source": "register_model_sources",
    "logits_processor": "register_logits_processors",
    "pooler": "register_poolers",
}

KINDS: tuple[str, ...] = tuple(REGISTER_HOOKS)

# The kinds that make up an engine's stack; each is selected by the config section of
# the same name.
STACK_KINDS: tuple[str, ...] = (
    "executor", "attention", "scheduler", "speculative", "structured_output", "offload",
    "quantization")

# Kinds that may be switched off entirely with ``backend: none``.
OPTIONAL_KINDS = frozenset({"speculative", "structured_output", "offload", "quantization"})

# Old kind names -> the current ones; still accepted wherever a kind is named.
KIND_ALIASES: dict[str, str] = {"spec_proposer": "speculative"}


def canonical_kind(kind: str) -> str:
    """``kind`` under its current name: an old name from :data:`KIND_ALIASES` is
    translated with a :class:`DeprecationWarning`; any other name is returned as is."""
    new = KIND_ALIASES.get(kind)
    if new is None:
        return kind
    warnings.warn(f"the plugin kind {kind!r} is now called {new!r}; use {new!r}",
                  DeprecationWarning, stacklevel=3)
    return new


def kind_label(kind: str) -> str:
    """A kind in prose, for messages: ``speculative proposer``, ``structured output``."""
    return "speculative proposer" if kind == "speculative" else kind.replace("_", " ")

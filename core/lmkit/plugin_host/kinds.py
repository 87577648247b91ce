"""The extension points ("kinds") and the hook that registers each."""

from __future__ import annotations

# kind -> the register-callback hook that contributes specs of that kind
REGISTER_HOOKS: dict[str, str] = {
    "scheduler": "register_schedulers",
    "attention": "register_attention_backends",
    "executor": "register_executors",
    "spec_proposer": "register_spec_proposers",
    "structured_output": "register_structured_output_backends",
    "offload": "register_offload_managers",
    "model": "register_models",
    "model_source": "register_model_sources",
}

KINDS: tuple[str, ...] = tuple(REGISTER_HOOKS)

# The kinds that make up an engine's stack, in resolution order; the config section
# that selects each.
STACK_KINDS: dict[str, str] = {
    "executor": "executor",
    "attention": "attention",
    "scheduler": "scheduler",
    "spec_proposer": "speculative",
    "structured_output": "structured_output",
    "offload": "offload",
}

# Kinds that may be switched off entirely with ``backend: none``.
OPTIONAL_KINDS = frozenset({"spec_proposer", "structured_output", "offload"})

"""What the scaffold generates for each kind of plugin."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScaffoldKind:
    """One ``--kind`` of ``lmkit plugin new``.

    ``registry_kind`` and ``hook`` are the extension point and its register hook;
    ``impl_module`` / ``class_suffix`` name the generated implementation; ``summary``
    is the one-line description the generated spec carries.
    """

    name: str
    registry_kind: str
    hook: str
    impl_module: str
    class_suffix: str
    summary: str


SCAFFOLD_KINDS: dict[str, ScaffoldKind] = {k.name: k for k in (
    ScaffoldKind("attention", "attention", "register_attention_backends", "backend",
                 "Attention", "Paged attention in plain torch, one request at a time."),
    ScaffoldKind("scheduler", "scheduler", "register_schedulers", "scheduler", "Scheduler",
                 "Shortest prompt first, with aging so that long prompts never starve."),
    ScaffoldKind("proposer", "spec_proposer", "register_spec_proposers", "proposer",
                 "Proposer", "Prompt lookup: drafts what followed the last n-gram before."),
    ScaffoldKind("grammar", "structured_output", "register_structured_output_backends",
                 "backend", "Backend", "Choice constraints matched over decoded tokens."),
    ScaffoldKind("offload", "offload", "register_offload_managers", "tier", "Tier",
                 "An in-memory LRU tier with per-block checksums."),
    ScaffoldKind("executor", "executor", "register_executors", "executor", "Executor",
                 "One model runner in the engine-core process."),
)}

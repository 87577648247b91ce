"""What the scaffold generates for each kind of plugin."""

from __future__ import annotations

from dataclasses import dataclass

from lmkit.plugin_host.kinds import REGISTER_HOOKS


@dataclass(frozen=True)
class ScaffoldKind:
    """One ``--kind`` of ``lmkit plugin new``.

    ``name`` is the extension point, spelled as everywhere else (``lmkit plugins list``,
    the config section); ``impl_module`` / ``class_suffix`` name the generated
    implementation; ``summary`` is the one-line description the generated spec carries.
    """

    name: str
    impl_module: str
    class_suffix: str
    summary: str

    @property
    def hook(self) -> str:
        """The hook that registers specs of this kind."""
        return REGISTER_HOOKS[self.name]

    @property
    def label(self) -> str:
        """The kind in prose: ``structured output``."""
        return self.name.replace("_", " ")


SCAFFOLD_KINDS: dict[str, ScaffoldKind] = {k.name: k for k in (
    ScaffoldKind("attention", "backend", "Attention",
                 "Paged attention in plain torch, one request at a time."),
    ScaffoldKind("scheduler", "scheduler", "Scheduler",
                 "Shortest prompt first, with aging so that long prompts never starve."),
    ScaffoldKind("speculative", "proposer", "Proposer",
                 "Prompt lookup: drafts what followed the last n-gram before."),
    ScaffoldKind("structured_output", "backend", "Backend",
                 "Choice constraints matched over decoded tokens."),
    ScaffoldKind("offload", "tier", "Tier", "An in-memory LRU tier with per-block checksums."),
    ScaffoldKind("executor", "executor", "Executor", "One model runner in the engine-core process."),
    ScaffoldKind("quantization", "method", "Method",
                 "Linear weights kept as int8 rows with a float32 scale each."),
)}

# The scaffold's old kind names -> the current ones (accepted with a deprecation message).
SCAFFOLD_ALIASES: dict[str, str] = {"proposer": "speculative", "grammar": "structured_output"}

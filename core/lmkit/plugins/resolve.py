"""Resolving the whole stack (scheduler, attention, executor, proposer, grammar backend,
offload tier) for a config and cross-checking it, before any weights load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from lmkit.config.errors import format_validation_error
from lmkit.errors import ConfigError, StackConflictError
from lmkit.platform import cuda_device_count
from lmkit.plugins.kinds import OPTIONAL_KINDS, STACK_KINDS
from lmkit.plugins.registry import Registration
from lmkit.plugins.spec import Needs

if TYPE_CHECKING:
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugins.manager import PluginHost

# Order of resolution: kinds that impose needs on others come first.
_ORDER = ("spec_proposer", "structured_output", "offload", "scheduler", "executor", "attention")


@dataclass
class ResolvedStack:
    """The chosen implementation of every stack kind (``None`` for a feature left off)."""

    device: str
    dtype: str
    entries: dict[str, Registration | None] = field(default_factory=dict)
    options: dict[str, BaseModel | None] = field(default_factory=dict)

    def get(self, kind: str) -> Registration | None:
        return self.entries.get(kind)

    def names(self) -> dict[str, str | None]:
        """Chosen names by kind: what is sent to workers in other processes."""
        return {k: (r.name if r else None) for k, r in self.entries.items()}

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(kind, name, plugin, version) per kind, for display."""
        return [
            (k, r.name if r else "none", r.plugin if r else "-", (r.version or "-") if r else "-")
            for k, r in self.entries.items()
        ]

    def as_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "stack": {
                k: None if r is None else {
                    "name": r.name, "plugin": r.plugin, "dist": r.dist, "version": r.version,
                    "options": self.options[k].model_dump() if self.options.get(k) else {},
                }
                for k, r in self.entries.items()
            },
        }


def resolve_device(config: LMKitConfig) -> tuple[str, str]:
    """The device and dtype ``auto`` settings stand for on this machine."""
    device = config.executor.device
    if device == "auto":
        device = "cuda" if cuda_device_count() > 0 else "cpu"
    dtype = config.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def resolve_stack(config: LMKitConfig, host: PluginHost, model_needs: Needs | None = None
                  ) -> ResolvedStack:
    """Choose and cross-check every stack kind for ``config``.

    ``model_needs`` adds what the model requires of attention (e.g. ``head_size``), when
    its config is known. Raises :class:`ConfigError` subclasses with every reason.
    """
    device, dtype = resolve_device(config)
    base = {
        "executor": Needs(values={"device": device}),
        "attention": Needs(values={"device": device, "dtype": dtype}).merge(model_needs or Needs()),
        "offload": Needs(values={"device": device}),
    }
    stack = ResolvedStack(device=device, dtype=dtype)
    imposed: dict[str, Needs] = {}
    for kind in _ORDER:
        section = getattr(config, STACK_KINDS[kind])
        choice = section.backend
        if kind in OPTIONAL_KINDS and choice == "none":
            stack.entries[kind], stack.options[kind] = None, None
            continue
        needs = base.get(kind, Needs()).merge(imposed.get(kind, Needs()))
        if kind in OPTIONAL_KINDS and choice == "auto" and not host.registry.all(kind):
            stack.entries[kind], stack.options[kind] = None, None
            continue
        reg = host.select(kind, choice, needs)
        stack.entries[kind] = reg
        for other, n in reg.spec.stack_needs.items():
            imposed[other] = imposed.get(other, Needs()).merge(n)
        try:
            stack.options[kind] = reg.spec.validate_options(section.options)
        except ValidationError as e:
            prefix = f"{STACK_KINDS[kind]}.options"
            raise ConfigError(
                f"invalid options for {kind.replace('_', ' ')} {reg.name!r} (plugin {reg.origin}):\n"
                + format_validation_error(e, prefix, reg.spec.options)
            ) from e
    stack.entries = {k: stack.entries[k] for k in STACK_KINDS}
    stack.options = {k: stack.options[k] for k in STACK_KINDS}
    check_stack(stack)
    return stack


def check_stack(stack: ResolvedStack) -> None:
    """Raise StackConflictError if any chosen spec needs what another chosen one lacks."""
    problems = []
    for kind, reg in stack.entries.items():
        if reg is None:
            continue
        for other, needs in reg.spec.stack_needs.items():
            target = stack.entries.get(other)
            if target is None:
                if other not in OPTIONAL_KINDS:
                    problems.append(f"{kind} {reg.name!r} needs a {other} backend, but none is chosen")
                continue
            for reason in target.spec.caps.why_not(needs):
                problems.append(
                    f"{kind} {reg.name!r} (plugin {reg.plugin}) needs {other} with "
                    f"{needs.describe()}, but {other} {target.name!r} (plugin {target.plugin}) "
                    f"{reason}"
                )
    if problems:
        raise StackConflictError(
            "the chosen backends do not work together:\n  - " + "\n  - ".join(problems)
            + "\nChoose compatible backends, or leave one on 'auto'."
        )

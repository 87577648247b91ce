"""What a plugin registers: a frozen :class:`Spec` per implementation, with declared
capabilities (:class:`Caps`) that selection checks against :class:`Needs`."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict

from lmkit.platform import cuda_device_count


class NoOptions(BaseModel):
    """The options model of a spec that takes no options."""

    model_config = ConfigDict(extra="forbid")


def _frozen_map(m: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True, slots=True)
class Needs:
    """What a configuration (or another chosen backend) requires of an implementation.

    ``features`` are boolean abilities (``"multi_token_query"``, ``"cuda_graphs"``);
    ``values`` are single values that must be among what the implementation supports
    (``{"device": "cuda", "dtype": "bfloat16", "head_size": 128}``).
    """

    features: frozenset[str] = frozenset()
    values: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", frozenset(self.features))
        object.__setattr__(self, "values", _frozen_map(self.values))

    def __reduce__(self) -> tuple[type[Needs], tuple[frozenset[str], dict[str, Any]]]:
        # picklable (ModelFacts carries Needs to executor workers in other processes)
        return (Needs, (self.features, dict(self.values)))

    def merge(self, other: Needs) -> Needs:
        """Both sets of needs at once; ``other`` wins on a conflicting value."""
        return Needs(self.features | other.features, {**self.values, **other.values})

    def describe(self) -> str:
        parts = sorted(self.features) + [f"{k}={v}" for k, v in sorted(self.values.items())]
        return ", ".join(parts) or "nothing"


@dataclass(frozen=True, slots=True)
class Caps:
    """Capabilities an implementation declares, checked without importing it.

    ``features`` lists the boolean abilities it has; ``values`` maps a dimension to the
    set of values it supports. A dimension absent from ``values`` means "any value".
    """

    features: frozenset[str] = frozenset()
    values: Mapping[str, frozenset[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", frozenset(self.features))
        object.__setattr__(
            self, "values", _frozen_map({k: frozenset(v) for k, v in (self.values or {}).items()})
        )

    def why_not(self, needs: Needs) -> list[str]:
        """Reasons this implementation cannot serve ``needs``; empty when it can.

        Pure: no imports, no device queries.
        """
        reasons = [f"does not support {f}" for f in sorted(needs.features - self.features)]
        for key, wanted in sorted(needs.values.items()):
            supported = self.values.get(key)
            if supported is not None and wanted not in supported:
                options = ", ".join(sorted(map(str, supported)))
                reasons.append(f"{key} {wanted} not supported (supports: {options})")
        return reasons


@dataclass(frozen=True, slots=True)
class Spec:
    """One registered implementation of an extension point.

    Args:
        name: the name users select it by (``--attn NAME``); lowercase, unique per kind.
        target: ``"package.module:attr"`` imported lazily by :meth:`load`, or a
            zero-argument callable returning the implementation. Registering a spec
            must never import heavy libraries; ``load()`` is where that happens.
        caps: declared capabilities, checked against what the config needs.
        requires: import names that must be importable (checked with
            ``importlib.util.find_spec``; nothing is imported).
        needs_cuda: the implementation needs a CUDA device.
        priority: higher wins under ``auto`` among candidates with no reasons against them.
        options: a pydantic model (``extra="forbid"``) validating the user's
            ``options:`` for this implementation.
        stack_needs: what this implementation needs of the *other* chosen backends,
            by kind: e.g. ``{"attention": Needs({"multi_token_query"})}``.
        aliases: other names it answers to (model architectures use this).
        description: one line for ``lmkit plugins list``.
    """

    name: str
    target: str | Callable[[], Any]
    caps: Caps = field(default_factory=Caps)
    requires: tuple[str, ...] = ()
    needs_cuda: bool = False
    priority: int = 0
    options: type[BaseModel] = NoOptions
    stack_needs: Mapping[str, Needs] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Spec.name must be a non-empty string, got {self.name!r}")
        if isinstance(self.target, str) and ":" not in self.target:
            raise TypeError(
                f"Spec {self.name!r}: target must be 'module:attr' or a callable, got {self.target!r}"
            )
        if not (isinstance(self.options, type) and issubclass(self.options, BaseModel)):
            raise TypeError(f"Spec {self.name!r}: options must be a pydantic model class")
        object.__setattr__(self, "requires", tuple(self.requires))
        object.__setattr__(self, "aliases", tuple(self.aliases))
        object.__setattr__(self, "stack_needs", _frozen_map(self.stack_needs))

    def load(self) -> Any:
        """Import and return the implementation (the heavy import happens here)."""
        if callable(self.target):
            return self.target()
        module_name, _, attr = self.target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    def unavailable_reasons(self) -> list[str]:
        """Why this implementation cannot run on this machine at all (cheap checks)."""
        reasons = []
        for mod in self.requires:
            try:
                found = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                reasons.append(f"missing module {mod!r}")
        if self.needs_cuda and cuda_device_count() == 0:
            reasons.append("no CUDA device")
        return reasons

    def why_not(self, needs: Needs) -> list[str]:
        """Every reason this implementation cannot serve ``needs`` here."""
        return self.unavailable_reasons() + self.caps.why_not(needs)

    def validate_options(self, options: Mapping[str, Any] | BaseModel | None) -> BaseModel:
        """Validate user options against :attr:`options` (raises pydantic's ValidationError)."""
        if isinstance(options, self.options):
            return options
        if isinstance(options, BaseModel):
            options = options.model_dump()
        return self.options.model_validate(dict(options or {}))

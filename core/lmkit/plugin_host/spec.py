"""What a plugin registers: a frozen :class:`Spec` per implementation, with declared
capabilities (:class:`Caps`) that selection checks against :class:`Needs`."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from lmkit.platform import cuda_compute_capability, cuda_device_count
from lmkit.plugin_host.kinds import KIND_ALIASES, KINDS, canonical_kind


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


def module_present(name: str) -> bool:
    """Whether module ``name`` can be imported, without importing it or its parents.

    ``importlib.util.find_spec("a.b")`` imports package ``a``, which may be heavy (a
    CUDA library's ``__init__``); this walks the package path with the path finder
    instead, so ``lmkit plugins list`` stays cheap.
    """
    head, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(head)
        for i in range(len(rest)):
            if spec is None or spec.submodule_search_locations is None:
                return False
            spec = importlib.machinery.PathFinder.find_spec(
                ".".join([head, *rest[: i + 1]]), list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return False
    return spec is not None


NO_CUDA = "no CUDA device"


def _missing_modules(names: tuple[str, ...]) -> list[str]:
    return [f"missing module {m!r}" for m in names if not module_present(m)]


@dataclass(frozen=True, slots=True)
class Variant:
    """One of several interchangeable ways a spec can run, e.g. the generations of a
    library (FlashAttention 4, 3 or 2), in order of preference: the first one whose
    modules are importable and whose device fits is the one that runs.

    Args:
        name: short name (``"fa4"``), unique within the spec.
        requires: import names that must be importable (checked without importing).
        compute_capability: CUDA compute-capability majors it runs on (``{9, 10}``);
            empty: no CUDA requirement of its own.
        description: one line for ``lmkit plugins list`` (``"FlashAttention-4 ..."``).
    """

    name: str
    requires: tuple[str, ...] = ()
    compute_capability: frozenset[int] = frozenset()
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "requires", tuple(self.requires))
        object.__setattr__(self, "compute_capability", frozenset(self.compute_capability))

    def unavailable_reasons(self, capability: tuple[int, int] | None = None) -> list[str]:
        """Why this variant cannot run here: missing modules, no CUDA device, or a device
        of another compute capability. ``capability`` is the device's ``(major,
        minor)``; by default that of CUDA device 0, asked of the driver."""
        reasons = _missing_modules(self.requires)
        if self.compute_capability:
            cc = capability if capability is not None else cuda_compute_capability(0)
            majors = sorted(self.compute_capability)
            wanted = (f"{majors[0]}.x to {majors[-1]}.x"
                      if len(majors) > 2 and majors[-1] - majors[0] == len(majors) - 1
                      else " or ".join(f"{m}.x" for m in majors))
            if cc is None:
                reasons.append(NO_CUDA)
            elif cc[0] not in self.compute_capability:
                reasons.append(f"compute capability {cc[0]}.{cc[1]} (needs {wanted})")
        return reasons


def _names(spec_name: str, field_name: str, value: Any) -> None:
    """A tuple field of names (``requires``, ``aliases``): a list or tuple of non-empty
    strings; a bare string would be read as its characters."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)) or not all(
            isinstance(v, str) and v for v in value):
        raise TypeError(f"Spec {spec_name!r}: {field_name} must be a tuple of non-empty "
                        f"strings, e.g. ({value!r},), got {value!r}")


def _check_fields(spec: Spec) -> None:
    """Raise TypeError naming the first field of ``spec`` of the wrong type."""
    name = spec.name
    if not isinstance(spec.priority, int) or isinstance(spec.priority, bool):
        raise TypeError(f"Spec {name!r}: priority must be an int, got {spec.priority!r}")
    if not isinstance(spec.caps, Caps):
        raise TypeError(f"Spec {name!r}: caps must be lmkit.api.Caps(features, values), got "
                        f"{type(spec.caps).__name__}")
    if not isinstance(spec.needs_cuda, bool):
        raise TypeError(f"Spec {name!r}: needs_cuda must be True or False, got "
                        f"{spec.needs_cuda!r}")
    if not isinstance(spec.description, str):
        raise TypeError(f"Spec {name!r}: description must be a string, got "
                        f"{type(spec.description).__name__}")
    _names(name, "requires", spec.requires)
    _names(name, "aliases", spec.aliases)
    if isinstance(spec.variants, (str, bytes)) or not all(
            isinstance(v, Variant) for v in spec.variants):
        raise TypeError(f"Spec {name!r}: variants must be a tuple of lmkit.api.Variant, got "
                        f"{spec.variants!r}")
    if not isinstance(spec.stack_needs, Mapping):
        raise TypeError(f"Spec {name!r}: stack_needs must map a kind to Needs, got "
                        f"{type(spec.stack_needs).__name__}")
    for kind, needs in spec.stack_needs.items():
        if kind not in KINDS and kind not in KIND_ALIASES:
            raise TypeError(f"Spec {name!r}: stack_needs names unknown kind {kind!r}; "
                            f"kinds: {', '.join(KINDS)}")
        if not isinstance(needs, Needs):
            raise TypeError(f"Spec {name!r}: stack_needs[{kind!r}] must be lmkit.api.Needs, "
                            f"got {type(needs).__name__}")


def check_option_defaults(spec_name: str, options: type[BaseModel]) -> None:
    """Raise TypeError if ``options`` rejects its own defaults (pydantic does not
    validate defaults: a bad one would reach the implementation unchecked, or fail the
    user's config under ``auto`` with no option set). Required fields (no default) are
    allowed: the user must set them."""
    defaults = {(f.alias or key): f.get_default(call_default_factory=True)
                for key, f in options.model_fields.items() if not f.is_required()}
    try:
        options.model_validate(defaults)
    except ValidationError as e:
        wrong = [err for err in e.errors() if err["type"] != "missing"]
        if wrong:
            where = ".".join(map(str, wrong[0]["loc"])) or "(model)"
            raise TypeError(
                f"Spec {spec_name!r}: the options model {options.__name__} rejects its own "
                f"defaults ({where}: {wrong[0]['msg']}); give every option a default that "
                "validates") from None
    except Exception as e:  # a validator that raises something else is the same mistake
        raise TypeError(
            f"Spec {spec_name!r}: the options model {options.__name__} fails on its own "
            f"defaults: {type(e).__name__}: {e}") from None


def choose_variant(variants: tuple[Variant, ...], capability: tuple[int, int] | None = None
                   ) -> tuple[Variant | None, dict[str, list[str]]]:
    """The first usable variant (``None`` if none is) and every variant's reasons."""
    reasons = {v.name: v.unavailable_reasons(capability) for v in variants}
    chosen = next((v for v in variants if not reasons[v.name]), None)
    return chosen, reasons


@dataclass(frozen=True, slots=True)
class Spec:
    """One registered implementation of an extension point.

    Args:
        name: the name users select it by (``--attention NAME``); lowercase, unique per kind.
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
        variants: interchangeable ways to run, in order of preference (see
            :class:`Variant`); the spec is available when at least one is, and ``lmkit
            plugins list`` shows which would run and why the others would not.
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
    variants: tuple[Variant, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name.split() != [self.name]:
            raise TypeError(
                f"Spec.name must be a non-empty string without spaces, got {self.name!r}")
        if not (callable(self.target) or isinstance(self.target, str) and ":" in self.target):
            raise TypeError(
                f"Spec {self.name!r}: target must be 'module:attr' or a callable, got {self.target!r}"
            )
        if not (isinstance(self.options, type) and issubclass(self.options, BaseModel)):
            raise TypeError(f"Spec {self.name!r}: options must be a pydantic model class, got "
                            f"{self.options!r}")
        _check_fields(self)
        object.__setattr__(self, "requires", tuple(self.requires))
        object.__setattr__(self, "aliases", tuple(self.aliases))
        object.__setattr__(self, "variants", tuple(self.variants))
        object.__setattr__(self, "stack_needs", _frozen_map(
            {canonical_kind(k): v for k, v in self.stack_needs.items()}))
        check_option_defaults(self.name, self.options)

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
        reasons = _missing_modules(self.requires)
        if self.needs_cuda and cuda_device_count() == 0:
            reasons.append(NO_CUDA)
        if self.variants:
            chosen, why = choose_variant(self.variants)
            if chosen is None:  # "no CUDA device" is said once, above or here
                said = set(reasons)
                left = {name: [x for x in r if x not in said] for name, r in why.items()}
                reasons.append("no usable variant: " + ", ".join(
                    name + (f" ({', '.join(r)})" if r else "") for name, r in left.items()))
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

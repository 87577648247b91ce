"""The error every conformance check raises, and how a suite names what it tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmkit.api.contract import CONSTRUCTORS, constructor_problem
from lmkit.plugin_host.registry import Registration
from lmkit.plugin_host.spec import NoOptions, Spec

# The property every suite checks first: the class is built through its documented
# constructor signature.
CONSTRUCTOR_PROPERTY = "constructor signature"


class ConformanceFailure(AssertionError):
    """A conformance property does not hold.

    The message names the suite, the implementation, the property and the input, then
    says what was expected and what happened, e.g.::

        attention conformance: 'mine' fails property 'prefill over a cached prefix'
        on input: heads 8/2, head_size 64, block_size 16, float32, step 2 ...
        request 1 (context 37, query 11): max abs error 0.81 > tolerance 1e-05 ...

    Attributes: ``suite``, ``impl``, ``prop`` (the property's name), ``input``
    (a description of the input) and ``detail``.
    """

    def __init__(self, suite: str, impl: str, prop: str, input: str, detail: str) -> None:
        self.suite, self.impl, self.prop, self.input, self.detail = suite, impl, prop, input, detail
        super().__init__(
            f"{suite} conformance: {impl!r} fails property {prop!r}\n"
            f"  on input: {input}\n  {detail}"
        )


@dataclass(frozen=True)
class Target:
    """The implementation under test: its class, its spec (when known), options."""

    cls: type
    spec: Spec | None
    options: Any
    name: str

    def fail(self, suite: str, prop: str, input: str, detail: str) -> ConformanceFailure:
        """A :class:`ConformanceFailure` about this implementation (to ``raise``)."""
        return ConformanceFailure(suite, self.name, prop, input, detail)

    def build(self, suite: str, kind: str, prop: str, input: str, *args: Any,
              **kwargs: Any) -> Any:
        """Construct the implementation as lmkit does: ``cls(*args, **kwargs)``, the
        documented signature of ``kind`` (:data:`lmkit.api.contract.CONSTRUCTORS`).

        Raises:
            ConformanceFailure: property ``constructor signature`` when the class does
                not subclass the kind's interface or its ``__init__`` does not accept
                the documented arguments; property ``prop`` when ``__init__`` raises.
        """
        problem = constructor_problem(kind, self.cls, *args, **kwargs)
        if problem is not None:
            raise self.fail(suite, CONSTRUCTOR_PROPERTY, input,
                            f"{problem}. lmkit builds every {kind} plugin as "
                            f"{CONSTRUCTORS[kind].signature}: accept exactly these "
                            "arguments (see docs/plugin-guide.md, constructor signatures)")
        try:
            return self.cls(*args, **kwargs)
        except Exception as e:
            raise self.fail(suite, prop, input, f"constructing the {kind} plugin raised "
                            f"{type(e).__name__}: {e}") from e

    def caps_values(self, key: str) -> frozenset[Any] | None:
        """The declared supported values of ``key`` (``None``: any, or no spec)."""
        if self.spec is None:
            return None
        return self.spec.caps.values.get(key)

    def has_feature(self, feature: str, default: bool = True) -> bool:
        """Whether the spec declares ``feature`` (``default`` without a spec)."""
        if self.spec is None:
            return default
        return feature in self.spec.caps.features


def resolve_target(obj: Any, options: Any = None) -> Target:
    """The class, spec and validated options of ``obj``: a :class:`Spec`, a
    :class:`~lmkit.plugin_host.registry.Registration`, a class, or a ``(spec_or_class,
    options)`` pair. Options given as a mapping are validated by the spec's model."""
    if isinstance(obj, tuple) and len(obj) == 2:
        obj, options = obj
    if isinstance(obj, Registration):
        obj = obj.spec
    if isinstance(obj, Spec):
        cls = obj.load()
        opts = obj.validate_options(options)
        return Target(cls, obj, opts, obj.name)
    if isinstance(obj, type):
        if options is None:
            options = NoOptions()
        return Target(obj, None, options, obj.__name__)
    raise TypeError(
        f"expected a Spec, a Registration or a class to test, got {type(obj).__name__}; "
        "return one of these from your fixture (e.g. the Spec your plugin registers)"
    )


class NotApplicable(Exception):
    """A property does not apply to this implementation here (a feature it does not
    claim, no CUDA device); pytest-based suites turn it into a skip."""


def run_checks(checks: dict[str, Any], only: Any = None) -> dict[str, str]:
    """Run ``checks`` (property name -> zero-argument callable) and return each one's
    outcome, ``"passed"`` or ``"not applicable: REASON"``. The first failing property
    raises its :class:`ConformanceFailure`."""
    results: dict[str, str] = {}
    for name, check in checks.items():
        if only is not None and name not in only:
            continue
        try:
            check()
        except NotApplicable as e:
            results[name] = f"not applicable: {e}"
        else:
            results[name] = "passed"
    return results


def skip_if_not_applicable(check: Any) -> None:
    """Run ``check()``; turn :class:`NotApplicable` into ``pytest.skip``."""
    try:
        check()
    except NotApplicable as e:
        import pytest

        pytest.skip(str(e))

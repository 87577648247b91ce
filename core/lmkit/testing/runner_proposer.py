"""Conformance suite for runner-hosted proposers (:class:`lmkit.api.RunnerProposer`):
draft heads such as ``eagle`` and ``eagle3``, checked against a target model directory
and a head directory made for it.

Properties:

* ``constructor signature``: built as ``cls(config, options=...)`` with
  ``speculative.model`` naming the head;
* ``interface``: the class subclasses ``RunnerProposer``, its spec declares
  ``hidden_states`` or ``own_kv_cache`` (what makes the runner host it) and
  ``num_kv_layers`` is a positive int;
* ``checked before load``: ``check_target`` accepts the target's config (and sets
  ``target_feature_size``, when it does, to the width of the features the runner hands
  the catch-up pass: the target's hidden size times ``len(target_layers)`` or 1) and
  refuses, with a :class:`~lmkit.errors.ConfigError`, the same config at twice the
  hidden size (a head reading the target's features cannot fit another width);
* ``end to end``: with the proposer installed as a plugin, greedy outputs of ``LLM``
  with it equal those without it, and drafts were verified.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    Target,
    resolve_target,
    run_checks,
)
from lmkit.testing.spec_decode import greedy_with_and_without

SUITE = "runner proposer"


def _config(head_dir: str | Path, model_dir: str | Path) -> Any:
    from lmkit.config.schema import LMKitConfig

    return LMKitConfig.model_validate({"model": {"model": str(model_dir)},
                                       "speculative": {"model": str(head_dir)}})


def _build(t: Target, head_dir: str | Path, model_dir: str | Path,
           prop: str = CONSTRUCTOR_PROPERTY) -> Any:
    return t.build(SUITE, "speculative", prop, f"head {head_dir}",
                   _config(head_dir, model_dir), options=t.options)


def interface(t: Target, head_dir: str | Path, model_dir: str | Path) -> None:
    from lmkit.api.spec_decode import RUNNER_HOSTED_FEATURES, RunnerProposer

    if not issubclass(t.cls, RunnerProposer):
        raise t.fail(SUITE, "interface", "the class", f"{t.cls.__qualname__} does not subclass "
                     "lmkit.api.RunnerProposer")
    if t.spec is not None and not RUNNER_HOSTED_FEATURES & t.spec.caps.features:
        raise t.fail(SUITE, "interface", "the spec's caps", "declares neither hidden_states nor "
                     "own_kv_cache: the engine would run it in the engine core")
    layers = _build(t, head_dir, model_dir, "interface").num_kv_layers
    if not isinstance(layers, int) or layers < 1:
        raise t.fail(SUITE, "interface", "num_kv_layers", f"{layers!r} is not a positive int")


def checked_before_load(t: Target, head_dir: str | Path, model_dir: str | Path) -> None:
    from lmkit.errors import ConfigError
    from lmkit.loading.weights import load_hf_config

    target = load_hf_config(Path(model_dir))
    proposer = _build(t, head_dir, model_dir, "checked before load")
    try:
        proposer.check_target(target)
    except ConfigError as e:
        raise t.fail(SUITE, "checked before load", "the target the head was made for",
                     f"check_target refused it: {e}") from e
    width = target.hidden_size * max(1, len(proposer.target_layers))
    if proposer.target_feature_size not in (0, width):
        raise t.fail(SUITE, "checked before load", "target_feature_size after check_target",
                     f"{proposer.target_feature_size}, but the runner hands the catch-up pass "
                     f"features of width {width} (hidden size {target.hidden_size} x "
                     f"{max(1, len(proposer.target_layers))} layers); set it to that, or 0")
    wide = copy.deepcopy(target)
    wide.hidden_size = 2 * target.hidden_size
    wide.intermediate_size = 2 * target.intermediate_size
    try:
        proposer.check_target(wide)
    except ConfigError:
        return
    raise t.fail(SUITE, "checked before load", f"a target of hidden_size {wide.hidden_size}",
                 "check_target accepted it; it must raise ConfigError naming the mismatch")


def end_to_end(t: Target, head_dir: str | Path, model_dir: str | Path) -> None:
    """Greedy outputs of ``LLM`` with the proposer equal those without it."""
    stats = greedy_with_and_without(t, SUITE, model_dir, speculative_model=str(head_dir))
    if not stats.get("spec_num_draft_tokens", 0):
        raise t.fail(SUITE, "end to end", "greedy, k=3", "no draft token was verified")


def check_runner_proposer(proposer: Any, *, model_dir: str | Path, head_dir: str | Path,
                          options: Any = None, only: Iterable[str] | None = None
                          ) -> dict[str, str]:
    """Run every runner-proposer property against ``proposer`` (a Spec, Registration or
    RunnerProposer subclass) with the target at ``model_dir`` and a head for it at
    ``head_dir``.

    :raises ConformanceFailure: naming the first failing property.
    """
    t = resolve_target(proposer, options)
    checks: dict[str, Callable[[], None]] = {
        CONSTRUCTOR_PROPERTY: lambda: _build(t, head_dir, model_dir),
        "interface": lambda: interface(t, head_dir, model_dir),
        "checked before load": lambda: checked_before_load(t, head_dir, model_dir),
        "end to end": lambda: end_to_end(t, head_dir, model_dir),
    }
    return run_checks(checks, set(only) if only is not None else None)

"""Resolving the whole stack (scheduler, attention, executor, proposer, grammar backend,
offload tier) for a config and cross-checking it, before any weights load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from lmkit.api.model_facts import DENSE_WEIGHT_FORMAT
from lmkit.config.errors import format_validation_error
from lmkit.config.parallel import check_parallel_settings
from lmkit.errors import ConfigError, StackConflictError
from lmkit.platform import cpu_has_bf16_matmul, cuda_device_count
from lmkit.plugin_host.kinds import OPTIONAL_KINDS, STACK_KINDS, kind_label
from lmkit.plugin_host.registry import Registration
from lmkit.plugin_host.spec import Needs

if TYPE_CHECKING:
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.manager import PluginHost

# Order of resolution: kinds that impose needs on others come first.
_ORDER = ("speculative", "structured_output", "offload", "scheduler", "executor", "attention",
          "quantization", "sampling_kernels")


@dataclass
class ResolvedStack:
    """The chosen implementation of every stack kind (``None`` for a feature left off)."""

    device: str
    dtype: str
    entries: dict[str, Registration | None] = field(default_factory=dict)
    options: dict[str, BaseModel | None] = field(default_factory=dict)

    def get(self, kind: str) -> Registration | None:
        """The registration chosen for ``kind``, or ``None`` if that feature is off."""
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
        """JSON-ready description: device, dtype and per kind the choice and its options."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "stack": {k: None if r is None else _entry_dict(r, self.options.get(k))
                      for k, r in self.entries.items()},
        }


def _entry_dict(reg: Registration, options: BaseModel | None) -> dict[str, Any]:
    return {"name": reg.name, "plugin": reg.plugin, "dist": reg.dist, "version": reg.version,
            "options": options.model_dump() if options is not None else {}}


def resolve_device(config: LMKitConfig, encoder: bool = False) -> tuple[str, str]:
    """The device and dtype ``auto`` settings stand for on this machine (the dtype: see
    :func:`auto_dtype`; ``encoder``: the model is a bidirectional encoder).

    :raises ConfigError: ``executor.device`` is ``cuda`` on a machine without a CUDA
        device (the engine could not start; ``lmkit config check`` says so up front).
    """
    device = config.executor.device
    if device == "auto":
        device = "cuda" if cuda_device_count() > 0 else "cpu"
    elif device == "cuda" and cuda_device_count() == 0:
        where = config.source_of("executor.device")
        raise ConfigError(
            "executor.device is 'cuda'" + (f" (set by {where})" if where else "")
            + ", but this machine has no CUDA device that torch can use; run it where "
            "one is, or use --device cpu (or auto) and a CPU dtype such as float32.")
    dtype: str = config.model.dtype
    if dtype == "auto":
        dtype = auto_dtype(device, encoder)
    return device, dtype


def auto_dtype(device: str, encoder: bool) -> str:
    """What ``model.dtype: auto`` means: bfloat16 on CUDA; on the CPU bfloat16 for an
    encoder (a pooling model with bidirectional attention, e.g. BERT embedders) when the
    CPU multiplies bfloat16 in hardware (:func:`lmkit.platform.cpu_has_bf16_matmul`),
    else float32. Encoders only: their embeddings stay within cosine 0.999 of float32's
    (MiniLM: 0.9999), while a decoder's greedy text may change with the precision."""
    if device == "cuda" or (encoder and device == "cpu" and cpu_has_bf16_matmul()):
        return "bfloat16"
    return "float32"


def configure_and_resolve(config: LMKitConfig, host: PluginHost) -> ResolvedStack:
    """Run the plugins' ``configure`` checks, then :func:`resolve_stack`, loading nothing:
    what ``lmkit config check`` reports and what ``lmkit serve`` checks before it starts
    the engine. Raises :class:`ConfigError` (or a subclass) when the stack cannot run."""
    host.hook.configure(config=config)
    return resolve_stack(config, host)


def resolve_stack(config: LMKitConfig, host: PluginHost, model_needs: Needs | None = None,
                  weight_format: str | None = None, encoder: bool = False) -> ResolvedStack:
    """Choose and cross-check every stack kind for ``config``, loading nothing.

    Kinds that impose needs on others (a proposer's ``stack_needs``) are resolved
    first: under ``auto`` the imposed needs steer the choice; an explicitly named
    backend that lacks them is a :class:`StackConflictError` naming both sides. An
    optional kind (speculative, structured output, offload) left on ``auto`` is off when
    nothing registered fits. The ``configure`` hook is the caller's to run first (the
    engine and ``lmkit config check`` do).

    With ``parallel.tensor_parallel_size > 1`` the executor, the offload tier and the
    quantization method must declare the ``tensor_parallel`` feature, and the executor's ``auto`` means
    ``parallel.distributed_backend``.

    :param model_needs: what the model requires of attention (e.g. ``head_size``), when
        its config is known.
    :param weight_format: the checkpoint's weight format
        (:attr:`lmkit.api.model_facts.ModelFacts.weight_format`): a
        quantization method must read it. ``None`` (no model at hand, as in ``lmkit
        config check``) or dense ``"safetensors"``: ``auto`` chooses no method; a named
        one is checked for the device only (no model) or for reading that format.
    :param encoder: the model is a bidirectional encoder (``ModelPooling(causal=False)``):
        ``model.dtype: auto`` may then mean bfloat16 on the CPU (:func:`auto_dtype`).
    :raises ConfigError: (or a subclass) with every reason and where the offending
        setting came from; also what :func:`lmkit.config.parallel.check_parallel_settings`
        refuses.
    """
    device, dtype = resolve_device(config, encoder)
    check_parallel_settings(config, device)
    tensor_parallel = config.parallel.tensor_parallel_size > 1
    base = {
        "executor": Needs(features=frozenset({"tensor_parallel"} if tensor_parallel else ()),
                          values={"device": device}),
        "attention": Needs(features=frozenset(
                               ({"fp8_kv_cache"} if config.cache.fp8_kv_cache else set())
                               | ({"tree_mask"} if config.speculative.tree else set())),
                           values={"device": device, "dtype": dtype}
                           ).merge(model_needs or Needs()),
        "offload": Needs(features=frozenset({"tensor_parallel"} if tensor_parallel else ()),
                         values={"device": device}),
        "quantization": Needs(
            features=frozenset({"tensor_parallel"} if tensor_parallel else ()),
            values={"device": device} | ({"weight_format": weight_format} if weight_format
                                         else {})),
        "sampling_kernels": Needs(values={"device": device}),
    }
    stack = ResolvedStack(device=device, dtype=dtype)
    imposed: dict[str, Needs] = {}
    imposers: dict[str, list[str]] = {}
    for kind in _ORDER:
        section_name = kind  # each stack kind is selected by the section of its name
        section = getattr(config, section_name)
        choice = section.backend
        if kind == "executor" and choice == "auto" and tensor_parallel:
            choice = config.parallel.distributed_backend  # one model over several ranks
        reg = None
        # auto quantization follows the checkpoint: dense weights (or no model at hand)
        # stay dense, even where a method could quantize them at load
        unknown_format = (kind == "quantization" and choice == "auto"
                          and weight_format in (None, DENSE_WEIGHT_FORMAT))
        if not (kind in OPTIONAL_KINDS and choice == "none") and not unknown_format:
            needs = base.get(kind, Needs())
            if choice == "auto":
                needs = needs.merge(imposed.get(kind, Needs()))
            reg = _select(host, config, kind, choice, needs, imposers.get(kind, []))
        stack.entries[kind], stack.options[kind] = reg, None
        if reg is None:
            continue
        for other, n in reg.spec.stack_needs.items():
            imposed[other] = imposed.get(other, Needs()).merge(n)
            imposers.setdefault(other, []).append(f"{_label(kind)} {reg.name!r} needs {n.describe()}")
        try:
            stack.options[kind] = reg.spec.validate_options(section.options)
        except ValidationError as e:
            raise ConfigError(
                f"invalid options for {_label(kind)} {reg.name!r} (plugin {reg.origin}):\n  "
                + format_validation_error(e, f"{section_name}.options", reg.spec.options,
                                          origin=config.source_of).replace("\n", "\n  ")
            ) from e
    stack.entries = {k: stack.entries[k] for k in STACK_KINDS}
    stack.options = {k: stack.options[k] for k in STACK_KINDS}
    check_stack(stack)
    return stack


def _label(kind: str) -> str:
    return kind_label(kind)


def _select(host: PluginHost, config: LMKitConfig, kind: str, choice: str, needs: Needs,
            imposers: list[str]) -> Registration | None:
    """``host.select`` with the context a user needs in its error: where an explicit name
    was set, and which other backend imposed needs under ``auto``."""
    if choice == "auto" and kind in OPTIONAL_KINDS:
        if not any(not r.spec.why_not(needs) for r in host.registry.all(kind)):
            return None  # an optional feature nothing can provide stays off
    try:
        return host.select(kind, choice, needs)
    except ConfigError as e:
        note = ""
        if choice != "auto":
            where = config.source_of(f"{kind}.backend")
            note = f"\n({kind}.backend = {choice!r} was set by {where}.)" if where else ""
        elif imposers:
            note = "\n(Needed because " + "; ".join(imposers) + ".)"
        if not note:
            raise
        raise type(e)(f"{e}{note}") from e


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
                    problems.append(
                        f"{_label(kind)} {reg.name!r} needs a {_label(other)} backend, "
                        "but none is chosen"
                    )
                continue
            for reason in target.spec.caps.why_not(needs):
                problems.append(
                    f"{_label(kind)} {reg.name!r} (plugin {reg.plugin}) needs {_label(other)} "
                    f"with {needs.describe()}, but {_label(other)} {target.name!r} "
                    f"(plugin {target.plugin}) {reason}"
                )
    if problems:
        raise StackConflictError(
            "the chosen backends do not work together:\n  - " + "\n  - ".join(problems)
            + "\nChoose compatible backends, or leave one on 'auto'."
        )

"""The constructor contract: one documented signature per extension point, and the
check that a plugin's class is built as its interface says.

The engine builds every plugin object through :func:`build` (so a class whose
``__init__`` does not take the documented arguments fails with a message naming the
plugin, the signature and the mismatch, not a bare ``TypeError`` from deep inside the
engine), and the conformance kits of :mod:`lmkit.testing` check the same signature.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from lmkit.api.attention import AttentionBackend
from lmkit.api.executor import Executor
from lmkit.api.model import Model
from lmkit.api.offload import OffloadManager
from lmkit.api.pooling import Pooler
from lmkit.api.quantization import QuantizationMethod
from lmkit.api.sampling_kernels import SamplingKernels
from lmkit.api.scheduler import Scheduler
from lmkit.api.source import ModelSource
from lmkit.api.spec_decode import Proposer
from lmkit.api.structured_output import StructuredOutputBackend
from lmkit.errors import PluginError


@dataclass(frozen=True)
class Constructor:
    """How lmkit builds one kind of plugin: the interface its class subclasses and the
    one signature it is called with (documented on the interface)."""

    kind: str
    interface: type
    signature: str


CONSTRUCTORS: dict[str, Constructor] = {c.kind: c for c in (
    Constructor("scheduler", Scheduler, "cls(config, *, num_blocks, options, context)"),
    Constructor("attention", AttentionBackend,
                "cls(*, num_heads, num_kv_heads, head_size, scale, dtype, device, "
                "block_size, sliding_window, options[, causal])"),
    Constructor("executor", Executor, "cls(config, stack, *, options, host, facts)"),
    Constructor("speculative", Proposer, "cls(config, *, options)"),
    Constructor("structured_output", StructuredOutputBackend,
                "cls(tokenizer, vocab_size, *, options)"),
    Constructor("offload", OffloadManager, "cls(config, kv_caches, *, options)"),
    Constructor("model", Model, "cls(hf_config, ctx)"),
    Constructor("quantization", QuantizationMethod, "cls(facts, *, options)"),
    Constructor("sampling_kernels", SamplingKernels, "cls(*, device, options)"),
    Constructor("model_source", ModelSource, "cls()"),
    Constructor("pooler", Pooler, "cls(model)"),
)}


def interface_problem(kind: str, cls: Any) -> str | None:
    """Why ``cls`` is not a ``kind`` plugin class (not a class, or not a subclass of the
    kind's interface); ``None`` when it is."""
    interface = CONSTRUCTORS[kind].interface.__name__
    if not isinstance(cls, type):
        return f"{cls!r} is not a class; register a subclass of lmkit.api.{interface}"
    if not issubclass(cls, CONSTRUCTORS[kind].interface):
        return f"{cls.__qualname__} does not subclass lmkit.api.{interface}"
    return None


def constructor_problem(kind: str, cls: Any, *args: Any, **kwargs: Any) -> str | None:
    """Why ``cls`` cannot be built as a ``kind`` plugin with ``args``/``kwargs`` (the
    documented signature's arguments): :func:`interface_problem`, or its ``__init__``
    does not accept them. ``None`` when it can."""
    problem = interface_problem(kind, cls)
    if problem is not None:
        return problem
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a builtin or C-level __init__: nothing to check
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        return (f"{cls.__qualname__}{signature} does not accept lmkit's constructor call "
                f"{CONSTRUCTORS[kind].signature} ({e})")
    return None


def build(kind: str, cls: Any, *args: Any, plugin: str = "", **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)`` after :func:`constructor_problem` found nothing wrong.

    Raises:
        PluginError: naming the plugin, the kind's documented signature and the mismatch.
    """
    problem = constructor_problem(kind, cls, *args, **kwargs)
    if problem is not None:
        contract = CONSTRUCTORS[kind]
        where = f" (plugin {plugin})" if plugin else ""
        raise PluginError(
            f"cannot build the {kind} plugin{where}: {problem}. A {kind} plugin's class "
            f"subclasses lmkit.api.{contract.interface.__name__} and is built as "
            f"{contract.signature}; see docs/plugin-guide.md (constructor signatures).")
    return cls(*args, **kwargs)

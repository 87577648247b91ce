"""Checking the ``parallel`` section against this machine and the model, before any
weights load: what is not built yet, the devices present, and the head counts that
tensor parallelism splits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmkit.errors import ConfigError
from lmkit.platform import cuda_device_count

if TYPE_CHECKING:
    from lmkit.api.model_facts import ModelFacts
    from lmkit.config.schema import LMKitConfig


def _where(config: LMKitConfig, path: str) -> str:
    origin = config.source_of(path)
    return f" (set by {origin})" if origin else ""


def check_parallel_settings(config: LMKitConfig, device: str) -> None:
    """Refuse what is not built and what this machine cannot run; needs no model.

    :param device: the resolved device (``cpu`` or ``cuda``).
    :raises ConfigError: ``data_parallel_size > 1`` (not built yet), or more CUDA ranks
        than devices on this host (``mp``; ``ray`` places ranks over its cluster). On the
        CPU any size runs (gloo).
    """
    par = config.parallel
    if par.data_parallel_size > 1:
        raise ConfigError(
            f"parallel.data_parallel_size is {par.data_parallel_size}"
            f"{_where(config, 'parallel.data_parallel_size')}, but data parallelism (several "
            "engine cores behind one server) is not built yet; only 1 is allowed. Run one "
            "server per engine behind a load balancer meanwhile, or drop --dp.")
    if device == "cuda" and par.distributed_backend == "mp":
        available = cuda_device_count()
        if par.tensor_parallel_size > available:
            raise ConfigError(
                f"parallel.tensor_parallel_size is {par.tensor_parallel_size}"
                f"{_where(config, 'parallel.tensor_parallel_size')}, but this machine has "
                f"{available} CUDA device(s); use --tp {max(1, available)} or fewer (or run "
                "on the CPU, where any size runs over gloo).")


def check_model_split(config: LMKitConfig, facts: ModelFacts) -> None:
    """Refuse a tensor-parallel size the model's shapes do not divide by.

    Attention heads, key/value heads and the MLP's intermediate size
    (:class:`~lmkit.api.model_facts.ModelFacts`) are split evenly over the ranks
    (key/value heads are not replicated, so there must be at least as many as ranks);
    the vocabulary is padded to a multiple of the size, so any works.

    :raises ConfigError: naming the count that does not divide and the sizes that would.
    """
    tp = config.parallel.tensor_parallel_size
    if tp == 1:
        return
    counts = {
        "num_attention_heads": facts.num_attention_heads,
        "num_key_value_heads": facts.num_key_value_heads,
        "intermediate_size": facts.intermediate_size,
    }
    bad = {k: v for k, v in counts.items() if v and v % tp}
    if not bad:
        return
    known = [v for v in counts.values() if v]
    fits = [n for n in range(1, max(known) + 1) if all(v % n == 0 for v in known)]
    described = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise ConfigError(
        f"parallel.tensor_parallel_size is {tp}{_where(config, 'parallel.tensor_parallel_size')}"
        f", but the model's {described} {'is' if len(bad) == 1 else 'are'} not divisible by "
        "it: each rank must hold a "
        f"whole share of the heads (key/value heads are not replicated across ranks). "
        f"Sizes this model can be split into: {', '.join(map(str, fits))}.")

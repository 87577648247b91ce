"""Checking the ``parallel`` section against this machine and the model, before any
weights load: the devices present (and which ones each data-parallel engine gets), and
the head counts that tensor parallelism splits."""

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


def places_ranks_locally(config: LMKitConfig) -> bool:
    """True when the executor runs its ranks on this host's devices (``mp``, or one
    rank in the engine process); false when Ray places them over its cluster."""
    par = config.parallel
    backend = config.executor.backend
    if backend == "auto":
        return par.tensor_parallel_size == 1 or par.distributed_backend == "mp"
    return backend != "ray"


def check_parallel_settings(config: LMKitConfig, device: str, *,
                            cuda_devices: int | None = None) -> None:
    """Refuse what this machine cannot run; needs no model.

    :param device: the resolved device (``cpu`` or ``cuda``).
    :param cuda_devices: the CUDA device count to check against (default: the devices
        present, :func:`lmkit.platform.cuda_device_count`).
    :raises ConfigError: more CUDA devices asked for (``data_parallel_size`` x
        ``tensor_parallel_size``) than this host has, when the ranks run on this host
        (``ray`` places ranks over its cluster). On the CPU any size runs (engines and
        gloo ranks share the cores).
    """
    par = config.parallel
    if device != "cuda" or not places_ranks_locally(config):
        return
    available = cuda_device_count() if cuda_devices is None else cuda_devices
    tp, dp = par.tensor_parallel_size, par.data_parallel_size
    if tp * dp <= available:
        return
    if dp == 1:
        raise ConfigError(
            f"parallel.tensor_parallel_size is {tp}"
            f"{_where(config, 'parallel.tensor_parallel_size')}, but this machine has "
            f"{available} CUDA device(s); use --tp {max(1, available)} or fewer (or run "
            "on the CPU, where any size runs over gloo).")
    raise ConfigError(
        f"parallel.data_parallel_size {dp}{_where(config, 'parallel.data_parallel_size')} x "
        f"tensor_parallel_size {tp}{_where(config, 'parallel.tensor_parallel_size')} needs "
        f"{dp * tp} CUDA devices (each engine gets {tp} of its own), but this machine has "
        f"{available}; use --dp {max(1, available // tp)} or fewer at --tp {tp}.")


def data_parallel_devices(config: LMKitConfig, device: str, *, visible: str | None = None,
                          cuda_devices: int | None = None) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` of each data-parallel engine: engine ``r`` gets devices
    ``[r*tp, (r+1)*tp)`` of those this process sees (``visible``, the parent's
    ``CUDA_VISIBLE_DEVICES``, else ``0..count-1``). ``None`` where nothing is assigned:
    on the CPU (the engines share the cores) and when Ray places the ranks.

    :raises ConfigError: what :func:`check_parallel_settings` raises.
    """
    dp, tp = config.parallel.data_parallel_size, config.parallel.tensor_parallel_size
    if device != "cuda" or not places_ranks_locally(config):
        return [None] * dp
    check_parallel_settings(config, device, cuda_devices=cuda_devices)
    if visible is not None and visible.strip():
        ids = [v.strip() for v in visible.split(",") if v.strip()]
    else:
        count = cuda_device_count() if cuda_devices is None else cuda_devices
        ids = [str(i) for i in range(count)]
    return [",".join(ids[r * tp:(r + 1) * tp]) for r in range(dp)]


def check_model_split(config: LMKitConfig, facts: ModelFacts) -> None:
    """Refuse a tensor-parallel size the model's shapes cannot be split into.

    Attention heads go to the ranks in whole key/value groups
    (:func:`~lmkit.api.model.kv_heads_of_rank`: as evenly as the count allows, the first
    ranks one group more when the KV heads do not divide by the size). KV heads are not
    replicated, so there must be at least as many as ranks; the MLP's intermediate size
    is split evenly (:class:`~lmkit.api.model_facts.ModelFacts`); the vocabulary is
    padded to a multiple of the size, so any works.

    :raises ConfigError: naming the count that does not fit and the sizes that would.
    """
    tp = config.parallel.tensor_parallel_size
    if tp == 1:
        return
    heads, kv, inter = (facts.num_attention_heads, facts.num_key_value_heads,
                        facts.intermediate_size)
    grouped = not (heads and kv and heads % kv)  # every query head reads one KV head
    bad: list[str] = []
    if kv and kv < tp:
        bad.append(f"num_key_value_heads={kv} is fewer than the ranks (each rank must hold "
                   "at least one key/value head; they are not replicated)")
    if not grouped:
        bad.append(f"num_attention_heads={heads} is not a multiple of "
                   f"num_key_value_heads={kv}")
    if inter and inter % tp:
        bad.append(f"intermediate_size={inter} is not divisible by it")
    if not bad:
        return
    fits = [n for n in range(1, (kv or heads or tp) + 1) if not (inter and inter % n)]
    raise ConfigError(
        f"parallel.tensor_parallel_size is {tp}{_where(config, 'parallel.tensor_parallel_size')}"
        f", but the model's {'; '.join(bad)}. Sizes this model can be split into: "
        f"{', '.join(map(str, fits)) if grouped else 'none (run it unsplit)'}.")

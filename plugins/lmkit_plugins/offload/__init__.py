"""Built-in KV offload tiers: ``cpu`` (host memory), ``disk`` (a directory) and
``cpu+disk`` (host memory spilling to a directory). See ``docs/offload.md``."""

from lmkit.api import Caps, Spec, hookimpl

from lmkit_plugins.offload.options import CPUDiskTierOptions, CPUTierOptions, DiskTierOptions

LMKIT_PLUGIN_API = ">=1.0,<2"

_CAPS = Caps(values={"device": frozenset({"cpu", "cuda"})})
# a host-memory pool per rank works under tensor parallelism; a directory would be
# shared by the ranks' block files (not built)
_CPU_CAPS = Caps(features={"tensor_parallel"}, values={"device": frozenset({"cpu", "cuda"})})


@hookimpl
def register_offload_managers(register):
    register(Spec(
        name="cpu", target="lmkit_plugins.offload.cpu_tier:CPUTier", priority=100,
        caps=_CPU_CAPS,
        options=CPUTierOptions,
        description="Host memory pool (page-locked on CUDA), LRU or ARC eviction.",
    ))
    register(Spec(
        name="cpu+disk", target="lmkit_plugins.offload.stacked:CPUDiskTier", priority=50,
        caps=_CAPS, options=CPUDiskTierOptions,
        description="Host memory pool whose evictions are written to a disk directory.",
    ))
    register(Spec(
        name="disk", target="lmkit_plugins.offload.disk_tier:DiskTier", priority=30, caps=_CAPS,
        options=DiskTierOptions,
        description="Block files in a directory, authenticated with a keyed MAC; persists across restarts.",
    ))

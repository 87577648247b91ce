"""KV-cache offload in the engine: blocks evicted from the device prefix cache go to a
slower tier (an :class:`~lmkit.api.OffloadManager` plugin: CPU memory, disk) and come
back on a prefix hit instead of being recomputed.

* :mod:`lmkit.offload.coordinator`: the scheduler side (stores on eviction, loads at
  admission, completion);
* :mod:`lmkit.offload.worker`: the runner side (the tier next to the device caches);
* :mod:`lmkit.offload.transfers`: the per-step plan between the two;
* :mod:`lmkit.offload.attach`: wiring into an engine.

See ``docs/offload.md``.
"""

from lmkit.offload.coordinator import OffloadCoordinator
from lmkit.offload.transfers import KVTransfers, LoadRequest

__all__ = ["KVTransfers", "LoadRequest", "OffloadCoordinator"]

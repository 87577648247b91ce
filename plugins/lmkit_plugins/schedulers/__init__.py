"""Built-in schedulers: ``fcfs`` (default) and ``priority``."""

from lmkit.api import Spec, hookimpl

LMKIT_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_schedulers(register):
    register(Spec(
        name="fcfs", target="lmkit_plugins.schedulers.fcfs:FCFSScheduler", priority=100,
        description="First come, first served; preempts the latest arrival.",
    ))
    register(Spec(
        name="priority", target="lmkit_plugins.schedulers.priority:PriorityScheduler",
        priority=50,
        description="Lowest priority value first, then arrival; preempts the least important.",
    ))

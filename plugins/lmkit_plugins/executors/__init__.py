"""Built-in executors."""

from lmkit.api import Caps, Spec, hookimpl

LMKIT_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_executors(register):
    register(Spec(
        name="uniproc", target="lmkit_plugins.executors.uniproc:UniProcExecutor", priority=100,
        caps=Caps(values={"device": {"cpu", "cuda"}}),
        description="One model runner in the engine-core process.",
    ))

"""Built-in executors."""

from lmkit.api import Caps, Spec, hookimpl

from lmkit_plugins.executors.failure import WorkerOptions

LMKIT_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_executors(register):
    register(Spec(
        name="uniproc", target="lmkit_plugins.executors.uniproc:UniProcExecutor", priority=100,
        caps=Caps(values={"device": {"cpu", "cuda"}}),
        description="One model runner in the engine-core process.",
    ))
    register(Spec(
        name="mp", target="lmkit_plugins.executors.mp:MultiprocExecutor", priority=10,
        caps=Caps(features={"tensor_parallel"}, values={"device": {"cpu", "cuda"}}),
        options=WorkerOptions,
        description="One worker process per tensor-parallel rank (torch.distributed: gloo on "
                    "CPU, NCCL on CUDA); steps sent over ZMQ as msgpack.",
    ))
    register(Spec(
        name="ray", target="lmkit_plugins.executors.ray_executor:RayExecutor", priority=5,
        requires=("ray",),
        caps=Caps(features={"tensor_parallel"}, values={"device": {"cpu", "cuda"}}),
        options=WorkerOptions,
        description="The mp executor's ranks as Ray actors in a placement group (several "
                    "hosts: RAY_ADDRESS), or a local Ray.",
    ))


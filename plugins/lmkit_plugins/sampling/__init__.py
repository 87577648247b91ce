"""Built-in sampling kernels (the ``sampling_kernels`` kind), a plugin of its own
(entry point ``lmkit.sampling``).

``torch`` (priority 0, any device) is the core's
:class:`lmkit.api.TorchSamplingKernels`; ``triton`` (priority 50, CUDA only, needs the
``triton`` package) uses the Triton sampling and rejection kernels of
:mod:`lmkit_kernels` for the shapes where they measured faster on the GPU (see
:mod:`lmkit_plugins.sampling.policy`) and the torch path everywhere else.
"""

from lmkit.api import Caps, Spec, hookimpl

LMKIT_PLUGIN_API = ">=1.0,<2"

TORCH = Spec(
    name="torch", target="lmkit.sample.kernels:TorchSamplingKernels", priority=0,
    caps=Caps(values={"device": {"cpu", "cuda"}}),
    description="Batched torch: the filters, then an inverse-CDF draw per row; rejection "
                "sampling of drafts (the core's default).",
)
TRITON = Spec(
    name="triton", target="lmkit_plugins.sampling.triton_kernels:TritonSamplingKernels",
    priority=50, requires=("triton",), needs_cuda=True,
    caps=Caps(values={"device": {"cuda"}}),
    description="Triton top-k/top-p/temperature sampling and rejection sampling where they "
                "measured faster on the GPU (docs/gpu.md), repetition/frequency/presence "
                "penalties in one pass; torch elsewhere.",
)


@hookimpl
def register_sampling_kernels(register):
    """Register the built-in sampling kernels (``torch``, ``triton``)."""
    register(TORCH)
    register(TRITON)

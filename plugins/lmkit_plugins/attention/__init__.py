"""Built-in attention backends."""

from lmkit.api import Caps, Spec, hookimpl

LMKIT_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_attention_backends(register):
    register(Spec(
        name="torch", target="lmkit_plugins.attention.torch_ref:TorchAttention", priority=10,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill", "sliding_window"},
            {"device": {"cpu", "cuda"}, "dtype": {"float32", "bfloat16", "float16"}},
        ),
        description="Reference paged attention in plain torch (CPU and CUDA).",
    ))

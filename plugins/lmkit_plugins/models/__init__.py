"""Built-in model architectures."""

from lmkit.api import Spec, hookimpl

LMKIT_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_models(register):
    register(Spec(
        name="LlamaForCausalLM", target="lmkit_plugins.models.llama:LlamaForCausalLM",
        aliases=("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        description="Llama 2/3 (llama3 RoPE scaling), Mistral, Qwen2, Qwen3, SmolLM2.",
    ))

"""Built-in model architectures, and the quantization methods their layers compute with."""

from lmkit.api import Caps, ConfigError, Spec, hookimpl

LMKIT_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_models(register):
    register(Spec(
        name="LlamaForCausalLM", target="lmkit_plugins.models.llama:LlamaForCausalLM",
        aliases=("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        description="Llama 2/3 (llama3 RoPE scaling), Mistral, Qwen2, Qwen3, SmolLM2.",
    ))


@hookimpl
def register_quantization_methods(register):
    register(Spec(
        name="gguf", target="lmkit_plugins.quantization.gguf_cpu:GGUFCpuMethod",
        requires=("gguf",), priority=50,
        caps=Caps({"Q8_0", "Q4_0", "Q4_1", "F32", "F16", "kernel:q8_dot_avx512vnni",
                   "kernel:q8_dot_avx2", "kernel:dequantize_f32_tiles"},
                  {"weight_format": {"gguf"}, "device": {"cpu"}}),
        description="GGUF Q8_0/Q4_0/Q4_1 blocks kept packed on the CPU (C kernels, int8 "
                    "activations for decode batches).",
    ))


@hookimpl
def configure(config):
    if config.quantization.backend.lower() == "fp8":
        raise ConfigError(
            "--quantization fp8 (FP8 e4m3 weights on CUDA) is not built yet; the methods "
            "built are: gguf (GGUF blocks on the CPU), or none (dense weights).")

"""Built-in model architectures, the built-in poolers they pool with, and the
quantization methods their layers compute with."""

from lmkit.api import Caps, ConfigError, Spec, hookimpl

from lmkit_plugins.poolers import pooler_specs
from lmkit_plugins.quantization.fp8_options import Fp8Options

LMKIT_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_models(register):
    register(Spec(
        name="LlamaForCausalLM", target="lmkit_plugins.models.llama:LlamaForCausalLM",
        aliases=("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        description="Llama 2/3 (llama3 RoPE scaling), Mistral, Qwen2, Qwen3, SmolLM2.",
    ))
    register(Spec(
        name="MixtralForCausalLM", target="lmkit_plugins.models.mixtral:MixtralForCausalLM",
        description="Mixtral: Llama-style attention with a sparse mixture-of-experts MLP "
                    "(top-k softmax routing; fused Triton MoE kernel on CUDA).",
    ))
    register(Spec(
        name="DeepseekV2ForCausalLM", target="lmkit_plugins.models.deepseek:DeepseekV2ForCausalLM",
        description="DeepSeek-V2 (and -Lite): multi-head latent attention on an MLA backend, "
                    "dense first layers, MoE with shared experts (greedy/group-limited routing).",
    ))
    register(Spec(
        name="DeepseekV3ForCausalLM", target="lmkit_plugins.models.deepseek:DeepseekV3ForCausalLM",
        description="DeepSeek-V3: MLA (q-LoRA, YaRN), MoE with sigmoid bias-corrected grouped "
                    "routing and shared experts; MTP layers skipped.",
    ))
    register(Spec(
        name="Gemma3ForCausalLM", target="lmkit_plugins.models.gemma3:Gemma3ForCausalLM",
        description="Gemma-3 text: sliding-window and full-attention layers interleaved "
                    "(two KV cache groups), q/k norms, local and global RoPE bases.",
    ))
    register(Spec(
        name="Gemma2ForCausalLM", target="lmkit_plugins.models.gemma3:Gemma2ForCausalLM",
        description="Gemma-2: sliding-window and full-attention layers alternating (two KV "
                    "cache groups), attention-score and final-logit soft-capping (needs a "
                    "backend declaring logits_soft_cap: torch).",
    ))
    register(Spec(
        name="LlamaModel", target="lmkit_plugins.models.llama:LlamaEmbeddingModel",
        aliases=("MistralModel", "Qwen2Model", "Qwen3Model"),
        description="The Llama family without a language-model head (e.g. a Qwen3Model "
                    "export): embeddings by last-token pooling.",
    ))
    register(Spec(
        name="BertModel", target="lmkit_plugins.models.bert:BertModel",
        description="BERT-style encoders with bidirectional attention (all-MiniLM-L6-v2, "
                    "BGE, E5): embeddings only.",
    ))
    register(Spec(
        name="BertForSequenceClassification",
        target="lmkit_plugins.models.bert:BertForSequenceClassification",
        description="BERT encoders with a sequence-classification head (class "
                    "probabilities through the classify pooler).",
    ))


@hookimpl
def register_poolers(register):
    for spec in pooler_specs():
        register(spec)


@hookimpl
def register_quantization_methods(register):
    register(Spec(
        name="gguf", target="lmkit_plugins.quantization.gguf_cpu:GGUFCpuMethod",
        requires=("gguf",), priority=50,
        caps=Caps({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0", "F32", "F16",
                   "kernel:q8_dot_avx512vnni",
                   "kernel:q8_dot_avx2", "kernel:dequantize_f32_tiles"},
                  {"weight_format": {"gguf"}, "device": {"cpu"}, "dtype": {"float32"}}),
        description="GGUF Q8_0/Q4_0/Q4_1/Q4_K/Q6_K (and Q5_0, held as Q8_0) blocks kept "
                    "packed on the CPU (C kernels, int8 "
                    "activations for decode batches).",
    ))


    register(Spec(
        name="fp8", target="lmkit_plugins.quantization.fp8_cuda:Fp8Method",
        requires=("triton",), needs_cuda=True, priority=50, options=Fp8Options,
        caps=Caps({"F8_E4M3", "quantize_at_load", "kernel:fp8_gemv_triton",
                   "kernel:scaled_mm_rowwise"},
                  {"weight_format": {"safetensors", "compressed-tensors", "fp8"},
                   "device": {"cuda"}, "dtype": {"bfloat16", "float16"}}),
        description="FP8 e4m3 weights with per-channel scales on CUDA (SM 8.9+): FP8 "
                    "checkpoints (compressed-tensors, quant_method fp8) or dense ones "
                    "quantized at load; Triton GEMV for decode, torch._scaled_mm above.",
    ))


@hookimpl
def configure(config):
    if config.quantization.backend.lower() == "fp8" and config.executor.device == "cpu":
        raise ConfigError(
            "--quantization fp8 runs FP8 e4m3 weights on CUDA GPUs (compute capability "
            "8.9+) only, and the device is cpu; on the CPU use --quantization gguf (a GGUF "
            "checkpoint) or none (dense weights).")

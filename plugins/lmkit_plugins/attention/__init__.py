"""Built-in attention backends.

Under ``attention: auto`` on a CUDA device the highest-priority available backend wins:
``triton`` (60), then ``flashinfer`` (55) when the ``flashinfer`` package is installed
(chosen when a model needs what only it declares, e.g. a sliding window or soft-capping),
``flash_attn`` (40) when a FlashAttention generation is installed, else ``torch`` (10).
``triton`` ranks first because it measured faster on the H100 where it matters most:
serving Qwen3-0.6B at 32 requests/s, 6,521-6,664 output tokens/s against flashinfer's
4,101 (FlashInfer's host-side ``plan()`` runs on every mixed step), and W1/W2 (docs/gpu.md).
On the CPU, ``cpu`` (20) for float32 and bfloat16 (the reference with float32
decode-only steps and encoder steps in C kernels), else ``torch``. All five share one
KV-cache layout, ``[2, num_blocks,
block_size, num_kv_heads, head_size]``, and each is selectable by name (``--attention
torch|cpu|triton|flashinfer|flash_attn``). Only ``torch`` and ``cpu``
declare ``non_causal`` (bidirectional attention, for encoders such as BERT); ``torch``
and ``flashinfer`` declare ``logits_soft_cap`` (Gemma-2's attention-score soft-capping);
``triton``, ``torch`` and ``cpu`` declare ``fp8_kv_cache`` (``cache.kv_cache_dtype: fp8``,
K/V stored in float8 e4m3) and ``tree_mask`` (draft-tree attention, for speculative
decoding with a token tree; the others refuse a tree step when planned with one).

Each backend declares the ``attention_kind`` it serves: the five above ``"mha"``
(multi-head/grouped-query attention over per-head K/V); ``mla_torch`` (10, CPU and
CUDA), ``mla_triton`` (46) and ``mla_flashinfer`` (48, kv_lora_rank 512 + rope 64 only)
``"mla"`` (DeepSeek's multi-head latent attention over a latent cache, ``[num_blocks,
block_size, kv_lora_rank + qk_rope_head_dim]``). Models need one kind
(:class:`lmkit.api.ModelFacts` ``attention_needs``), so ``auto`` never picks an MLA
backend for Llama nor an MHA one for DeepSeek, and naming one is refused before the
weights load.
"""

from typing import Literal

from lmkit.api import Caps, Spec, hookimpl
from lmkit.api.mla_attention import MHA, MLA
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lmkit_plugins.attention.flash_attn_generations import CLAIMED_HEAD_SIZES, DTYPES, GENERATIONS
from lmkit_plugins.attention.mla_options import (
    MLAFlashInferAttentionOptions,
    MLATritonAttentionOptions,
)

LMKIT_PLUGIN_API = ">=1.0,<2"


class TritonAttentionOptions(BaseModel):
    """Options of the ``triton`` attention backend."""

    model_config = ConfigDict(extra="forbid")

    decode_num_splits: int | None = Field(
        None, description="Context slices per request in the decode kernel (a power of two "
        "up to 16); default: chosen from the batch shape and the number of SMs.")
    decode_tiles: tuple[int, int, int] | None = Field(
        None, description="For tuning: the decode kernel's (BLOCK_N, num_warps, "
        "num_stages), powers of two with BLOCK_N >= 16; default in half precision: 128, 8, "
        "2 for 64 or more requests with at most two query heads per KV head, else 64, 4, "
        "3 (128, 4, 2 over an FP8 cache).")
    decode_merge_in_kernel: bool = Field(
        True, description="Merge the decode kernel's context slices in the same launch "
        "(the last slice to finish merges, counted with atomics); false: a second kernel "
        "merges them.")

    @field_validator("decode_tiles")
    @classmethod
    def _tiles(cls, tiles: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
        if tiles is not None:  # (the kernels' own check; imported only when tiles are set)
            from lmkit_kernels.paged_attention import check_decode_tiles

            check_decode_tiles(tiles)
        return tiles


class FlashInferAttentionOptions(BaseModel):
    """Options of the ``flashinfer`` attention backend."""

    model_config = ConfigDict(extra="forbid")

    use_tensor_cores: bool | None = Field(
        None, description="Decode with FlashInfer's tensor-core kernels; default: when four "
        "or more query heads share a KV head.")
    workspace_mb: int = Field(128, gt=0, description="FlashInfer float workspace (MiB).")


class FlashAttnAttentionOptions(BaseModel):
    """Options of the ``flash_attn`` attention backend."""

    model_config = ConfigDict(extra="forbid")

    generation: Literal["auto", "fa4", "fa3", "fa2"] = Field(
        "auto", description="FlashAttention generation to run; auto: the first of fa4, fa3, "
        "fa2 that is installed and fits the device, head size and block size.")


@hookimpl
def register_attention_backends(register):
    register(Spec(
        name="torch", target="lmkit_plugins.attention.torch_ref:TorchAttention", priority=10,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill", "sliding_window",
             "non_causal", "logits_soft_cap", "fp8_kv_cache", "tree_mask"},
            {"device": {"cpu", "cuda"}, "dtype": {"float32", "bfloat16", "float16"},
             "attention_kind": {MHA}},
        ),
        description="Reference paged attention in plain torch (CPU and CUDA).",
    ))
    register(Spec(
        name="cpu", target="lmkit_plugins.attention.cpu_backend:CpuAttention", priority=20,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill", "sliding_window",
             "non_causal", "fp8_kv_cache", "tree_mask"},
            {"device": {"cpu"}, "dtype": {"float32", "bfloat16"}, "attention_kind": {MHA}},
        ),
        description="Reference paged attention with decode steps (float32) and encoder "
                    "steps (float32, bfloat16) in lmkit's C kernels (CPU).",
    ))
    register(Spec(
        name="triton", target="lmkit_plugins.attention.triton_backend:TritonAttention",
        priority=60, requires=("triton",), needs_cuda=True,
        options=TritonAttentionOptions,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill", "cuda_graphs",
             "fp8_kv_cache", "tree_mask"},
            {"device": {"cuda"}, "dtype": {"float32", "bfloat16", "float16"},
             "head_size": {64, 80, 96, 128, 256}, "attention_kind": {MHA}},
        ),
        description="lmkit's Triton paged attention: split-K decode, causal prefill (CUDA).",
    ))
    register(Spec(
        name="flashinfer", target="lmkit_plugins.attention.flashinfer_backend:FlashInferAttention",
        priority=55, requires=("flashinfer", "triton"), needs_cuda=True,
        options=FlashInferAttentionOptions,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill", "sliding_window",
             "cuda_graphs", "logits_soft_cap"},
            {"device": {"cuda"}, "dtype": {"bfloat16", "float16"}, "head_size": {64, 128, 256},
             "attention_kind": {MHA}},
        ),
        description="FlashInfer batch decode/prefill wrappers over the paged cache (CUDA).",
    ))
    register(Spec(
        name="flash_attn", target="lmkit_plugins.attention.flash_attn_backend:FlashAttnAttention",
        priority=40, requires=("triton",), needs_cuda=True, variants=GENERATIONS,
        options=FlashAttnAttentionOptions,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill", "sliding_window",
             "cuda_graphs"},
            {"device": {"cuda"}, "dtype": set(DTYPES), "head_size": set(CLAIMED_HEAD_SIZES),
             "attention_kind": {MHA}},
        ),
        description="FlashAttention varlen kernels over the paged cache, FA4 > FA3 > FA2 "
                    "(CUDA); ranked below flashinfer and triton under auto until measured.",
    ))
    register(Spec(
        name="mla_torch", target="lmkit_plugins.attention.mla_torch:MLATorchAttention",
        priority=10,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill"},
            {"device": {"cpu", "cuda"}, "dtype": {"float32", "bfloat16", "float16"},
             "attention_kind": {MLA}},
        ),
        description="Reference multi-head latent attention (DeepSeek-V2/V3) in plain torch: "
                    "absorbed decode over the latent cache, decompressed prefill (CPU, CUDA).",
    ))
    # MLA backends (multi-head latent attention, DeepSeek-V2/V3): only for models whose
    # needs say attention_kind=mla; on CUDA auto prefers mla_flashinfer, then mla_triton
    register(Spec(
        name="mla_triton", target="lmkit_plugins.attention.mla_triton:MLATritonAttention",
        priority=46, requires=("triton",), needs_cuda=True, options=MLATritonAttentionOptions,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill", "cuda_graphs"},
            {"device": {"cuda"}, "dtype": {"float32", "bfloat16", "float16"},
             "attention_kind": {MLA}},
        ),
        description="lmkit's Triton MLA: absorbed split-K decode over the latent cache, "
                    "decompressed causal prefill (CUDA).",
    ))
    register(Spec(
        name="mla_flashinfer",
        target="lmkit_plugins.attention.mla_flashinfer:MLAFlashInferAttention",
        priority=48, requires=("flashinfer", "triton"), needs_cuda=True,
        options=MLAFlashInferAttentionOptions,
        caps=Caps(
            {"multi_token_query", "prefix_caching", "chunked_prefill", "cuda_graphs"},
            # FlashInfer's MLA kernels: kv_lora_rank 512 + qk_rope_head_dim 64 only
            {"device": {"cuda"}, "dtype": {"bfloat16", "float16"}, "attention_kind": {MLA},
             "head_size": {576}},
        ),
        description="FlashInfer's MLA paged wrapper (absorbed form, kv_lora_rank 512 and "
                    "rope 64 only) over the latent cache (CUDA).",
    ))

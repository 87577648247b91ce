"""Options of the MLA attention backends (``mla_triton``, ``mla_flashinfer``).

Kept apart from the backends so that registering them imports only pydantic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class MLAAttentionOptions(BaseModel):
    """Options both MLA backends share."""

    model_config = ConfigDict(extra="forbid")

    absorbed_max_query_len: int = Field(
        8, ge=1, le=16, description="Requests with at most this many new tokens (decode, "
        "speculative verification) attend over the latent cache in the absorbed form; "
        "longer ones decompress their context to per-head keys and values (lmkit's Triton "
        "prefill kernel).")


class MLATritonAttentionOptions(MLAAttentionOptions):
    """Options of the ``mla_triton`` attention backend."""

    decode_num_splits: int | None = Field(
        None, description="Context slices per request in the MLA decode kernel (a power of "
        "two up to 64); default: chosen from the batch shape and the number of SMs.")
    decode_head_tile: int | None = Field(
        None, description="Query heads per MLA decode program (a power of two from 16 "
        "to 128); default: every head up to 16, else (float16, bfloat16) 64-row "
        "tiles over eight warps. Each tile reads the latent cache once.")

    @field_validator("decode_num_splits", "decode_head_tile")
    @classmethod
    def _power_of_two(cls, value: int | None, info) -> int | None:
        low, high = (1, 64) if info.field_name == "decode_num_splits" else (16, 128)
        if value is not None and (value < low or value > high or value & (value - 1)):
            raise ValueError(f"{info.field_name} must be a power of two in [{low}, {high}], "
                             f"got {value}")
        return value


class MLAFlashInferAttentionOptions(MLAAttentionOptions):
    """Options of the ``mla_flashinfer`` attention backend."""

    workspace_mb: int = Field(128, gt=0, description="FlashInfer float workspace (MiB).")
    backend: Literal["auto", "fa2", "fa3"] = Field(
        "auto", description="FlashInfer's MLA implementation: auto, fa2 or fa3 "
        "(BatchMLAPagedAttentionWrapper's backend argument).")

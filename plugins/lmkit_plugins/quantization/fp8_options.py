"""Options of the ``fp8`` quantization method (kept apart from the method so that
registering it imports no torch)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Fp8Options(BaseModel):
    """Options of the ``fp8`` quantization method."""

    model_config = ConfigDict(extra="forbid")

    gemv_max_rows: int = Field(
        16, ge=0, le=16, description="Projections of up to this many rows (decode batches) "
        "stream the FP8 weight through lmkit's Triton GEMV (weight-only FP8); larger ones "
        "quantize the activations per token and run torch._scaled_mm (W8A8). 0: always "
        "_scaled_mm.")
    gemv_block_n: int | None = Field(
        None, description="Output columns per program of the GEMV kernel (16, 32 or 64); "
        "default: 16 for projections of at most 2048 outputs, else 32 (as for bf16).")
    gemv_block_k: int = Field(
        512, description="Input columns per loop iteration of the GEMV kernel (a power of "
        "two from 64 to 4096).")
    gemv_num_warps: int = Field(
        4, description="Warps per program of the GEMV kernel (4 or 8).")
    gemv_num_stages: int = Field(
        4, ge=1, le=8, description="Pipeline stages of the GEMV kernel's weight loads "
        "(1-8; more stages need more shared memory).")
    gemv_row_kernel: bool = Field(
        True, description="One-row inputs (batch-1 decode) through the one-row FP8 kernel "
        "(lmkit_kernels.fp8_gemv: no tensor-core tile, many narrow programs) instead of "
        "the tiled GEMV.")
    gemv_row_tiles: tuple[int, int, int] = Field(
        (8, 1024, 4), description="The one-row kernel's launch: weight rows per program, "
        "K slice per iteration (powers of two) and warps (4 or 8); the default was the "
        "fastest over Llama-8B's four projections on an H100 (bench/gemv_bandwidth.py "
        "--fp8 --rows 1).")
    gemv_row_pipeline: bool = Field(
        False, description="The one-row kernel (and its folds of the input norm and "
        "SiLU-and-multiply) issues the loads of the next K slice before it multiplies the "
        "current one: two slices per program in flight; the same result "
        "(bench/gemv_bandwidth.py --fp8 --rows 1 times both). Needs gemv_row_kernel.")
    gemv_row_fold_block_n: int | None = Field(
        None, description="Weight rows per program of the one-row kernel with the input "
        "norm or SiLU-and-multiply folded in (a power of two up to 256; each program "
        "recomputes 1 / rms and the transform, so wider programs may pay); default: "
        "gemv_row_tiles' block_n. The products and their per-position sums stay the "
        "same; the final sum across the K slice may run in another order on the GPU "
        "(bench/gemv_fold.py --fp8 --fold-block-n times the choices; 16 is the widest "
        "that does not spill registers at block_k 1024 and 4 warps).")

    quantize_lm_head: bool = Field(
        False, description="Also quantize an untied LM head stored dense (lm_head.weight) "
        "at load: on Llama-3.1-8B 0.5 GB fewer bytes per decoded token, at the cost of FP8 "
        "error in the logits. A tied head (the embedding table) stays dense.")

    @field_validator("gemv_block_n")
    @classmethod
    def _block_n(cls, v: int | None) -> int | None:
        if v is not None and v not in (16, 32, 64):
            raise ValueError(f"must be 16, 32 or 64, got {v}")
        return v

    @field_validator("gemv_num_warps")
    @classmethod
    def _warps(cls, v: int) -> int:
        if v not in (4, 8):
            raise ValueError(f"must be 4 or 8, got {v}")
        return v

    @field_validator("gemv_row_tiles")
    @classmethod
    def _row_tiles(cls, v: tuple[int, int, int]) -> tuple[int, int, int]:
        block_n, block_k, warps = v
        for name, value, top in (("block_n", block_n, 256), ("block_k", block_k, 4096)):
            if value < 1 or value > top or value & (value - 1):
                raise ValueError(f"{name} must be a power of two up to {top}, got {value}")
        if warps not in (4, 8):
            raise ValueError(f"warps must be 4 or 8, got {warps}")
        return v

    @model_validator(mode="after")
    def _pipeline_needs_the_row_kernel(self) -> Fp8Options:
        if self.gemv_row_pipeline and not self.gemv_row_kernel:
            raise ValueError("gemv_row_pipeline is an option of the one-row kernel, which "
                             "gemv_row_kernel=false turns off; set gemv_row_kernel to true or "
                             "drop gemv_row_pipeline")
        return self

    @field_validator("gemv_row_fold_block_n")
    @classmethod
    def _fold_block_n(cls, v: int | None) -> int | None:
        if v is not None and (v < 1 or v > 256 or v & (v - 1)):
            raise ValueError(f"must be a power of two up to 256, got {v}")
        return v

    @field_validator("gemv_block_k")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 64 or v > 4096 or v & (v - 1):
            raise ValueError(f"must be a power of two from 64 to 4096, got {v}")
        return v

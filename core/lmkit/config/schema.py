"""The typed configuration: one pydantic model per section, validated at the boundary.

Each pluggable section has ``backend`` (``auto`` or a registered name) and ``options``,
which are validated against the chosen spec's options model when the stack is resolved.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lmkit.config.errors import origin_in

DEFAULT_MODEL = "smollm2-135m-instruct"


class Section(BaseModel):
    """Base of every config section: unknown fields are errors, assignments are validated,
    numbers are finite and never booleans (``block_size: true`` is not 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _is_number_type(field.annotation):
                raise ValueError("must be a number, not true/false")
        return v


def _is_number_type(annotation: Any) -> bool:
    """Whether ``annotation`` is ``int``/``float``, optionally ``| None``."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (
        typing.Union, types.UnionType) else (annotation,)
    return any(a in (int, float) for a in members) and bool not in members


class BackendSection(Section):
    """A section that selects a plugin implementation."""

    backend: str = Field("auto", description="'auto' or the name of a registered implementation.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Options for the chosen implementation."
    )

    @field_validator("backend")
    @classmethod
    def _lower(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("backend must not be empty; use 'auto' or a registered name")
        return v


class OptionalBackendSection(BackendSection):
    """A section whose feature is off unless a backend is named (``backend: none``)."""

    backend: str = Field("none", description="'none' (off), 'auto', or a registered name.")


class ModelConfig(Section):
    """Which model to run, where its files come from, and its numeric type."""

    model: str = Field(DEFAULT_MODEL, description="Model alias, local path, GGUF file or hub id.")
    source: str = Field("auto", description="Model source plugin, or 'auto' to detect.")
    tokenizer: str | None = Field(None, description=(
        "A local directory holding the tokenizer to use instead of the model's own (its "
        "chat template and EOS token too); checked before the model loads."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; 'auto' is bfloat16 on CUDA, and on "
        "the CPU float32, except bfloat16 for encoder (embedding) models on CPUs with "
        "hardware bfloat16 matmuls (AMX or AVX512-BF16).")
    max_model_len: int | None = Field(
        None, gt=0, description="Context length; defaults to the model's own."
    )
    seed: int = Field(0, ge=-(2**63), le=2**63 - 1,
                      description="Seed for requests that give none (a 64-bit integer).")
    cache_dir: str | None = Field(None, description="Where fetched and converted models live.")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="Where the weights come from: 'auto', the checkpoint; 'dummy', "
        "random weights of the config.json's shapes, no weight files read (benchmarks of "
        "shapes no checkpoint here holds).")


class CacheConfig(Section):
    """The paged KV cache: block size, prefix caching and how much memory it takes."""

    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks by content hash.")
    num_blocks: int | None = Field(None, gt=0, description="Fix the KV pool size in blocks.")
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description="KV pool size in GiB on CPU; default: room for max_num_seqs "
        "requests of max_model_len tokens, at most 5% of the machine's memory."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of GPU memory lmkit may use (model + KV cache)."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto", description="What the KV cache stores K/V in: 'auto' the model's dtype; 'fp8' "
        "(= 'fp8_e4m3') float8 e4m3 with per-tensor scales 1.0, half the bytes of bf16 "
        "(attention backends claiming fp8_kv_cache: triton, torch, cpu)."
    )
    kv_cache_scales: Literal["auto", "calibrate", "none"] = Field(
        "auto", description="An FP8 cache's per-layer scales: 'auto' the checkpoint's "
        "calibrated k_scale/v_scale when it has them, else 1.0 (as vLLM); 'calibrate' "
        "measured at load (one prefill of random tokens: no layer saturates); 'none' 1.0."
    )

    @property
    def fp8_kv_cache(self) -> bool:
        """Whether the KV cache stores float8 e4m3 (``kv_cache_dtype`` ``fp8`` or
        ``fp8_e4m3``)."""
        return self.kv_cache_dtype != "auto"

    @field_validator("block_size")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("must be a power of two, such as 16 or 32")
        return v


class SchedulerConfig(BackendSection):
    """The scheduler plugin and the per-step budgets every scheduler honours."""

    max_num_batched_tokens: int = Field(
        2048, gt=0, description="Token budget of one engine step (prefill chunks + decodes)."
    )
    max_num_seqs: int = Field(64, gt=0, le=65536, description=(
        "Most requests running at once (at most 65,536: the per-request state is "
        "allocated for all of them at start)."))
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")


class AttentionConfig(BackendSection):
    """The attention backend plugin (paged attention kernels)."""


class ExecutorConfig(BackendSection):
    """The executor plugin (how model workers run) and the device they run on."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; 'auto' picks CUDA when available."
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs.")
    piecewise_max_tokens: int = Field(
        2048, ge=0, description="Largest step (in tokens; at most "
        "scheduler.max_num_batched_tokens) run through piecewise CUDA graphs: mixed "
        "prefill+decode steps and prefill chunks replay the forward captured between "
        "attention calls, attention running eagerly in between. 0 turns them off.")
    flat_step_max_tokens: int = Field(
        64, ge=0, le=512, description="Steps of at most this many tokens (short prompts, "
        "small mixed steps) replay the decode CUDA graphs flattened, one decode row per "
        "token, instead of the piecewise graphs (whose eager attention call per layer "
        "costs more host time than such a step's GPU work), while the rows of its "
        "multi-token requests read at most 1,024 K/V positions per token. Decode graphs "
        "are captured up to this size. 0 turns it off.")


class ParallelConfig(Section):
    """Running one model on several devices (tensor parallel) and several engines (data
    parallel). Checked against the devices present and the model's head counts before
    any weights load (:mod:`lmkit.config.parallel`)."""

    tensor_parallel_size: int = Field(
        1, gt=0, description="Devices (ranks) one model is split over; each holds 1/N of the "
        "attention heads, the MLP and the vocabulary. Above 1 the executor is "
        "distributed_backend's (executor.backend 'auto').")
    data_parallel_size: int = Field(
        1, gt=0, description="Engine-core processes (data parallel), each with its own "
        "executor (tensor_parallel_size ranks) and, on CUDA, its own devices; requests are "
        "routed to one of them (load- and prefix-aware), by lmkit serve and by the "
        "offline LLM alike.")
    distributed_backend: Literal["mp", "ray"] = Field(
        "mp", description="How the ranks run: 'mp' (one worker process per rank on this "
        "host) or 'ray' (Ray actors: the cluster at RAY_ADDRESS, or a local one).")


class SpeculativeConfig(OptionalBackendSection):
    """Speculative decoding: the draft proposer plugin (off unless named) and k."""

    num_speculative_tokens: int = Field(4, gt=0, le=64, description="Draft tokens per step (k).")
    model: str | None = Field(
        None, description="Local directory of the draft head of a model-based proposer "
        "(eagle): safetensors weights and an HF-style config.json.")
    disable_by_batch_size: int | None = Field(
        None, gt=0, description="Propose no drafts after a step that ran more than this many "
        "requests (large batches are compute-bound: verifying drafts may cost more than it "
        "saves); unset: always speculate.")
    catch_up_when_off: bool = Field(
        True, description="With a draft head (eagle) and disable_by_batch_size: keep the "
        "head's KV cache complete while the batch is above the limit (one head pass per "
        "step), so that its requests draft again once the batch shrinks. false: a request "
        "that runs in a step above the limit stops drafting for good and the head does no "
        "work for it -- on a small target the head's pass costs a large share of a plain "
        "step.")
    device_step_max_requests: int = Field(
        32, ge=0, le=256, description="With a draft head on CUDA graphs: steps of at most "
        "this many requests run wholly on the device (accept, the head's catch-up and "
        "drafts, the next verification), one graph pair per request count (up to "
        "scheduler.max_num_seqs) captured at start; larger steps plan the head's passes "
        "on the host between steps. 0 turns device steps off.")
    adaptive: bool = Field(
        False, description="Measure decode throughput with and without drafts (8 decode "
        "steps each, every 256) and speculate only while drafts are faster, so that "
        "speculation never stays slower than plain decoding for long.")
    tree: list[list[int]] | None = Field(
        None, description="With a draft head (eagle, eagle3): draft a token tree per step, "
        "its nodes' rank paths ([[0], [1], [0, 0]]: the head's top two drafts, then its top "
        "one after the first; JSON text too), verified in one pass; num_speculative_tokens "
        "becomes the node count. Needs the tree_mask attention feature (cpu, torch, triton).")

    @field_validator("tree", mode="before")
    @classmethod
    def _tree_paths(cls, v: Any) -> Any:  # JSON text too; kept breadth-first
        from lmkit.spec_decode.tree import tree_paths
        return None if v is None else tree_paths(v)

    @model_validator(mode="after")
    def _tree_sets_k(self) -> SpeculativeConfig:
        if self.tree is not None:
            k, n = self.num_speculative_tokens, len(self.tree)
            if "num_speculative_tokens" in self.model_fields_set and k != n:
                raise ValueError(f"num_speculative_tokens is {k} but the tree has {n} nodes")
            self.__dict__["num_speculative_tokens"] = n
        return self


class StructuredOutputConfig(OptionalBackendSection):
    """Constrained decoding (JSON schema, regex, grammar): the backend plugin; on when one
    is installed."""

    backend: str = Field("auto", description="'none', 'auto', or a registered name.")
    compile_timeout_s: float = Field(
        30.0, gt=0, description="Longest a grammar may take to compile (from when a compile "
        "thread starts on it); past it the request is refused (400) and the compilation is "
        "abandoned.")
    num_compile_threads: int = Field(
        2, gt=0, le=64, description="Grammars compiled at once, off the engine's step loop.")
    grammar_cache_size: int = Field(
        256, ge=0, description="Compiled grammars kept for reuse (least recently used out; 0 "
        "disables the cache).")
    grammar_cache_mb: float = Field(
        512.0, ge=0, description="Memory the grammar cache may hold, as the backend reports "
        "it (0: no limit but grammar_cache_size).")
    max_constraint_chars: int = Field(
        32768, gt=0, description="Longest constraint (JSON schema, regex, grammar, choices; "
        "counted as compact JSON text) a request may carry; longer ones are refused (400) "
        "before compiling, since compile time grows faster than the size.")


class OffloadConfig(OptionalBackendSection):
    """KV-cache offload to a slower tier (CPU memory, disk): the tier plugin, off unless named."""

    store_policy: Literal["write_through", "on_evict"] = Field(
        "write_through", description="When blocks go to the tier: 'write_through' (right "
        "after the step computing them, so evictions copy nothing) or 'on_evict'.")


class QuantizationConfig(OptionalBackendSection):
    """Quantized weights: the method plugin that keeps a checkpoint's quantized tensors
    packed and computes with them (``auto``: the one that reads the checkpoint's format
    on this device, e.g. GGUF blocks on the CPU; ``none``, the default: dense weights).

    Off by default because the gguf method's outputs depend on batch composition (steps
    of up to 32 rows quantize activations to int8, larger ones use float32 tiles), so a
    request's greedy output could change with the load; dense weights match
    transformers and are batch-invariant."""

    backend: str = Field("none", description="'none' (dense weights, the default), 'auto' "
                         "(the method reading the checkpoint's format), or a registered "
                         "name such as 'gguf'.")


class SamplingKernelsConfig(OptionalBackendSection):
    """The kernels the sampler draws random tokens with (``auto``: the highest-priority
    set that runs on this device: ``triton`` on CUDA, ``torch`` elsewhere; ``none``: the
    core's torch ones, no plugin; see docs/gpu.md, "Sampling kernels")."""

    backend: str = Field("auto", description="'auto', 'none' (the core's torch kernels), "
                         "or a registered name such as 'torch' or 'triton'.")


class LogitsProcessorsConfig(Section):
    """Plugin logits processors (``register_logits_processors``): those applied to every
    request, and each processor's options. Requests name others in
    ``logits_processors``."""

    enable: list[str] = Field(
        default_factory=list, description="Logits processors applied to every request, "
        "in order (names from `lmkit plugins list --kind logits_processor`).")
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Options per processor name, validated against "
        "that processor's options model.")


class ServerConfig(Section):
    """The OpenAI-compatible HTTP server (`lmkit serve`)."""

    host: str = Field("127.0.0.1", min_length=1, description=(
        "Bind address; loopback unless told otherwise (0.0.0.0: every interface)."))
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, description="Bearer key required on every route but /health "
                                "(prefer LMKIT_API_KEY or api_key_file: flags show in `ps`).")
    api_key_file: str | None = Field(None, description="Read the bearer key from this file "
                                     "(first line) instead of api_key.")
    cors_origins: list[str] = Field(default_factory=list, description="CORS allow-list; off if empty.")
    served_model_name: str | None = None
    max_queued_requests: int = Field(1024, gt=0, description="Beyond this, answer 429.")
    max_request_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    max_sequences_per_request: int = Field(
        256, gt=0, description="Most sequences one request may ask for (prompts x n); past "
        "it the request is refused at once with 400 before any tokenization. Capped at what "
        "the server admits at once (scheduler.max_num_seqs + max_queued_requests).")
    max_response_logprobs: int | None = Field(
        4_000_000, gt=0, description="Most log-probability entries one response may carry "
        "(sequences x tokens x (1 + alternatives), generated and echoed prompt tokens, the "
        "worst case allowed by max_tokens or the context); a request that could exceed it "
        "is refused at once with 400. 4,000,000 (~120 MB of completions JSON, ~310 MB of "
        "chat JSON, ~0.5 GB of engine output in the API process) covers a whole 128k-token "
        "context with 20 alternatives, or 256 echoed 4k-token prompts with 1; null: no limit.")
    engine_restart_attempts: int = Field(
        3, ge=0, description="Times in a row the server restarts a dead engine process "
        "(waiting engine_restart_backoff_s, doubled after each failed try) before it exits "
        "with status 1 for a supervisor to restart it; 0: exit at once.")
    engine_restart_backoff_s: float = Field(
        1.0, gt=0, le=60, description="Wait before the first restart of a dead engine.")
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field(
        "auto", description="The API process's event loop. auto: uvloop when installed "
        "(`pip install 'lmkit[fast-serve]'`; less CPU per streamed token), asyncio's otherwise.")
    http: Literal["auto", "h11", "httptools"] = Field(
        "auto", description="uvicorn's HTTP implementation. auto: httptools when installed "
        "(the fast-serve extra), h11 otherwise.")

    @model_validator(mode="after")
    def _one_key_source(self) -> ServerConfig:
        if self.api_key and self.api_key_file:
            raise ValueError("api_key and api_key_file are both set; give the key one way")
        return self


class LMKitConfig(Section):
    """The whole configuration. Precedence: CLI flags > environment > file > defaults."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    sampling_kernels: SamplingKernelsConfig = Field(default_factory=SamplingKernelsConfig)
    logits_processors: LogitsProcessorsConfig = Field(default_factory=LogitsProcessorsConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    plugins: list[str] = Field(
        default_factory=list,
        description="Extra plugins to load (-p NAME), or block (no:NAME). Adds up across "
        "file, environment and CLI instead of being replaced.",
    )

    @field_validator("plugins")
    @classmethod
    def _plugin_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name.strip() or name.strip() == "no:":
                raise ValueError(f"{name!r} is not a plugin name; give NAME to load a plugin "
                                 "or no:NAME to block one")
        return v

    # dotted path -> (layer, label) for every value set by a file, variable or flag;
    # filled by lmkit.config.load_config. Metadata only: not part of equality.
    _origins: dict[str, tuple[str, str]] = PrivateAttr(default_factory=dict)

    def source_of(self, path: str) -> str | None:
        """Where the value at dotted ``path`` came from, e.g. ``"config file 'lmkit.yaml',
        line 4"`` or ``"environment variable LMKIT_ATTENTION__BACKEND"``; ``None`` for a
        default (or a config not built by :func:`lmkit.config.load_config`)."""
        found = origin_in(self._origins, path)
        return found[1] if found else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LMKitConfig):
            return NotImplemented
        return self.model_dump() == other.model_dump()

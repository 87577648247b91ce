"""The lmkit hook specifications: the plugin author's reference.

A plugin is a module (or object) with functions marked ``@lmkit.hookimpl`` whose names
match the hooks below, plus a module attribute declaring the plugin API versions it
supports::

    import lmkit
    from lmkit.api import Spec, Caps

    LMKIT_PLUGIN_API = ">=1.0,<2"

    @lmkit.hookimpl
    def register_attention_backends(register):
        register(Spec(name="mine", target="my_pkg.backend:MyBackend",
                      caps=Caps({"multi_token_query"}, {"device": {"cuda"}}),
                      requires=("my_kernels",), needs_cuda=True, priority=50))

Publish it through the ``lmkit`` entry-point group of your package::

    [project.entry-points.lmkit]
    mine = "my_pkg.plugin"

There are three families of hooks:

* **Contribution hooks** (``register_*``) receive a ``register(spec)`` callback. They run
  once per plugin manager, in every process that builds one, so they must be idempotent
  and free of side effects: build :class:`~lmkit.api.Spec` objects and pass them on,
  never import CUDA libraries (the spec's ``target`` is loaded lazily).
* **Decision hooks** (``firstresult=True``) are consulted only when the user left a
  choice to lmkit (``backend: auto``). Return ``None`` to abstain.
* **Lifecycle hooks** run at engine-step granularity or coarser, never per layer or
  per token; the hot path calls resolved objects, not the plugin manager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from lmkit.api.engine_view import EngineView
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.plugin_host.registry import Registration
    from lmkit.plugin_host.spec import Needs, Spec

PROJECT = "lmkit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[["Spec"], None]


# --------------------------------------------------------------------------------------
# Contribution hooks
# --------------------------------------------------------------------------------------


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduler implementations.

    The loaded target is a subclass of :class:`lmkit.api.Scheduler` (usually of
    :class:`lmkit.api.PagedScheduler`, overriding only the queueing policy). It is
    built as ``cls(config, *, num_blocks, options)`` where ``config`` is the engine's
    :class:`~lmkit.config.LMKitConfig` and ``options`` an instance of the spec's
    options model.

    :param register: call ``register(Spec(...))`` once per implementation.
    """


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends.

    The loaded target is a subclass of :class:`lmkit.api.AttentionBackend`, built by
    the model as ``cls(*, num_heads, num_kv_heads, head_size, scale, dtype, device,
    block_size, sliding_window, options)``; a backend that lets the model write K/V
    itself declares ``supports_model_kv_write = True`` on the class. Declare in
    ``caps`` what it supports: ``values={"device": {...}, "dtype": {...},
    "head_size": {...}}`` and features such as ``"multi_token_query"`` (several query
    tokens per decoding request, needed by speculative decoding) and ``"cuda_graphs"``.
    Use ``needs_cuda=True`` and ``requires=("flashinfer",)`` for availability, so that
    ``lmkit plugins list`` explains why it is unavailable instead of failing.

    :param register: call ``register(Spec(...))`` once per backend.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors (how model workers are started and driven).

    The loaded target is a subclass of :class:`lmkit.api.Executor`, built as
    ``cls(config, stack, *, options, host, facts)`` (``facts``: the engine's
    :class:`lmkit.api.ModelFacts`). Declare ``caps.values["device"]``.

    :param register: call ``register(Spec(...))`` once per executor.
    """


@hookspec
def register_spec_proposers(register: Register) -> None:
    """Register speculative-decoding proposers (draft-token sources): the kind
    ``speculative``, selected by the config section and the ``--speculative`` flag of
    that name.

    The loaded target is a subclass of :class:`lmkit.api.SpecProposer` (token ids, run
    in the engine core) or, for a proposer declaring ``"hidden_states"`` or
    ``"own_kv_cache"`` in ``caps``, of :class:`lmkit.api.RunnerProposer` (a draft head
    run in the model runner next to the target), built as ``cls(config, *, options)``.
    Verification is done by the core, so a proposer only proposes. Declare what it
    needs of the rest of the stack in ``stack_needs`` (usually ``{"attention":
    Needs({"multi_token_query"})}``) and its own abilities in ``caps``
    (``"hidden_states"``, ``"own_kv_cache"``, ``values={"max_k": ...}``).

    :param register: call ``register(Spec(...))`` once per proposer.
    """


@hookspec
def register_structured_output_backends(register: Register) -> None:
    """Register structured-output (constrained decoding) backends.

    The loaded target is a subclass of :class:`lmkit.api.StructuredOutputBackend`,
    built as ``cls(tokenizer, vocab_size, *, options)``. Declare the constraint types it handles as features: ``json_schema``,
    ``json_object``, ``regex``, ``grammar``, ``choice``, ``structural_tag``.

    :param register: call ``register(Spec(...))`` once per backend.
    """


@hookspec
def register_offload_managers(register: Register) -> None:
    """Register KV-cache offload tiers.

    The loaded target is a subclass of :class:`lmkit.api.OffloadManager`, built as
    ``cls(config, kv_caches, *, options)``, that stores and loads KV blocks by content
    hash below the device cache (CPU memory, disk, ...).

    :param register: call ``register(Spec(...))`` once per tier.
    """


@hookspec
def register_quantization_methods(register: Register) -> None:
    """Register quantized-weight methods (the kind ``quantization``, selected by the
    config section and the ``--quantization`` flag of that name).

    The loaded target is a subclass of :class:`lmkit.api.QuantizationMethod`,
    built as ``cls(facts, *, options)`` (``facts``: the model's
    :class:`lmkit.api.model_facts.ModelFacts`): it checks a checkpoint's quantized tensors before
    anything runs, yields the model's weights with the quantized ones kept packed, and
    gives the model's linear layers the kernels that compute with them. Declare in
    ``caps``: ``values={"weight_format": {...}, "device": {...}}`` (the checkpoint
    formats it reads, such as ``"gguf"``, and the devices it runs on) and as features the
    tensor types it reads (``"Q4_1"``) and its kernels (``"kernel:q8_dot_avx2"``).
    ``auto`` picks one whose ``weight_format`` and ``device`` fit the checkpoint and the
    device, and leaves the weights dense when none does, or when the checkpoint is dense
    (``"safetensors"``: no ``quantization_config``): a method that quantizes dense
    weights at load (``fp8``) runs when named. Declare ``values={"dtype": {...}}`` for
    the model dtypes it computes in (float32 when not declared).

    :param register: call ``register(Spec(...))`` once per method.
    """


@hookspec
def register_sampling_kernels(register: Register) -> None:
    """Register sampling kernels (the kind ``sampling_kernels``, selected by the config
    section and the ``--sampling-kernels`` flag of that name): the device code the
    sampler draws random tokens with.

    The loaded target is a subclass of :class:`lmkit.api.SamplingKernels` (usually of
    :class:`lmkit.api.TorchSamplingKernels`, the core's default, registered as
    ``torch``), built once per engine as ``cls(*, device, options)``. The sampler
    calls its ``sample(logits, rows)`` for a step's random draws and its
    ``verify(probs, rows, drafts, draft_probs)`` for rejection sampling of drafts,
    after every logit adjustment (bias, bans, penalties, logits processors, grammar
    bitmask); greedy rows and logprobs stay the sampler's. Hand what the kernels do not
    serve exactly (a seeded request's rows, filters they lack) or do not serve faster
    (shapes, measured) back to ``super()``. Declare the devices it runs on in
    ``caps``: ``values={"device": {"cuda"}}``; ``auto`` picks the highest-priority set
    that fits the device (``torch``, priority 0, fits every device), and naming one
    whose device does not fit is refused with that reason.

    :param register: call ``register(Spec(...))`` once per kernel set.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures.

    ``Spec.name`` and ``Spec.aliases`` are Hugging Face ``architectures`` names (e.g.
    ``"LlamaForCausalLM"``); the engine picks the first of the model config's
    ``architectures`` that a spec names. The loaded target subclasses both
    :class:`torch.nn.Module` and :class:`lmkit.api.CausalLM` and is built as
    ``cls(hf_config, ctx)``; its optional classmethod ``attention_needs(hf_config)``
    declares what it needs of the attention backend.

    :param register: call ``register(Spec(...))`` once per architecture family.
    """


@hookspec
def register_model_sources(register: Register) -> None:
    """Register places model weights come from (local directories, GGUF files, hubs).

    The loaded target subclasses :class:`lmkit.api.ModelSource` and is built as
    ``cls()``: ``matches(ref)`` says whether it understands a model reference and
    ``fetch(ref, cache_dir)`` returns local files; the optional ``known_refs()`` names
    the references it knows. Sources are tried in priority order; the first that
    matches wins.

    :param register: call ``register(Spec(...))`` once per source.
    """


@hookspec
def register_logits_processors(register: Register) -> None:
    """Register logits processors (batch-level changes to the logits before sampling).

    The loaded target is a subclass of :class:`lmkit.api.LogitsProcessor`, constructed
    once per engine as ``cls(ctx, options)`` (``ctx`` a
    :class:`~lmkit.api.LogitsProcessorContext`: vocabulary size, number of request
    slots, device; ``options`` the validated instance of the spec's options model, from
    the config's ``logits_processors.options[name]``). Requests select it by name in
    ``SamplingParams.logits_processors`` (their arguments in ``extra_args``); the
    config's ``logits_processors.enable`` applies it to every request. It sees the
    whole step's logits and per-row request slots and must not loop over requests in
    Python in :meth:`~lmkit.api.LogitsProcessor.apply`.

    :param register: call ``register(Spec(...))`` once per processor.
    """


@hookspec
def register_poolers(register: Register) -> None:
    """Register poolers: how a pooling request's prompt hidden states become its output
    (an embedding, class probabilities). Requests name one with
    ``PoolingParams.pooling_type`` (``"pooling_type"`` on ``/v1/embeddings``); a model's
    ``pooling = ModelPooling(default_pooler=...)`` names its default.

    The loaded target is a subclass of :class:`lmkit.api.Pooler`, constructed once per
    engine as ``cls(model)``; it folds each prefill chunk into a per-request state
    (``start``, ``accumulate``, ``finish``), so chunked prefill pools exactly as one
    step would. Built-ins: ``last``, ``mean``, ``cls``, ``all`` and ``classify``.

    :param register: call ``register(Spec(...))`` once per pooler.
    """


@hookspec
def register_commands(app: Any) -> None:
    """Add sub-commands to the ``lmkit`` CLI.

    :param app: the root :class:`typer.Typer`; call ``app.command()(fn)`` or
        ``app.add_typer(sub_app, name=...)``. Import heavy libraries inside the command
        function, not at module level, so that ``lmkit --help`` stays fast.
    """


# --------------------------------------------------------------------------------------
# Decision hooks
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def choose_implementation(
    kind: str, candidates: Sequence[Registration], needs: Needs
) -> str | None:
    """Pick one implementation among ``candidates`` when the user asked for ``auto``.

    Only candidates with no reasons against them are passed, best priority first.
    The first non-``None`` answer wins; if every plugin abstains, the candidate with the
    highest priority is taken. Returning a name that is not among ``candidates`` is an
    error.

    :param kind: the extension point, one of ``lmkit.plugin_host.kinds.STACK_KINDS``
        (``"attention"``, ``"speculative"``, ...), named as its config section.
    :param candidates: the eligible registrations (``.name``, ``.spec``, ``.plugin``).
    :param needs: what the configuration needs of this kind.
    :return: the chosen name, or ``None`` to abstain.
    """


# --------------------------------------------------------------------------------------
# Lifecycle hooks
# --------------------------------------------------------------------------------------


@hookspec
def configure(config: Any) -> None:
    """Called once the configuration is loaded and validated, before the stack is
    resolved. Read-only: use it to check settings your plugin cares about and raise
    :class:`lmkit.errors.ConfigError` on a problem.

    :param config: the effective :class:`~lmkit.config.LMKitConfig`.
    """


@hookspec
def engine_started(engine: EngineView) -> None:
    """Called once the engine core has loaded the model and allocated the KV cache.

    :param engine: a read-only :class:`~lmkit.api.EngineView` of the engine core:
        ``engine.stack`` is the resolved stack, ``engine.config`` a copy of the runtime
        configuration, ``engine.model_info`` the model's facts and ``engine.stats()``
        its counters. The same view is passed to every lifecycle hook of this engine.
    """


@hookspec(firstresult=True)
def engine_step(engine: EngineView) -> list[EngineCoreOutput] | None:
    """Wraps one engine step (schedule, execute, update). Implement it as a wrapper
    (``@lmkit.hookimpl(wrapper=True)``): ``yield`` to run
    the step and receive its outputs (a list of
    :class:`~lmkit.api.EngineCoreOutput`); return them.

    :param engine: the read-only :class:`~lmkit.api.EngineView` (see ``engine_started``).

    Keep it cheap: it runs once per step, on the engine's busy loop::

        @lmkit.hookimpl(wrapper=True)
        def engine_step(engine):
            t0 = time.perf_counter()
            outputs = yield
            record(time.perf_counter() - t0)
            return outputs
    """


@hookspec
def engine_stopped(engine: EngineView) -> None:
    """Called once when the engine core shuts down (normally or after an error).

    :param engine: the read-only :class:`~lmkit.api.EngineView` (see ``engine_started``);
        ``engine.stats()`` still answers with the final counters.
    """

"""What a model architecture plugin implements, and what it is given."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from lmkit.api.pooling import ClassifierHead, ModelPooling

if TYPE_CHECKING:
    import torch

    from lmkit.api.attention import AttentionBackend
    from lmkit.api.kv_cache_spec import KVCacheGroup, KVCacheSpec
    from lmkit.plugin_host.spec import Needs


def kv_heads_of_rank(num_kv_heads: int, rank: int, size: int) -> range:
    """The key/value heads rank ``rank`` of a ``size``-rank tensor-parallel group holds.

    Heads are dealt out in whole KV groups (a KV head with the query heads that read it),
    contiguously and as evenly as the count allows: when ``num_kv_heads`` is not a
    multiple of ``size`` the first ``num_kv_heads % size`` ranks hold one group more
    (SmolLM2's 3 KV heads over 2 ranks: heads 0-1 and 2). KV heads are not replicated,
    so every rank needs at least one (``num_kv_heads >= size``).

    :raises ValueError: fewer KV heads than ranks, or a rank outside the group.
    """
    if not 0 <= rank < size or num_kv_heads < size:
        raise ValueError(f"cannot give rank {rank} of {size} a share of {num_kv_heads} "
                         "key/value heads (each rank needs at least one)")
    base, extra = divmod(num_kv_heads, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass
class ModelBuildContext:
    """Given to a model's constructor: how to build its attention layers, and its share
    of a tensor-parallel group.

    With ``tp_size > 1`` the model builds rank ``tp_rank``'s shard (its attention heads,
    KV heads, MLP columns and vocabulary rows), loads only that slice of each weight,
    and combines partial results over ``tp_group`` (a ``torch.distributed`` process
    group, initialised by the executor: gloo on the CPU, NCCL on CUDA). With
    ``tp_size == 1`` (the default) there is no group and the model runs no collective.
    The engine checks the split before any weights load with the rule of
    :func:`kv_heads_of_rank` (``kv_heads_of_rank(num_kv_heads, tp_rank, tp_size)``: whole
    KV groups per rank, the first ranks one more when the KV heads do not divide by the
    size), so a model must shard its heads by it.
    """

    dtype: Any  # torch.dtype
    device: Any  # torch.device
    block_size: int
    attention_cls: type[AttentionBackend]
    attention_options: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # torch.distributed.ProcessGroup when tp_size > 1
    # the chosen quantization method (a QuantizationMethod), or None for dense weights
    quantization: Any = None
    #: the dtype the KV cache stores K/V in (``cache.kv_cache_dtype``): ``None`` for the
    #: model's ``dtype``, ``torch.float8_e4m3fn`` for ``fp8``. Models pass it to every
    #: attention backend they build (``kv_cache_dtype=ctx.kv_cache_dtype``); the runner
    #: refuses a model whose backends store another dtype.
    kv_cache_dtype: Any = None

    def model_may_write_kv(self) -> bool:
        """Whether the model may store K/V in its own kernels (fused with RoPE) and call
        ``run(..., kv_written=True)``: the backend declares
        :attr:`~lmkit.api.AttentionBackend.supports_model_kv_write` and the cache stores
        the model's dtype (an FP8 cache is written by the backend, which quantizes)."""
        return (self.attention_cls.supports_model_kv_write
                and self.kv_cache_dtype in (None, self.dtype))


@dataclass
class ForwardContext:
    """Given to ``forward`` each step: the planned attention backend and the KV caches.

    ``aux_hidden_layers``: for a model that declares
    :attr:`CausalLM.supports_draft_heads`, the layers whose *input* (the residual stream
    entering layer ``i``: the embeddings for layer 0) the model appends to
    ``aux_hidden_states``, ``[num_tokens, hidden]`` each, in this order. An EAGLE-3 draft
    head reads three of them; empty (the default) asks for nothing.

    ``attn`` is the backend the model built, or, while piecewise CUDA graphs of a mixed
    step are captured or replayed (:mod:`lmkit.worker.piecewise_graphs`), a stand-in for
    it: its ``run``/``run_mla`` and ``kv_write_slots`` and the backend's data attributes
    work as the backend's; calling any other method of it inside ``forward`` makes the
    runner run mixed steps eagerly. Models must not check its type, and must be done
    with an attention call's output before the next attention call (the stand-in's
    outputs share one buffer).
    """

    attn: AttentionBackend
    kv_caches: list[torch.Tensor]
    aux_hidden_layers: tuple[int, ...] = ()
    aux_hidden_states: list[torch.Tensor] = field(default_factory=list)


class Model(ABC):
    """What every model architecture plugin implements: packed tokens (no batch axis) in,
    final hidden states out. A model subclasses one of its two kinds:
    :class:`CausalLM` (it has a language-model head and generates text, and may also
    pool) or :class:`PoolingModel` (no language-model head: it serves pooling requests
    only, e.g. a BERT encoder or a decoder exported without its head).

    Constructor (the one signature the model runner uses)::

        cls(hf_config, ctx: ModelBuildContext)

    ``hf_config`` is the model directory's ``config.json`` (a transformers
    ``PretrainedConfig``). The model must create one attention backend instance
    (``ctx.attention_cls(...)``, see :class:`~lmkit.api.AttentionBackend`) and expose it
    as ``self.attn`` so the runner can plan it once per step. A model whose layers cache
    differently (sliding-window and full-attention layers) declares its layers'
    :meth:`kv_cache_specs`, builds one backend per KV cache group
    (:func:`~lmkit.api.build_kv_cache_groups`) and returns them from
    :meth:`kv_cache_groups`; ``self.attn`` is then its first group's. Model classes usually
    subclass ``torch.nn.Module`` too: ``class MyModel(torch.nn.Module, CausalLM)``.

    A model that sets the class attribute ``supports_tensor_parallel = True`` builds its
    shard from :class:`ModelBuildContext`'s ``tp_*`` fields; for any other the runner
    refuses ``tensor_parallel_size > 1``.

    Declared facts (class attributes, read without building the model):

    * :attr:`pooling`: how the model pools (its default pooler, whether its attention
      is causal, its classification head), a :class:`~lmkit.api.ModelPooling`.
    * :attr:`supports_tensor_parallel`: see above.
    * :attr:`supports_uneven_tensor_parallel`: the model also splits key/value heads that
      do not divide by the size (:func:`kv_heads_of_rank`); for any other
      the runner refuses such a size.
    """

    attn: AttentionBackend
    #: How the model serves pooling requests. The default: causal attention, the
    #: ``last`` token's hidden state, no classification head.
    pooling: ClassVar[ModelPooling] = ModelPooling()
    #: the model builds rank ``ctx.tp_rank``'s shard when ``ctx.tp_size > 1``
    supports_tensor_parallel: ClassVar[bool] = False
    #: the model shards its heads by :func:`kv_heads_of_rank` also when
    #: the KV heads do not divide by ``ctx.tp_size`` (some ranks hold one group more)
    supports_uneven_tensor_parallel: ClassVar[bool] = False

    @classmethod
    def attention_needs(cls, hf_config: Any) -> Needs:
        """What the model needs of the attention backend, known from its config alone
        (e.g. ``Needs({"sliding_window"})``); stack resolution then refuses or avoids
        backends that lack it, before weights load. The head size is added by lmkit,
        and ``attention_kind="mha"`` unless this returns another kind (an MLA model
        returns ``Needs(values={"attention_kind": "mla", "head_size": ...})``, see
        :class:`~lmkit.api.MLAAttentionBackend`), and ``non_causal`` when :attr:`pooling` says the attention is bidirectional.
        Optional: the default needs nothing."""
        from lmkit.plugin_host.spec import Needs

        return Needs()

    @classmethod
    def kv_cache_specs(cls, hf_config: Any) -> tuple[KVCacheSpec, ...] | None:
        """Each layer's :class:`~lmkit.api.KVCacheSpec`, known from the config alone, for
        a model whose layers do not all cache alike; lmkit adds what the specs need of
        the attention backend (:meth:`~lmkit.api.KVCacheSpec.needs`) to
        :meth:`attention_needs`, so a backend that cannot serve one of the groups is
        refused before weights load. ``None`` (the default): every layer has the spec
        of the one backend ``self.attn``."""
        return None

    def kv_cache_groups(self, num_layers: int) -> tuple[KVCacheGroup, ...]:
        """The model's KV cache groups (layers with equal specs, each with the backend
        built for it); the runner allocates each layer's cache from its group's backend
        and plans every group's backend once per step. The default: one group, all
        ``num_layers`` layers on ``self.attn``. A model that overrides
        :meth:`kv_cache_specs` returns the groups it built, in the specs' layer order."""
        from lmkit.api.kv_cache_spec import one_kv_cache_group

        return one_kv_cache_group(self.attn, num_layers)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (fusing QKV and gate-up as needed); return the names used."""


class CausalLM(Model):
    """A decoder-only language model: a :class:`Model` with a language-model head, so
    it generates (and pools, by its declared :attr:`~Model.pooling`).

    A model that declares :attr:`supports_draft_heads` exposes its input embedding
    (:meth:`embed_input_ids`), its final hidden states (those ``forward`` returns and
    ``compute_logits`` reads) and the inputs of chosen layers
    (:attr:`ForwardContext.aux_hidden_layers`) to draft heads (EAGLE, EAGLE-3:
    :class:`~lmkit.api.RunnerProposer`).
    """

    #: the model implements :meth:`embed_input_ids` (draft heads may share it)
    supports_draft_heads: ClassVar[bool] = False

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids -> ``[n, hidden]`` input embeddings; only for models that
        declare :attr:`supports_draft_heads`."""
        raise NotImplementedError(
            f"{type(self).__name__}.embed_input_ids() called, but the model does not "
            "declare supports_draft_heads; declare it and implement embed_input_ids()")

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab_size]``."""

    def compute_greedy_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> logits ``[n, vocab_size]`` read only by an argmax: each row's
        first maximal index must be that of :meth:`compute_logits`' row (NaNs included).

        The engine calls it for the greedy steps it launches ahead (decode steps,
        speculative verifications), which read nothing but the argmax. Optional: the
        default is :meth:`compute_logits`. A model whose float32 logits are its head's
        output converted exactly (bfloat16 or float16 to float32 keeps every value and
        their order) may return that output unconverted, saving the conversion's read and
        write of ``n x vocab`` values per step; a model that transforms its logits after
        the head (e.g. soft-capping, which can round distinct values together in half
        precision) keeps the default. Added in plugin API 1.11.
        """
        return self.compute_logits(hidden_states)


class PoolingModel(Model):
    """A :class:`Model` without a language-model head: it serves pooling requests only
    (embeddings, scores, classes); the engine refuses generation requests to it when
    they arrive. A model with a classification head declares
    ``pooling = ModelPooling(classifier_pooler=...)``, implements :meth:`classify` and
    sets :attr:`classifier_head` from its config (``ClassifierHead.from_hf``)."""

    #: what the head's logits mean (labels, ``problem_type``: the activation the
    #: ``classify`` pooler applies); ``None``: inferred from the number of labels
    classifier_head: ClassifierHead | None = None

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` (the classifier pooler's output) -> logits ``[n, num_labels]``;
        only for models whose :attr:`~Model.pooling` declares a ``classifier_pooler``."""
        raise NotImplementedError(
            f"{type(self).__name__}.classify() called, but the model declares no "
            "classification head (pooling.classifier_pooler is None); declare one and "
            "implement classify(), or do not use the 'classify' pooler with it")

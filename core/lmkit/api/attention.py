"""The AttentionBackend contract and the per-step metadata it is planned with."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


#: the largest finite float8 e4m3 value: an FP8 KV cache saturates larger magnitudes
#: (of ``k / k_scale``) to it
FP8_KV_MAX = 448.0

#: the names (suffixes, key then value, in pairs) under which checkpoints calibrated for
#: an FP8 KV cache store a layer's key and value scales (llm-compressor / ModelOpt, and
#: older exports); not weights: the runner reads them (``cache.kv_cache_scales``) and
#: model loaders skip them
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.k_proj.output_scale",
                     "self_attn.v_proj.output_scale")


def is_fp8_kv_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is the float8 e4m3 dtype an FP8 KV cache is stored in
    (``torch.float8_e4m3fn``; compared by name, so the contract imports no torch)."""
    return str(dtype) == "torch.float8_e4m3fn"


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once per step by the model runner.

    Tokens of all requests are packed along one axis, request after request.
    Device tensors (on the model's device):

    * ``query_start_loc``: int32 ``[num_reqs + 1]`` (``cu_seqlens_q``).
    * ``seq_lens``: int32 ``[num_reqs]``, context length after this step's tokens.
    * ``block_tables``: int32 ``[num_reqs, max_num_blocks_per_req]``.
    * ``slot_mapping``: int64 ``[num_tokens]``, cache slot of each new token
      (``block_id * block_size + offset``).

    Host copies (``*_cpu``) serve planning without a device sync.

    ``cuda_graph`` is ``True`` when the step's :meth:`AttentionBackend.run` calls are
    captured in, or replayed from, a CUDA graph (pure decode, padded to the captured
    batch size). A backend whose ``plan`` allocates new device buffers per step must
    then write into buffers it keeps for the graph instead: the graph reads the
    addresses it saw at capture.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_decodes: int = 0  # requests with query length 1 (when the runner orders decodes first)
    cuda_graph: bool = False
    #: draft-tree attention (speculative decoding with a token tree), only given to
    #: backends declaring :attr:`AttentionBackend.supports_tree_mask`; ``None``: causal.
    #: int32 ``[num_reqs]``: each request's tree region ``R`` (0 to
    #: :data:`MAX_TREE_REGION`), its last ``R`` keys; 0: the request is causal as usual.
    tree_region: torch.Tensor | None = None
    tree_region_cpu: torch.Tensor | None = None
    #: int64 ``[num_tokens]``, per query token: bit ``j`` set when the token may see
    #: key ``L - R + j`` of its request (``L`` its ``seq_lens`` entry). Keys before the
    #: region are seen by every query token of the request; its query tokens are all in
    #: the region (query length at most ``R``). Ignored for requests with ``R = 0``.
    tree_mask: torch.Tensor | None = None


#: the largest tree region a request may have in a step (one int64 of mask bits per token)
MAX_TREE_REGION = 64


class AttentionBackend(ABC):
    """Paged attention over a KV cache, for one model.

    Constructor (the one signature models use; all keyword arguments)::

        cls(*, num_heads, num_kv_heads, head_size, scale, dtype, device, block_size,
            sliding_window=None, options=None, causal=True, logits_soft_cap=None,
            kv_cache_dtype=None)

    ``causal=False`` asks for an encoder's bidirectional attention; models pass it only
    to backends whose spec declares the ``non_causal`` feature (selection refuses the
    others); each prompt then runs whole in one step, so every key is this step's.
    ``logits_soft_cap=c`` caps the scaled attention scores ``s`` as ``c * tanh(s / c)``
    before the softmax (Gemma-2); models pass it only when their needs name the
    ``logits_soft_cap`` feature, so only backends declaring it get it.
    ``kv_cache_dtype`` is the dtype the cache stores K/V in (models pass
    :attr:`~lmkit.api.ModelBuildContext.kv_cache_dtype`); ``None`` means ``dtype``.
    ``torch.float8_e4m3fn`` (``cache.kv_cache_dtype: fp8``) is taken only by backends
    declaring :attr:`supports_fp8_kv_cache` (their spec claims the ``fp8_kv_cache``
    feature, so selection refuses the others before weights load): they store
    ``clamp(k / k_scale)`` and ``clamp(v / v_scale)`` in e4m3 (saturated at +-448) and
    attend over the values times the scales of the layer they run
    (:meth:`kv_scales`: a checkpoint's per-layer scales, else :attr:`k_scale` and
    :attr:`v_scale`, 1.0 by default, as vLLM without calibrated scales).
    Subclasses that add state call ``super().__init__(**kwargs)``, which stores each
    argument as an attribute. The runner calls :meth:`plan` once per step on the host,
    then every attention layer calls :meth:`run`. ``run`` must do no host work and no
    device-to-host sync, so that it can be captured in a CUDA graph when the spec
    declares ``"cuda_graphs"``.

    Declared abilities (class attributes, read without building the backend):

    * :attr:`supports_model_kv_write`: models may store K/V into the cache themselves
      (see :meth:`kv_write_slots`).
    * :attr:`supports_logits_soft_cap`: the backend honours ``logits_soft_cap``; built
      with one otherwise, it raises (its spec must then not claim ``logits_soft_cap``).
    * :attr:`supports_paged_decode_args`: the backend runs float32 decode-only steps
      (and maybe short multi-token ones, a row per token) with lmkit's C paged decode
      kernel and hands them to a model (see :meth:`paged_decode_args`).
    * :attr:`supports_in_place_decode_metadata`: a decode-only plan made for CUDA graphs
      stays valid when the values in its metadata's device buffers change in place.
    * :attr:`supports_fp8_kv_cache`: the backend stores K/V in float8 e4m3.
    * :attr:`supports_tree_mask`: the backend attends draft trees (``tree_region``,
      ``tree_mask`` in the metadata).
    """

    #: Whether a model may write a step's new K/V into the cache itself, fused into the
    #: kernel that produces them: the backend then implements :meth:`kv_write_slots`
    #: and honours ``run(..., kv_written=True)``. ``False`` (the default): :meth:`run`
    #: always writes them.
    supports_model_kv_write: ClassVar[bool] = False

    #: Whether :meth:`run` soft-caps attention scores when built with ``logits_soft_cap``
    #: (the spec claims the ``logits_soft_cap`` feature too). ``False``: constructing the
    #: backend with a cap raises instead of silently ignoring it.
    supports_logits_soft_cap: ClassVar[bool] = False

    #: Whether :meth:`paged_decode_args` gives the planned step's arguments of lmkit's C
    #: paged decode kernel (``lmkit_kernels.cpu.paged_decode``) when :meth:`run` would
    #: run that kernel with ``scale`` and ``sliding_window`` (a model that runs a whole
    #: decode step in C then computes the same attention without calling :meth:`run`).
    supports_paged_decode_args: ClassVar[bool] = False

    #: Whether a decode-only :meth:`plan` with ``metadata.cuda_graph`` (one query token
    #: per request) stays valid for kernels captured after it when the *values* in the
    #: metadata's device buffers (``seq_lens``, ``slot_mapping``, ``block_tables``, and
    #: the positions a model reads) change in place, with the same number of requests:
    #: :meth:`run` reads them on the device at launch and the plan keeps nothing derived
    #: from their host copies. A draft head's chained passes rely on it (one CUDA graph
    #: runs several passes, each one position further, planned once), and decode graphs
    #: are then replayed without a plan (the one made for their capture holds);
    #: ``False``: each pass is replayed and planned on its own, and every replay planned.
    supports_in_place_decode_metadata: ClassVar[bool] = False

    #: Whether the backend takes ``kv_cache_dtype=torch.float8_e4m3fn``: it quantizes the
    #: K/V it writes (``k / k_scale``, saturated to e4m3's +-448) and dequantizes what it
    #: reads. A backend built with an FP8 cache never takes model-written K/V
    #: (:meth:`lmkit.api.ModelBuildContext.model_may_write_kv`).
    supports_fp8_kv_cache: ClassVar[bool] = False

    #: Whether :meth:`plan` and :meth:`run` honour the metadata's ``tree_region`` and
    #: ``tree_mask`` (draft trees: each token sees the keys before its request's region
    #: and, within it, the keys its mask bits name, e.g. its ancestors in the tree);
    #: the spec then claims the ``tree_mask`` feature. ``False``: the runner never
    #: plans a tree step on the backend (tree drafting is refused at start).
    supports_tree_mask: ClassVar[bool] = False

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 dtype: Any, device: Any, block_size: int, sliding_window: int | None = None,
                 options: Any = None, causal: bool = True,
                 logits_soft_cap: float | None = None, kv_cache_dtype: Any = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.options = options
        self.causal = causal
        if logits_soft_cap is not None and not self.supports_logits_soft_cap:
            raise ValueError(
                f"{type(self).__name__} cannot soft-cap attention scores (asked for "
                f"logits_soft_cap={logits_soft_cap}); use a backend whose spec claims "
                "the logits_soft_cap feature, e.g. 'torch'")
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        #: whether the cache holds float8 e4m3 K/V (read every layer and step: set once)
        self.fp8_kv_cache = is_fp8_kv_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype != dtype and not (self.fp8_kv_cache and self.supports_fp8_kv_cache):
            raise ValueError(
                f"{type(self).__name__} cannot store its KV cache in {self.kv_cache_dtype} "
                f"(the model runs in {dtype}); use a backend whose spec claims the "
                "fp8_kv_cache feature, e.g. 'triton' or 'torch', or cache.kv_cache_dtype: auto")
        #: the per-tensor scales of an FP8 cache: stored ``k / k_scale``, read ``k8 * k_scale``
        self.k_scale = 1.0
        self.v_scale = 1.0
        #: per-layer ``(k_scale, v_scale)`` overriding the two above (a checkpoint's
        #: calibrated scales, set by the runner); read through :meth:`kv_scales`
        self.layer_kv_scales: dict[int, tuple[float, float]] = {}

    def kv_scales(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of model layer ``layer``'s FP8 cache: its entry in
        :attr:`layer_kv_scales`, else :attr:`k_scale` and :attr:`v_scale`."""
        return self.layer_kv_scales.get(layer, (self.k_scale, self.v_scale))

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (the runner allocates it)."""

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare for one step (host work, scratch buffers). Called once per step.

        A backend that does not declare :attr:`supports_tree_mask` calls
        :meth:`refuse_tree_metadata` first, so that a draft tree handed to it fails
        loudly instead of being attended causally.
        """

    def refuse_tree_metadata(self, metadata: AttentionMetadata) -> None:
        """Raise when ``metadata`` describes a draft-tree step (``tree_mask`` set) and
        the backend does not declare :attr:`supports_tree_mask`; otherwise do nothing.

        The runner plans tree steps only on backends that declare the ability; this
        guards the others (one attribute test per step, no device work).

        :raises ValueError: naming the backend and the feature it lacks.
        """
        if metadata.tree_mask is not None and not self.supports_tree_mask:
            raise ValueError(
                f"{type(self).__name__} cannot attend draft trees (the step's metadata "
                "carries tree_mask); use a backend whose spec claims the tree_mask "
                "feature, e.g. 'torch', 'cpu' or 'triton'")

    @abstractmethod
    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_cache: torch.Tensor, *, kv_written: bool = False) -> torch.Tensor:
        """Write ``k``, ``v`` into ``kv_cache`` at ``slot_mapping``, then attend.

        All new tokens' K/V are written before any attention is computed, so a request
        may attend to blocks another request of the same step fills (prefix sharing).

        :param q: ``[num_tokens, num_heads, head_size]``
        :param k: ``[num_tokens, num_kv_heads, head_size]``
        :param v: ``[num_tokens, num_kv_heads, head_size]``
        :param kv_cache: this layer's cache, shaped as :meth:`kv_cache_shape`.
        :param kv_written: ``True`` when the model has already stored this step's K/V at
            the slots :meth:`kv_write_slots` returned: skip the write. Passed ``True``
            only to backends declaring :attr:`supports_model_kv_write`.
        :return: ``[num_tokens, num_heads, head_size]``, causal within each request
            (every query sees all of its request's keys when built with ``causal=False``).
        """

    def copy_kv_slots(self, kv_cache: torch.Tensor, src: torch.Tensor,
                      dst: torch.Tensor) -> None:
        """Copy the K/V stored at cache slots ``src`` to slots ``dst`` (int64 tensors of
        equal length on the cache's device; every source read before any write), in one
        layer's ``kv_cache``. After a draft tree is verified, the runner moves the
        accepted nodes' K/V to the positions they take in the sequence with it.

        The default serves caches laid out ``[2, num_blocks, block_size, ...]`` (token
        ``t`` of slot ``s`` at ``[:, s // block_size, s % block_size]``); a backend with
        another layout that declares :attr:`supports_tree_mask` overrides it. No host
        synchronisation.
        """
        import torch

        if kv_cache.element_size() == 1:  # FP8: copied as bytes (indexing need not know e4m3)
            kv_cache = kv_cache.view(torch.uint8)
        flat = kv_cache.view(kv_cache.shape[0], -1, *kv_cache.shape[3:])
        flat[:, dst] = flat[:, src]

    def paged_decode_args(self, multi_token: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(slot_mapping, block_tables, seq_lens)`` of the planned step when every
        layer's :meth:`run` would store K/V and attend through lmkit's C paged decode
        kernel (float32; the cache laid out ``[2, num_blocks, block_size, num_kv_heads,
        head_size]`` and contiguous), else ``None``: int64 ``[n]``, int32 ``[n,
        max_blocks]`` (unit stride along blocks) and int32 ``[n]`` (contiguous), as that
        kernel takes them, one row per token of the step: its cache slot, its request's
        block table, and how many of its request's keys it attends. In a decode-only
        step (one token per request) the rows are the requests. With ``multi_token``
        (plugin API 1.10) the caller also takes a causal step of multi-token queries
        that the backend runs this way, token ``j`` of a request's ``q`` attending its
        first ``seq_len - (q - 1 - j)`` keys; without it such a step gives ``None``.
        Called after :meth:`plan`; only for backends declaring
        :attr:`supports_paged_decode_args`.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.paged_decode_args() called, but the backend does not "
            "declare supports_paged_decode_args = True; models must check that class "
            "attribute first")

    def kv_write_slots(self) -> torch.Tensor:
        """The planned step's ``slot_mapping``, where a model writing K/V itself stores
        them; only for backends declaring :attr:`supports_model_kv_write`.

        A model can store K/V in the kernel that produces them (fused with RoPE, say),
        saving the backend's separate cache-write pass. A backend may declare the
        ability only if its per-layer cache is laid out ``[2, num_blocks, block_size,
        num_kv_heads, head_size]`` (keys at index 0, values at 1; token ``t`` at
        ``[:, slot // block_size, slot % block_size]``) and its :meth:`run` honours
        ``kv_written=True``. The returned int64 ``[num_tokens]`` tensor (a negative slot
        is a padding token, not written) must be the one :meth:`run` would use, at the
        same address on every replay of a CUDA graph. Called after :meth:`plan`, before
        the layers run.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.kv_write_slots() called, but the backend does not "
            "declare supports_model_kv_write = True; models must check that class "
            "attribute first, and backends that declare it implement this method")

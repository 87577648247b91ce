"""CUDA graphs for a draft head's passes: its catch-up pass and its draft passes.

After the target's verification step the head runs a catch-up pass over the positions
the target kept (after a decode or verification step: at most ``1 + k`` per request),
then drafts ``k - 1`` more tokens, each a pass of one query token per drafting request,
fed the previous draft and the head's own output. Eagerly, each pass is a few dozen
short kernels launched from Python: on a small target that costs as much as the
target's own (captured) decode step. Those passes have the shape of a decode step, so
they replay through a :class:`CudaGraphRunner` over the head, with the head's features
in a fixed buffer: :class:`HeadPass` adapts ``proposer.forward(ids, positions,
features, ctx)`` to the graph runner's ``model(ids, positions, ctx)``.

Two runners per head: the draft passes' (features of the head's width, one row per
drafting request) and the catch-up pass's (features of the target's width,
:attr:`~lmkit.api.RunnerProposer.target_feature_size`), which replays *flattened* like
the target's verification steps (see :mod:`lmkit.worker.cuda_graphs`): one decode row
per kept position ``p``, ``seq_len = p + 1``, its request's block table. Prefill
chunks and larger steps catch up eagerly.

With :attr:`~lmkit.api.RunnerProposer.supports_graph_drafts` the graphs also take the
greedy drafts (:meth:`~lmkit.api.RunnerProposer.draft_argmax`) of every row, into the
graphs' input-id buffer (whose ids the pass has read), and the draft passes' graphs
feed the head's output into their feature buffer: a draft pass is then one replay, and
the next pass reads its inputs where the last one left them, without leaving the
device. The catch-up pass's drafts at each request's last kept position are its first
draft. With :attr:`~lmkit.api.RunnerProposer.samples_drafts` a second set of both
runners is captured whose passes *sample* the drafts
(:mod:`lmkit.sample.draft_sampling`): the rows' parameters and pre-drawn uniforms sit in
fixed buffers set before each replay, each row's candidates and their probabilities in
fixed buffers read after it; steps whose drafting requests are all greedy replay the
argmax set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.api.kv_cache_spec import one_kv_cache_group
from lmkit.api.model import ForwardContext
from lmkit.sample.draft_sampling import DraftRowParams, sample_draft_tokens
from lmkit.worker.cuda_graphs import MAX_CAPTURE_SIZE, CudaGraphRunner

if TYPE_CHECKING:
    from lmkit.api.kv_cache_spec import KVCacheGroup
    from lmkit.api.spec_decode import RunnerProposer


class HeadPass:
    """A draft head as a ``model(ids, positions, ctx) -> hidden`` whose features come
    from :attr:`features` (rows ``0..n``), a buffer with a fixed address.

    Args:
        proposer: the loaded head (its ``attn`` is the graphs' attention backend).
        max_rows: the largest pass (rows of :attr:`features`).
        width: the features' width (the head's hidden size: passes after the first).
        dtype, device: of the features.
        drafts: also take the pass's greedy drafts, into :attr:`feed_ids` (the next
            pass's input ids).
        feed_features: also copy the head's output into :attr:`features` (the next
            pass's features: draft passes, where ``width`` is the head's hidden size).
        sampling: with ``drafts``, draw them by
            :func:`~lmkit.sample.draft_sampling.sample_draft_tokens` with the row
            parameters in :attr:`params` (greedy rows: the argmax of the same logits),
            keeping each row's candidates and their probabilities (:attr:`candidates`).
        ranks: a draft tree's level passes (:mod:`lmkit.worker.tree_drafts`): each pass
            ``j`` of ``levels`` keeps its rows' top ``ranks`` drafts (target ids, best
            first) in ``tops[j]``, and before pass ``j > 0`` (:meth:`before_pass`) its
            rows gather their ids from pass ``j - 1``'s ranks and their features from its
            output, by the two gather indices of the runner's chained rows
            (:attr:`chain_rows`).
    """

    def __init__(self, proposer: RunnerProposer, max_rows: int, width: int,
                 dtype: torch.dtype, device: torch.device, drafts: bool = False,
                 feed_features: bool = False, sampling: bool = False, ranks: int = 0,
                 levels: int = 1) -> None:
        self.proposer = proposer
        self.attn = proposer.attn
        self.features = torch.zeros(max_rows, width, dtype=dtype, device=device)
        self.drafts = drafts
        self.feed_features = feed_features
        self.feed_ids: torch.Tensor | None = None  # the graphs' input-id buffer (drafts)
        # sampled drafts: the rows' parameters in, their candidates out (fixed buffers;
        # the candidates' are made by the first, uncaptured, warm-up call)
        self.params = DraftRowParams.greedy(max_rows, device) if sampling else None
        self.candidates: tuple[torch.Tensor, torch.Tensor] | None = None
        # tree levels: each pass's ranked drafts; the runner's chained rows (set by it)
        self.tops = (torch.zeros(levels, max_rows, ranks, dtype=torch.int64, device=device)
                     if ranks else None)
        self.chain_rows: torch.Tensor | None = None
        self._level = 0
        self._hidden: torch.Tensor | None = None  # the last pass's output

    def kv_cache_groups(self, num_layers: int) -> tuple[KVCacheGroup, ...]:
        """One group: the head's layers on its own backend."""
        return one_kv_cache_group(self.attn, num_layers)

    def before_pass(self, j: int, bs: int) -> None:
        """Called by the graph runner before pass ``j`` of ``bs`` rows (in its capture
        too): with ``ranks``, rows ``j > 0`` take their ids from pass ``j - 1``'s ranks
        and their features from its output."""
        self._level = j
        if j and self.tops is not None:
            assert self.chain_rows is not None and self.feed_ids is not None
            src, parent = self.chain_rows[j - 1, 5, :bs], self.chain_rows[j - 1, 6, :bs]
            self.feed_ids[:bs].copy_(self.tops[j - 1, :bs].reshape(-1).index_select(0, src))
            assert self._hidden is not None
            self.features[:bs].copy_(self._hidden.index_select(0, parent))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        n = len(input_ids)
        hidden = self.proposer.forward(input_ids, positions, self.features[:n], ctx)
        if self.tops is not None:  # a tree level: its rows' ranked drafts
            self.tops[self._level, :n].copy_(ranked_drafts(self.proposer, hidden,
                                                           self.tops.shape[-1]))
            self._hidden = hidden
        if self.drafts and self.params is not None:  # sampled drafts (and candidates)
            assert self.feed_ids is not None
            logits, target_ids = self.proposer.draft_logits(hidden)
            ids, cand, q = sample_draft_tokens(logits, target_ids, self.params.head(n))
            if self.candidates is None:
                rows = len(self.features)
                self.candidates = (cand.new_zeros(rows, cand.shape[1]),
                                   q.new_zeros(rows, q.shape[1]))
            self.feed_ids[:n].copy_(ids)
            self.candidates[0][:n].copy_(cand)
            self.candidates[1][:n].copy_(q)
        elif self.drafts:  # in the graph: the drafts (the next pass's ids) ...
            assert self.feed_ids is not None
            self.feed_ids[:n].copy_(self.proposer.draft_argmax(hidden))
        if self.feed_features:  # ... and its features
            self.features[:n].copy_(hidden)
        return hidden


def ranked_drafts(proposer: RunnerProposer, hidden: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, width]`` target ids: the head's top ``width`` drafts after each row of its
    output ``hidden``, best first (over its draft vocabulary, mapped to the target's)."""
    logits, target_ids = proposer.draft_logits(hidden)
    top = logits.topk(min(width, logits.shape[-1]), dim=-1).indices
    return top if target_ids is None else target_ids[top]


class DraftPassGraphs:
    """Captured passes of one head over features of one width, one graph per padded
    number of rows (decode rows: one query token each).

    Args:
        proposer: the loaded head.
        kv_caches: the head's KV caches (fixed for the graphs' lifetime).
        width: the features' width: the head's hidden size (draft passes) or
            :attr:`~lmkit.api.RunnerProposer.target_feature_size` (the catch-up pass);
            ``dtype``: their dtype.
        device: the CUDA device (any device with ``use_graphs=False``).
        max_rows: the most rows of one pass (at most
            :data:`~lmkit.worker.cuda_graphs.MAX_CAPTURE_SIZE` are captured).
        max_model_len: the context limit; ``block_size``: tokens per KV block.
        use_graphs: ``False`` runs the same padded, fixed-buffer passes eagerly (tests).
        drafts: the passes take their greedy drafts (see :class:`HeadPass`;
            :meth:`drafts` reads them).
        passes_per_step: passes one step runs (sizes the host staging: a step's passes
            never wait for each other's uploads).
        feed_features: with ``drafts``, the passes also feed the head's output back as
            the next pass's features (the draft passes: ``width`` is the head's hidden
            size).
        sampling: with ``drafts``, the passes sample them (see :class:`HeadPass`;
            :meth:`set_params` before a pass, :meth:`candidates` after it).
        chain: passes per replay (greedy drafts fed forward: ``drafts`` and
            ``feed_features``, not ``sampling``): one replay runs ``chain`` draft passes,
            each one position further (:class:`~lmkit.worker.cuda_graphs.CudaGraphRunner`'s
            ``chain``), instead of one replay per pass; :meth:`chain_drafts` reads them.
        tree: captured with tree buffers: :meth:`run` takes each row's ``seq_lens`` and
            tree region and mask bits (a draft tree's level passes,
            :mod:`lmkit.worker.tree_drafts`).
        ranks: with ``tree``, the passes rank the top ``ranks`` drafts of every row, and
            ``chain`` passes (a tree's levels) feed each other (see :class:`HeadPass`;
            :meth:`ranked` reads them).
    """

    def __init__(self, proposer: RunnerProposer, kv_caches: list[torch.Tensor], width: int,
                 dtype: torch.dtype, device: torch.device, max_rows: int,
                 max_model_len: int, block_size: int, use_graphs: bool = True,
                 drafts: bool = False, passes_per_step: int = 1,
                 feed_features: bool = False, sampling: bool = False, chain: int = 1,
                 tree: bool = False, ranks: int = 0) -> None:
        if chain > 1 and not (drafts and feed_features and not sampling) and not ranks:
            raise ValueError("chained draft passes need greedy drafts fed forward")
        if ranks and not tree:
            raise ValueError("ranked passes are a draft tree's levels: capture with tree")
        self.width = width
        self.chain = max(1, chain)
        self.drafts_in_graph = drafts
        self.samples_in_graph = drafts and sampling
        # rows for the largest captured size (the features of passes past it: eager)
        self.head = HeadPass(proposer, min(max_rows, MAX_CAPTURE_SIZE), width, dtype, device,
                             drafts=drafts, feed_features=drafts and feed_features,
                             sampling=self.samples_in_graph, ranks=ranks,
                             levels=max(1, chain))
        self.runner = CudaGraphRunner(self.head, kv_caches, device, max_rows, max_model_len,
                                      block_size, use_graphs=use_graphs,
                                      num_staging=-(-passes_per_step // self.chain) + 1,
                                      chain=self.chain, tree=tree)
        self.head.feed_ids = self.runner.input_ids_buffer
        self.head.chain_rows = self.runner.buffers.chain_rows
        self.num_passes = 0  # passes run through :meth:`run` (``chain`` per call)

    @property
    def max_rows(self) -> int:
        """The most rows one replayed pass takes."""
        return self.runner.max_bs

    @property
    def max_blocks(self) -> int:
        """The widest block table a replayed pass takes."""
        return self.runner.max_blocks

    def feature_rows(self, n: int) -> torch.Tensor:
        """The fixed feature buffer's first ``n`` rows, for a caller to fill in place
        (then :meth:`run` with ``features=None``)."""
        return self.head.features[:n]

    def capture(self) -> None:
        """Capture the graphs (no-op without ``use_graphs``)."""
        self.runner.capture()

    def drafts(self, n: int) -> torch.Tensor:
        """The last pass's greedy drafts of its ``n`` rows (with ``drafts``): a view of
        the input-id buffer, i.e. the next pass's input ids, valid until that pass."""
        return self.runner.input_ids_buffer[:n]

    def chain_drafts(self, n: int) -> torch.Tensor:
        """The greedy drafts of the last replay's ``chain`` passes, ``[chain, n]`` (a new
        tensor): row ``j`` is pass ``j``'s."""
        return torch.cat([self.runner.chain_input_ids(n), self.drafts(n)[None]])

    def ranked(self, n: int) -> torch.Tensor:
        """The last replay's ranked drafts (with ``ranks``): ``[chain, n, ranks]`` target
        ids, pass ``j``'s rows best first (a view, valid until the next replay)."""
        assert self.head.tops is not None, "passes captured without ranks"
        return self.head.tops[:, :n]

    def set_params(self, params: DraftRowParams) -> None:
        """The next pass's row parameters (``samples_in_graph``), copied in stream order
        into the graphs' buffers (rows past them keep what they held: padding, unread)."""
        assert self.head.params is not None, "graphs captured without sampling"
        for dst, src in zip(self.head.params.tensors(), params.tensors(), strict=True):
            dst[:len(src)].copy_(src)

    def candidates(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last pass's candidate ids and probabilities of its ``n`` rows
        (``[n, c]`` views, valid until the next pass)."""
        assert self.head.candidates is not None, "no sampled pass has run"
        cand, q = self.head.candidates
        return cand[:n], q[:n]

    def run(self, input_ids: torch.Tensor | np.ndarray | None, features: torch.Tensor | None,
            positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray,
            chain_rows: np.ndarray | None = None, seq_lens: np.ndarray | None = None,
            tree: tuple[np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
        """One pass of ``n`` decode rows (``n <= max_rows``): token ``input_ids[i]``
        (int64, on the device, e.g. the previous pass's drafts, or on the host; ``None``:
        already in the input-id buffer, where the last pass fed its drafts) at
        ``positions[i]`` with ``features[i]`` (``None``: already in
        :meth:`feature_rows`), its K/V written to ``slots[i]``, attending over
        ``block_tables[i]`` (int32 ``[n, <= max_blocks]``) up to and including itself.
        With ``chain > 1``, ``chain_rows`` (int64 ``[chain - 1, f, n]``: positions, slots,
        ``seq_lens``; captured with ``tree`` (``f = 7``) also each row's tree region, mask
        bits and its id and feature gathers, see :class:`HeadPass`) places the passes
        after the first, which run in the same replay.
        ``seq_lens`` (default ``positions + 1``) and, captured with ``tree``, ``tree`` (each
        row's region and mask bits) place rows whose keys are not their positions'.
        Returns the head's output ``[n, hidden]`` (of the last pass), a view valid until
        the next pass."""
        n = len(positions)
        if features is not None:
            self.head.features[:n].copy_(features)
        self.num_passes += self.chain
        if seq_lens is None:
            seq_lens = (positions + 1).astype(np.int32)
        args = (positions, slots, seq_lens, block_tables)
        if input_ids is None:
            return self.runner.run_decode(None, *args, ids_in_place=True,
                                          chain_rows=chain_rows, tree=tree)
        if isinstance(input_ids, torch.Tensor):
            return self.runner.run_decode(None, *args, device_input_ids=input_ids,
                                          chain_rows=chain_rows, tree=tree)
        return self.runner.run_decode(input_ids, *args, chain_rows=chain_rows, tree=tree)


    def run_device(self, input_ids: torch.Tensor, features: torch.Tensor | None,
                   positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                   chain_rows: torch.Tensor | None = None, inline: bool = False
                   ) -> torch.Tensor:
        """:meth:`run` with the rows' ids, positions, slots, block tables (and
        ``chain_rows``) as device tensors, e.g. computed there from the accepted counts
        of a verification that has not been read back
        (:meth:`~lmkit.worker.cuda_graphs.CudaGraphRunner.run_decode_device`; ``inline``:
        the passes themselves, inside a caller's capture, not counted)."""
        n = len(positions)
        if features is not None:
            self.head.features[:n].copy_(features)
        self.num_passes += 0 if inline else self.chain
        return self.runner.run_decode_device(input_ids, positions, slots, positions + 1,
                                             block_tables, chain_rows=chain_rows,
                                             inline=inline)

def maybe_capture_passes(proposer: RunnerProposer, kv_caches: list[torch.Tensor],
                         target_graphs: CudaGraphRunner | None, width: int, dtype: torch.dtype,
                         max_rows: int, max_model_len: int, block_size: int,
                         drafts: bool = False, passes_per_step: int = 1,
                         feed_features: bool = False, sampling: bool = False, chain: int = 1,
                         tree: bool = False, ranks: int = 0) -> DraftPassGraphs | None:
    """Graphs for passes of the head over ``width``-wide features, up to ``max_rows``
    rows, when the target's decode runs in graphs (the same conditions: CUDA, a backend
    that can be captured, not ``enforce_eager``); else ``None`` (the passes run
    eagerly). ``drafts``, ``passes_per_step``, ``feed_features``, ``sampling``,
    ``chain``, ``tree``, ``ranks``: see :class:`DraftPassGraphs`."""
    if target_graphs is None:
        return None
    graphs = DraftPassGraphs(proposer, kv_caches, width, dtype, target_graphs.device,
                             max_rows, max_model_len, block_size,
                             use_graphs=target_graphs.use_graphs, drafts=drafts,
                             passes_per_step=passes_per_step, feed_features=feed_features,
                             sampling=sampling, chain=chain, tree=tree, ranks=ranks)
    graphs.capture()
    return graphs

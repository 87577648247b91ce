"""CUDA graphs for decode steps: capture the model's forward once per padded batch size,
replay it for every pure-decode step.

A decode step of a small model (or any model at a small batch) is hundreds of short
kernels; launching them one by one from Python costs more than running them. A
captured graph launches them all at once. Graphs need fixed tensor addresses and
shapes, so :class:`CudaGraphRunner` keeps persistent device buffers for the step's
inputs and attention metadata, sized for the largest captured batch, and pads a
step of ``n`` requests up to the next captured size ``bs``:

* padding requests get one query token each (``query_start_loc`` is ``0..bs``), a
  context of 0 tokens (``seq_lens = 0``: the attention kernels return zeros) and
  cache slot ``-1`` (the cache write skips it); their outputs are never read.
* the attention backend's ``plan()`` runs on the host outside the graph, with the
  padded metadata (``cuda_graph=True``), before capture and before every
  replay; the kernels it planned read the metadata buffers at their fixed addresses.
  A backend whose decode plan holds while those values change in place
  (``supports_in_place_decode_metadata``: triton) is planned for the capture only.

Per replay the host packs ``input_ids | positions | slot_mapping`` into one pinned
buffer (one host-to-device copy), copies ``seq_lens`` and the used block-table
columns, plans, and replays. Only backends whose spec declares ``cuda_graphs`` are
captured; ``executor.enforce_eager`` (``--enforce-eager``) turns graphs off.

Speculative verification steps (``1 + k`` query tokens per request: the last known
token and its drafts) replay the same graphs, *flattened*: every query token becomes
a decode row of its own, at its position ``p`` with ``seq_len = p + 1``, its
request's block-table row and its own cache slot. That is exact because every layer
writes the K/V of all the step's tokens to the cache before it attends (the torch,
triton and flashinfer backends all do), so the row of token ``p`` sees the drafts
before it and nothing after. The rows come out in the step's token order. With
speculation on, the captured sizes go up to ``max_num_seqs * (1 + k)`` tokens (at most
:data:`MAX_CAPTURE_SIZE`); a larger step runs eagerly.

Any other short step replays flattened the same way (:mod:`lmkit.worker.flat_steps`).

With draft trees (``tree``; ``speculative.tree``, unless ``LMKIT_TREE_GRAPHS=0``) the graphs
are captured with the metadata's tree buffers, and a tree verification replays
flattened too: a node's row has ``seq_len`` one past its own slot's index (not its
position, which is the root's plus its depth), a region reaching back to its request's
first query row and the node's mask bits, so it sees the context and its ancestors.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmkit.api.attention import AttentionMetadata
from lmkit.api.model import ForwardContext
from lmkit.worker.flat_steps import fits_flat
from lmkit.worker.graph_stream import capture_stream
from lmkit.worker.replay_buffers import ReplayBuffers
from lmkit.worker.tree_step import flattened_tree_rows

if TYPE_CHECKING:
    from lmkit.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The padded batch sizes to capture, ascending, ending at ``min(max_num_seqs, limit)``.

    1, 2, 4, then steps of 8 to 64, of 16 to 256 and of 32 to 512: from 32 requests on,
    padding adds at most a quarter to a batch, and nothing at batch 1.
    """
    cap = max(1, min(max_num_seqs, limit))
    candidates = [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16), *range(288, 513, 32)]
    sizes = [s for s in candidates if s < cap]
    return [*sizes, cap]


class CudaGraphRunner:
    """Captured decode forwards of one model, one per padded batch size.

    Args:
        model: the runner's model (``model(input_ids, positions, ctx) -> hidden``,
            ``model.attn`` its attention backend, ``model.kv_cache_groups()`` every
            backend planned per step).
        kv_caches: the runner's KV caches (fixed for the graphs' lifetime).
        device: the CUDA device.
        max_num_seqs: the scheduler's request limit (the largest size captured).
        max_model_len: the context limit (sizes the block-table buffer).
        block_size: tokens per KV block.
        use_graphs: capture and replay graphs (CUDA only). ``False`` runs the same
            padded, fixed-buffer forward eagerly at "replay" (on any device): the
            padding path without graph capture, for tests and debugging.
        max_query_len: the most query tokens of one request a replayed step may have:
            1 for plain decode, ``1 + k`` with ``k`` speculative tokens (verification
            steps are replayed flattened, one row per token). The largest captured size
            is ``max_num_seqs * max_query_len`` (at most :data:`MAX_CAPTURE_SIZE`).
        flat_tokens: steps of at most this many tokens replay flattened whatever their
            query lengths (:func:`~lmkit.worker.flat_steps.fits_flat`); the captured
            sizes reach it. 0: only ``max_query_len`` decides.
        aux_layers: the target layers whose inputs a draft head reads (EAGLE-3,
            :attr:`lmkit.api.ForwardContext.aux_hidden_layers`); the graphs capture them
            as extra outputs, so verification steps replay with them too.
        num_staging: pinned host staging sets used in turn: a set is rewritten only
            ``num_staging`` replays after its upload, so the host waits for that upload
            (not the last one) before staging the next replay (a draft head's passes of
            one step take as many sets as passes, plus one).
        chain: forward passes per replay (default 1). With ``chain = c > 1`` one replay
            runs the model ``c`` times in a row, for a model that feeds its own next
            input ids (and features) on the device, as a draft head's
            :class:`~lmkit.worker.draft_graphs.HeadPass` does: before pass ``j > 0`` the
            graph copies that pass's positions, cache slots and ``seq_lens`` (staged
            with the replay's, :meth:`run_decode`'s ``chain_rows``) into the buffers the
            attention kernels read, so the backend's plan of pass 0 must stay valid
            when those values change in place
            (:attr:`~lmkit.api.AttentionBackend.supports_in_place_decode_metadata`);
            without graphs the passes are re-planned one by one. The input ids of
            passes 1.. are kept (:meth:`chain_input_ids`). With ``tree`` each pass also
            has its rows' tree regions and mask bits, and two gather indices the model
            reads (its ``before_pass(j, bs)``, called before each pass ``j``: a draft
            tree's level passes, :mod:`lmkit.worker.tree_drafts`).
    """

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 use_graphs: bool = True, max_query_len: int = 1,
                 aux_layers: tuple[int, ...] = (), num_staging: int = 2,
                 chain: int = 1, flat_tokens: int = 0, tree: bool = False) -> None:
        self.model = model
        self.chain = max(1, chain)
        self.aux_layers = tuple(aux_layers)
        self.use_graphs = use_graphs and torch.device(device).type == "cuda"
        self.attn = model.attn
        # every KV cache group's backend is planned per replay (one for most models)
        self.kv_groups = model.kv_cache_groups(len(kv_caches))
        self.kv_caches = kv_caches
        # backends whose captured decode kernels read all of a step's metadata on the
        # device need no plan before a replay (only before capture and eager runs)
        self._plan_replays = not all(type(g.attn).supports_in_place_decode_metadata
                                     for g in self.kv_groups)
        self.device = device
        self.block_size = block_size
        self.max_query_len = max(1, max_query_len)
        self.max_num_seqs = max_num_seqs
        self.sizes = capture_sizes(max(max_num_seqs * self.max_query_len, flat_tokens))
        self.max_bs = self.sizes[-1]
        self.flat_tokens = min(flat_tokens, self.max_bs)
        self.max_blocks = -(-max_model_len // block_size) + 1
        # the graphs' input buffers and their host staging
        self.tree = tree  # draft-tree steps replay too (the module docstring)
        self.buffers = ReplayBuffers(self.max_bs, self.max_blocks, self.chain - 1, device,
                                     num_staging, self.use_graphs, tree)
        # per size: the graph, its hidden output, its aux outputs (``aux_layers``)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                      list[torch.Tensor]]] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0  # steps run through :meth:`replay`
        self.num_flattened_replays = 0  # of which with several query tokens per request

    # ------------------------------------------------------------------ capture

    def capture(self) -> None:
        """Capture one graph per size, largest first (smaller ones reuse its memory pool)."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                self.buffers.next_set()
                self.buffers.stage_padding(bs)
                self.buffers.upload(bs, 0, 1)
                self._plan(bs)
                self._run_model(bs)  # warm-up: compiles kernels, creates library handles
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream(self.device)):
                    hidden, aux = self._run_model(bs)
                self._graphs[bs] = (graph, hidden, aux)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s, %.0f MiB",
                    len(self._graphs), self.sizes[0], self.max_bs, self.capture_seconds,
                    used / 2**20)

    def _run_model(self, bs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The padded forward of size ``bs`` (``chain`` passes): hidden and the
        ``aux_layers`` inputs (of the last pass)."""
        buf = self.buffers
        ids, positions = buf.packed[:bs], buf.packed[bs:2 * bs]
        ctx = ForwardContext(self.attn, self.kv_caches, self.aux_layers)
        before_pass = getattr(self.model, "before_pass", None)
        if self.chain == 1:
            if before_pass is not None:
                before_pass(0, bs)
            return self.model(ids, positions, ctx), ctx.aux_hidden_states
        live = [positions, buf.packed[2 * bs:3 * bs], buf.seq_lens[:bs]]
        if self.tree:  # and each row's tree region and mask bits
            live += [buf.tree_region[:bs], buf.tree_mask[:bs]]
        for j in range(self.chain):
            if j:  # pass j's rows where the kernels read them
                for dst, src in zip(live, buf.chain_rows[j - 1, :len(live), :bs], strict=True):
                    dst.copy_(src)
                if not self.use_graphs:  # eager: plan each pass (any backend)
                    self._plan(bs, buf.host_chain_rows(bs)[j - 1])
                ctx = ForwardContext(self.attn, self.kv_caches, self.aux_layers)
            if before_pass is not None:  # (a model feeding its own ids and features)
                before_pass(j, bs)
            if j:
                buf.chain_ids[j - 1, :bs].copy_(ids)
            hidden = self.model(ids, positions, ctx)
        return hidden, ctx.aux_hidden_states

    def chain_input_ids(self, n: int) -> torch.Tensor:
        """The input ids passes ``1..chain-1`` of the last replay read, ``[chain - 1, n]``
        (a view, valid until the next replay): with a model that feeds its drafts as the
        next pass's ids, row ``j`` holds pass ``j``'s drafts (the last pass's are in
        :attr:`input_ids_buffer`)."""
        return self.buffers.chain_ids[:, :n]

    def _plan(self, bs: int, chained: np.ndarray | None = None) -> None:
        md = self._metadata(bs, chained)
        for group in self.kv_groups:
            group.attn.plan(md)

    def _metadata(self, bs: int, chained: np.ndarray | None = None) -> AttentionMetadata:
        """The padded decode metadata of a graph of size ``bs`` (device views fixed);
        ``chained``: the host rows of a chained pass (its ``seq_lens`` and tree regions;
        default: the staged ones of the first pass)."""
        buf = self.buffers
        h_seq_lens, h_region = buf.host_seq_lens[:bs], buf.host_tree_region[:bs]
        if chained is not None:
            h_seq_lens = torch.from_numpy(chained[2].astype(np.int32))
            if self.tree:
                h_region = torch.from_numpy(chained[3].astype(np.int32))
        return AttentionMetadata(
            num_reqs=bs, num_actual_tokens=bs, max_query_len=1,
            max_seq_len=max(1, int(h_seq_lens.numpy().max())),
            query_start_loc=buf.query_start_loc[:bs + 1], seq_lens=buf.seq_lens[:bs],
            block_tables=buf.block_tables[:bs], slot_mapping=buf.packed[2 * bs:3 * bs],
            query_start_loc_cpu=buf.host_query_start_loc[:bs + 1], seq_lens_cpu=h_seq_lens,
            num_decodes=bs, cuda_graph=True,
            **({"tree_region": buf.tree_region[:bs], "tree_mask": buf.tree_mask[:bs],
                "tree_region_cpu": h_region} if self.tree else {}))

    def hidden_like(self, n: int) -> torch.Tensor:
        """Zeros shaped as ``n`` rows of the graphs' hidden output (its dtype and device),
        e.g. to compile what runs on it before a capture."""
        _, hidden, _ = self._graphs[self.max_bs]
        return hidden.new_zeros(n, hidden.shape[-1])

    @property
    def plans_replays(self) -> bool:
        """Whether a replay needs the attention plan run on the host first (a backend
        whose captured decode plan does not hold as the metadata changes in place)."""
        return self._plan_replays

    # ------------------------------------------------------------------ replay

    def padded_size(self, num_rows: int) -> int:
        """The smallest captured size holding ``num_rows`` decode rows (tokens)."""
        i = int(np.searchsorted(self.sizes, num_rows))
        return self.sizes[i]

    def can_replay(self, step: StepInputs) -> bool:
        """Whether ``step`` can run through a graph: at most the largest captured size
        in all, and rows a replay takes (:meth:`fits_rows`)."""
        n = step.num_tokens
        return (0 < n <= self.max_bs and step.block_tables.shape[1] <= self.max_blocks
                and (step.tree_mask is None or self.tree)
                and self.fits_rows(step.num_scheduled, step.num_computed))

    def fits_rows(self, num_scheduled: np.ndarray, num_computed: np.ndarray) -> bool:
        """Whether requests with ``num_scheduled`` query tokens after ``num_computed``
        computed ones replay flattened: at most :attr:`max_query_len` each (1: pure
        decode; ``1 + k``: speculative verification), or a short step
        (:func:`~lmkit.worker.flat_steps.fits_flat` with :attr:`flat_tokens`). A draft
        head's catch-up after the step takes its rows by the same rule."""
        return (int(num_scheduled.max()) <= self.max_query_len
                or fits_flat(self.flat_tokens, num_scheduled, num_computed))

    def replay(self, step: StepInputs, aux: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Run ``step`` (see :meth:`can_replay`) through its graph; returns hidden
        ``[num_tokens, hidden]`` in the step's token order.

        A step with several query tokens per request is flattened: token ``t`` at
        position ``p`` becomes a decode row with ``seq_len = p + 1`` over its request's
        block table (see the module docstring). The result is a view of the graph's
        output buffer, valid until the next replay. With ``aux`` (a list), the inputs of
        the :attr:`aux_layers` are appended to it, views of the graph's buffers too.
        """
        positions = step.positions.numpy()
        tables = step.block_tables.numpy()
        self.num_replays += 1
        tree = None
        if step.num_tokens == step.num_reqs:  # pure decode: one row per request
            seq_lens = step.seq_lens.numpy()
        else:  # flattened: one row per token, its request's block table repeated
            self.num_flattened_replays += 1
            seq_lens = (positions + 1).astype(np.int32)
            tables = np.repeat(tables, step.num_scheduled, axis=0)
            if step.tree_mask is not None and step.tree_region is not None:
                seq_lens, tree = flattened_tree_rows(step)
        return self.run_decode(step.input_ids.numpy(), positions, step.slot_mapping.numpy(),
                               seq_lens, tables, aux=aux, tree=tree)

    @property
    def input_ids_buffer(self) -> torch.Tensor:
        """The device buffer the graphs read their input ids from (row ``i`` of every
        size at index ``i``): what a captured model may write the next replay's ids to
        (then :meth:`run_decode` with ``ids_in_place``)."""
        return self.buffers.packed[:self.max_bs]

    def run_decode(self, input_ids: np.ndarray | None, positions: np.ndarray,
                   slot_mapping: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                   device_input_ids: torch.Tensor | None = None,
                   aux: list[torch.Tensor] | None = None,
                   ids_in_place: bool = False,
                   chain_rows: np.ndarray | None = None,
                   tree: tuple[np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
        """Replay the graph for a decode step of ``n = len(positions)`` requests.

        :param input_ids: int64 ``[n]`` host token ids, or ``None`` with
            ``device_input_ids``: int64 ``[n]`` on the device (e.g. the previous step's
            sampled tokens, not yet read back), copied in stream order, or ``None`` with
            ``ids_in_place``: the ids are already in :attr:`input_ids_buffer` (e.g. the
            previous replay wrote them there); its padding rows are reset.
        :param positions: int64 ``[n]``; ``slot_mapping`` int64 ``[n]``; ``seq_lens``
            int32 ``[n]``; ``block_tables`` int32 ``[n, width]`` (the used columns).
        :param aux: a list that receives the :attr:`aux_layers` inputs ``[n, hidden]``.
        :param chain_rows: with ``chain = c > 1`` (required then): int64 ``[c - 1, f, n]``,
            the positions, cache slots and ``seq_lens`` of passes ``1..c-1`` (a row that
            must not write: slot ``-1``), with ``tree`` (``f = 7``) then their tree
            regions, mask bits and the model's two gather indices (``f = 3`` without).
        :param tree: with :attr:`tree`, the rows' tree regions (int32 ``[n]``, 0: causal)
            and mask bits (int64 ``[n]``); ``None``: every row causal.
        :return: hidden ``[n, hidden]`` (of the last pass), a view of the graph's output
            buffer.
        """
        n = len(positions)
        bs = self.padded_size(n)
        shape = (self.chain - 1, self.buffers.fields, n)
        if self.chain > 1 and (chain_rows is None or chain_rows.shape != shape):
            raise ValueError(f"a replay of {self.chain} chained passes needs chain_rows "
                             f"of shape {shape}")
        buf = self.buffers
        buf.next_set()
        buf.stage(bs, input_ids, positions, slot_mapping, seq_lens, block_tables, chain_rows,
                  tree)
        buf.upload(bs, n, block_tables.shape[1], ids_from=n if ids_in_place else 0)
        if device_input_ids is not None:
            buf.packed[:n].copy_(device_input_ids)
        if self._plan_replays or not self.use_graphs:
            self._plan(bs)
        if self.use_graphs:
            graph, hidden, taps = self._graphs[bs]
            graph.replay()
        else:
            hidden, taps = self._run_model(bs)
        if aux is not None:
            aux.extend(t[:n] for t in taps)
        return hidden[:n]

    def run_decode_device(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, aux: list[torch.Tensor] | None = None,
                          chain_rows: torch.Tensor | None = None,
                          inline: bool = False) -> torch.Tensor:
        """:meth:`run_decode` with every input already on the device (int64, the block
        tables int32), e.g. computed there by the kernels before it: copied into the
        graph's buffers in stream order, no host staging and no host synchronisation.

        Without graphs, or for a backend planned before every replay, the plan needs the
        values on the host: they are read back (a synchronisation on CUDA) and the replay
        runs through :meth:`run_decode`. ``inline``: run the forward itself instead of
        replaying its graph (planned here, on the host): for a caller capturing a larger
        graph that contains this pass (a backend whose plan holds in place only).
        """
        if not inline and (self._plan_replays or not self.use_graphs):
            def host(t: torch.Tensor) -> np.ndarray:
                return t.cpu().numpy()
            return self.run_decode(host(input_ids), host(positions), host(slot_mapping),
                                   host(seq_lens), host(block_tables), aux=aux,
                                   chain_rows=None if chain_rows is None else host(chain_rows))
        n = len(positions)
        bs = self.padded_size(n)
        self.buffers.load(bs, input_ids, positions, slot_mapping, seq_lens, block_tables,
                          chain_rows)
        if inline:
            self._plan(bs)
            hidden, taps = self._run_model(bs)
        else:
            graph, hidden, taps = self._graphs[bs]
            graph.replay()
        if aux is not None:
            aux.extend(t[:n] for t in taps)
        return hidden[:n]

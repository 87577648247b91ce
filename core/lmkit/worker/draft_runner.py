"""Runner-hosted drafting: a draft head (EAGLE) next to the target model.

The head (a :class:`~lmkit.api.RunnerProposer`) keeps a paged KV cache of its own,
allocated with the target's (same number of blocks, same block ids, counted in the
memory profile) and addressed through the target's block tables: the head's KV of
position ``p`` lives in the slot of the target's KV of ``p``. Each step, right after the
target's forward and verification (:meth:`DraftRunner.propose`):

1. **Catch up**: one head pass over every position the target computed and kept this
   step (prefill chunks, the last token, accepted drafts), each paired with the token
   after it and the target's hidden state there. Rejected positions are skipped; the
   head's KV there (and at the draft positions of the previous step) is overwritten
   when the target computes those positions again, before anything reads it.
2. **Draft**: for each request that sampled, the argmax of the head's logits at its
   last kept position is draft 1; then ``k - 1`` passes of one position per request
   feed the previous draft and the head's own output back in. Drafts stay on the
   device between passes; one device-to-host copy returns them all. With
   :attr:`~lmkit.api.RunnerProposer.samples_drafts`, requests with ``temperature > 0``
   draw each draft from the head's filtered distribution instead
   (:mod:`lmkit.worker.draft_sampler`), and the distributions stay on the device until
   the next step verifies those drafts (:meth:`DraftRunner.take_probs`).

Everything planned here is known on the host before the passes run (the accepted
counts were read with the sampled tokens; after a step without drafts the tokens may
still be on the device, :mod:`lmkit.worker.early_drafts`), so the passes add no host
round trip: index arrays go up through pinned staging (:mod:`lmkit.worker.staging`),
and the one synchronisation is the final copy of the drafts. Draft positions stop at
the request's allocated blocks (the scheduler reserves ``k`` lookahead slots) and at
``max_model_len``. With ``speculative.tree`` the head drafts a tree of ``k`` nodes
(:mod:`lmkit.worker.tree_drafts`). Under CUDA graphs the head's passes replay too
(:mod:`lmkit.worker.draft_graphs`): the draft passes, and the catch-up pass after a
decode, verification or short step (:mod:`lmkit.worker.flat_steps`), flattened (after
a decode step launched ahead: queued at the launch, :mod:`lmkit.worker.launch_catch_up`).
A request starting on cached blocks reuses the head KV written there by the request
that computed them (only the last slot was paired with that request's next token): its
drafts may be a little worse, its outputs exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmkit.api.attention import AttentionMetadata
from lmkit.api.kv_cache_spec import KVCacheGroup, one_kv_cache_group
from lmkit.api.model import ForwardContext
from lmkit.api.spec_decode import DraftHeadContext, RunnerProposer
from lmkit.errors import PluginError
from lmkit.platform import switched_off
from lmkit.worker import memory
from lmkit.worker.draft_graphs import DraftPassGraphs, maybe_capture_passes
from lmkit.worker.draft_sampler import SampledDrafts, StepDraftSampler
from lmkit.worker.early_drafts import early_drafts_on, sampled_patch
from lmkit.worker.input_batch import CachedRequestState, InputBatch, StepInputs, tree_metadata
from lmkit.worker.staging import StepStaging
from lmkit.worker.tree_drafts import draft_tree, level_pass_graphs

if TYPE_CHECKING:
    from lmkit.spec_decode.tree import DraftTree
    from lmkit.worker.cuda_graphs import CudaGraphRunner


class DraftRunner:
    """Runs a loaded :class:`~lmkit.api.RunnerProposer` for the model runner.

    Args:
        proposer: the head, loaded (:meth:`~lmkit.api.RunnerProposer.load`).
        num_speculative_tokens: ``k``.
        input_batch: the runner's persistent batch (tokens, block tables).
        max_model_len: no draft position reaches it.
        device: where the head runs.
        requests: the runner's request states by id (sampling parameters, generators:
            read when the head samples drafts); ``vocab_size``: the target's.
        skip_above: leave the head out of steps of more than this many requests
            (``speculative.disable_by_batch_size`` with ``catch_up_when_off`` false):
            their requests stop drafting for good (:attr:`stale`); ``None``: never.
    """

    def __init__(self, proposer: RunnerProposer, num_speculative_tokens: int,
                 input_batch: InputBatch, max_model_len: int, device: torch.device,
                 requests: Mapping[str, CachedRequestState] | None = None,
                 vocab_size: int = 0, skip_above: int | None = None) -> None:
        self.proposer = proposer
        self.skip_above = skip_above
        self.stale: set[str] = set()  # head KV with holes (ran in a skipped step): no drafts
        self.requests: Mapping[str, CachedRequestState] = {} if requests is None else requests
        self.vocab_size = vocab_size
        self.k = num_speculative_tokens
        self.tree: DraftTree | None = None  # set: draft trees of k nodes (tree_drafts.py)
        self.input_batch, self.block_size = input_batch, input_batch.block_size
        self.early_drafts = early_drafts_on()  # (read once: lmkit.worker.early_drafts)
        self.max_model_len = max_model_len
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: DraftPassGraphs | None = None  # k - 1 draft passes (a tree's levels)
        self.catch_up_graphs: DraftPassGraphs | None = None  # decode-like catch-up passes
        # the same two, sampling the drafts (samples_drafts), for steps with sampled requests
        self.sampled_graphs: DraftPassGraphs | None = None
        self.sampled_catch_up_graphs: DraftPassGraphs | None = None
        self.fits_rows: Callable[[np.ndarray, np.ndarray], bool] = (  # catch-up graphs' rows
            lambda kept, computed: int(kept.max()) <= 1 + self.k)
        self.sampled = SampledDrafts()  # sampled drafts' distributions, until verified
        self.num_sampled_steps = 0  # steps whose drafts were (partly) sampled
        self.staging = StepStaging(device)  # each step's index arrays, to the device
        # catch-up passes run eagerly (prefill, large steps), replayed flattened, at launch
        self.num_eager_catch_ups = self.num_flattened_catch_ups = self.num_launch_catch_ups = 0

    @classmethod
    def load(cls, proposer: RunnerProposer, ctx: DraftHeadContext, num_speculative_tokens: int,
             input_batch: InputBatch, max_model_len: int,
             requests: Mapping[str, CachedRequestState] | None = None,
             vocab_size: int = 0, skip_above: int | None = None) -> DraftRunner:
        """Load ``proposer``'s weights next to the loaded target; return its runner."""
        proposer.load(ctx)
        return cls(proposer, num_speculative_tokens, input_batch, max_model_len,
                   torch.device(ctx.build.device), requests, vocab_size, skip_above)

    def sits_out(self, num_reqs: int) -> bool:
        """Whether the head sits out a step of ``num_reqs`` requests (``skip_above``)."""
        return self.skip_above is not None and num_reqs > self.skip_above

    def kv_bytes_per_block(self) -> int:
        """Bytes one block of the head's KV cache takes (all its layers)."""
        return memory.kv_bytes_per_block(self.kv_groups())

    def kv_groups(self) -> tuple[KVCacheGroup]:
        """The head's KV cache group (its layers on its one backend)."""
        return one_kv_cache_group(self.proposer.attn, self.proposer.num_kv_layers)

    def allocate(self, num_blocks: int) -> None:
        """Allocate the head's KV caches: ``num_blocks`` blocks, as many as the target's."""
        self.kv_caches = memory.allocate_kv_caches(self.kv_groups(), num_blocks, self.device)

    def capture_graphs(self, target_graphs: CudaGraphRunner | None, max_num_seqs: int,
                       dtype: torch.dtype) -> None:
        """Capture the head's passes in CUDA graphs when the target's decode runs in
        graphs and the head has ``supports_cuda_graphs`` (else they run eagerly): the
        ``k - 1`` draft passes (a row per request; ``hidden_size``) or a tree's level
        passes, with ``target_feature_size`` decode-like catch-up passes (a row per kept
        position, as many as the target's graphs take), with ``samples_drafts`` a
        sampling set too."""
        proposer = self.proposer
        if target_graphs is None or not proposer.supports_cuda_graphs or proposer.hidden_size <= 0:
            return
        args, self.fits_rows = (self.max_model_len, self.block_size), target_graphs.fits_rows
        drafts = proposer.supports_graph_drafts
        sampled = drafts and proposer.samples_drafts and self.tree is None  # (trees: argmax)
        for sampling in (False, True) if sampled else (False,):
            passes = catch_up = None
            if self.k >= 2 and self.tree is None:
                chain = self.k - 1 if drafts and not sampling and self._can_chain(
                    target_graphs) else 1
                passes = maybe_capture_passes(
                    proposer, self.kv_caches, target_graphs, proposer.hidden_size, dtype,
                    max_num_seqs, *args, drafts=drafts, passes_per_step=self.k - 1,
                    feed_features=True, sampling=sampling, chain=chain)
            elif self.tree is not None:  # a tree's level passes (target graphs with trees)
                passes = level_pass_graphs(self, self.tree, target_graphs, max_num_seqs, dtype)
            if proposer.target_feature_size > 0:
                catch_up = maybe_capture_passes(
                    proposer, self.kv_caches, target_graphs, proposer.target_feature_size,
                    dtype, target_graphs.max_bs, *args, drafts=drafts, sampling=sampling)
            if sampling:
                self.sampled_graphs, self.sampled_catch_up_graphs = passes, catch_up
            else:
                self.graphs, self.catch_up_graphs = passes, catch_up

    def _can_chain(self, target_graphs: CudaGraphRunner | None) -> bool:
        """Whether the ``k - 1`` greedy draft passes can replay as one chained graph: the
        head's backend keeps a captured decode plan valid as the positions move (or no
        graphs: every pass re-planned), and ``LMKIT_DRAFT_CHAIN`` is not ``0``."""
        if switched_off("LMKIT_DRAFT_CHAIN") or target_graphs is None:
            return False
        return (not target_graphs.use_graphs
                or type(self.proposer.attn).supports_in_place_decode_metadata)

    # ------------------------------------------------------------------ one step

    def propose(self, features: torch.Tensor, step: StepInputs, num_kept: np.ndarray,
                drafting: np.ndarray, sampled: tuple[np.ndarray, torch.Tensor] | None = None
                ) -> dict[int, list[int]]:
        """Catch the head up on this step's kept positions, draft for those that sampled.

        Args:
            features: the step's target features, ``[>= num_tokens, width]``: its final
                hidden states, or the inputs of the head's ``target_layers`` side by side.
            step: the step's packed inputs (request ``i`` is ``step.rows[i]``).
            num_kept: per request, how many of its scheduled positions were kept (the
                leading ones: rejected drafts are the tail); 0 skips the request.
            drafting: per request, whether to draft for it (it sampled and may speculate).
            sampled: the step indices of requests whose sampled token is not in the batch
                yet, and those tokens on the device (:mod:`lmkit.worker.early_drafts`).

        Returns:
            step index -> up to ``k`` draft token ids, for the drafting requests.
        """
        if self.sits_out(len(step.rows)):
            self.stale.update(self.input_batch.req_ids[r] for r in step.rows)
            return {}
        if self.stale:  # stale requests: neither caught up nor drafted for
            self.stale &= self.requests.keys()  # (finished ones forgotten)
            live = np.fromiter((self.input_batch.req_ids[r] not in self.stale
                                for r in step.rows), dtype=bool, count=len(step.rows))
            num_kept, drafting = np.where(live, num_kept, 0), drafting & live
        sel = np.flatnonzero(num_kept > 0)
        if not len(sel):
            return {}
        self.staging.begin()
        kept, rows, num_computed = num_kept[sel], step.rows[sel], step.num_computed[sel]
        starts = (step.cu_num_tokens - step.num_scheduled)[sel]
        cu_kept = np.cumsum(kept)
        # hidden rows kept: [start, start + kept) of each selected request
        offsets = np.arange(int(cu_kept[-1]), dtype=np.int64) - np.repeat(cu_kept - kept, kept)
        keep = np.repeat(starts, kept) + offsets
        positions = np.repeat(num_computed, kept) + offsets
        input_ids = self.input_batch.token_ids[np.repeat(rows, kept), positions + 1]  # next
        slots = step.slot_mapping.numpy()[keep]
        seq_lens = num_computed + kept
        table = self.input_batch.block_table
        width = min(table.shape[1], -(-(int(seq_lens.max()) + self.k) // self.block_size))
        tables = table[rows, :width]  # wide enough for every draft position
        drafter = np.flatnonzero(drafting[sel])
        req_ids = [self.input_batch.req_ids[r] for r in rows[drafter]]
        sampler = (StepDraftSampler.maybe(self.proposer, [self.requests[r] for r in req_ids],
                                          self.k, self.staging, self.vocab_size, self.device)
                   if self.requests and self.tree is None else None)  # (tests: argmax)
        self.num_sampled_steps += sampler is not None
        out, drafted = self._catch_up(features, keep, input_ids, positions, slots, kept,
                                      seq_lens, tables, sampler, cu_kept[drafter] - 1,
                                      sampled_patch(sampled, sel, cu_kept, self.staging))
        if not len(drafter):
            return {}
        last = seq_lens[drafter] - 1  # each drafting request's last kept position
        capacity = np.minimum(self.input_batch.num_blocks[rows[drafter]] * self.block_size,
                              self.max_model_len)
        num_drafts = np.clip(capacity - last, 0, self.k)  # draft j writes position last + j
        index = self.staging.put(cu_kept[drafter] - 1)  # each one's last kept row
        feat = out.index_select(0, index)
        if self.tree is not None:  # a tree of drafts, level by level
            return draft_tree(self, self.tree, feat, last, num_drafts, rows[drafter],
                              tables[drafter], [int(sel[d]) for d in drafter])
        act = np.arange(len(drafter))
        if drafted is not None and (sampler is None) == (drafted[1] is None):
            ids = drafted[0].index_select(0, index)  # taken in the catch-up replay
            if sampler is not None:  # sampled there: with the rows' candidates
                sampler.record(0, act, *(t.index_select(0, index) for t in drafted[1]))
        else:
            ids = (sampler.sample(feat, act, 0) if sampler is not None
                   else self.proposer.draft_argmax(feat))
        columns = [ids]  # draft j of the requests still drafting, act_j
        graphs = (self.sampled_graphs if sampler is not None and self.sampled_graphs
                  is not None else self.graphs)
        if (graphs is not None and graphs.chain > 1 and sampler is None
                and len(act) <= graphs.max_rows and int(num_drafts.max()) > 1):
            return self._chained_drafts(graphs, ids, feat, last, num_drafts, tables[drafter],
                                        [int(sel[d]) for d in drafter], req_ids)
        fed = False  # ids and feat are already the draft graphs' inputs (fed back there)
        for j in range(1, self.k):
            still = np.flatnonzero(num_drafts[act] > j)  # of act: those with a draft j
            if not len(still):
                break
            if len(still) < len(act):  # some stop at their blocks: the others' rows
                index = self.staging.put(still)
                ids, feat = ids.index_select(0, index), feat.index_select(0, index)
                act, fed = act[still], False
            pos = last[act] + j
            req_rows = rows[drafter[act]]
            slots_j = (table[req_rows, pos // self.block_size].astype(np.int64)
                       * self.block_size + pos % self.block_size)
            if graphs is not None and len(act) <= graphs.max_rows:
                if sampler is not None and graphs.samples_in_graph:
                    graphs.set_params(sampler.rows(act, j))
                feat = graphs.run(None if fed else ids, None if fed else feat, pos, slots_j,
                                  tables[drafter[act]])
                if graphs.drafts_in_graph and (sampler is None or graphs.samples_in_graph):
                    # taken in the replay, fed to the next one
                    ids, fed = graphs.drafts(len(act)), True
                    columns.append(ids.clone())  # the buffer is the next pass's input
                    if sampler is not None:
                        sampler.record(j, act, *graphs.candidates(len(act)))
                    continue
            else:
                feat = self.run_pass(ids, pos, slots_j, feat, np.arange(1, len(act) + 1),
                                     pos + 1, tables[drafter[act]])
            ids = (sampler.sample(feat, act, j) if sampler is not None
                   else self.proposer.draft_argmax(feat))
            fed = False
            columns.append(ids)
        flat = torch.cat(columns).cpu().numpy()  # the one device-to-host copy of the drafts
        drafts = np.zeros((len(drafter), self.k), dtype=np.int64)
        start = 0
        for j, column in enumerate(columns):  # act_j: the requests with more than j drafts
            act_j = np.flatnonzero(num_drafts > j) if j else np.arange(len(drafter))
            drafts[act_j, j] = flat[start:start + len(column)]
            start += len(column)
        result = {int(sel[d]): drafts[n, :int(num_drafts[n])].tolist()
                  for n, d in enumerate(drafter)}
        self.sampled.keep(self.input_batch.row_of, req_ids,
                          [result[int(sel[d])] for d in drafter],
                          sampler.draft_probs(num_drafts) if sampler is not None else {})
        return result

    def _chained_drafts(self, graphs: DraftPassGraphs, ids: torch.Tensor, feat: torch.Tensor,
                        last: np.ndarray, num_drafts: np.ndarray, tables: np.ndarray,
                        step_index: list[int], req_ids: list[str]) -> dict[int, list[int]]:
        """Greedy drafts ``2..k`` of every drafting request from one replay of the chained
        draft passes (``graphs.chain == k - 1``), given draft 1 (``ids``) and the head's
        output at each request's last kept position (``feat``). Pass ``j`` writes position
        ``last + j``; a request with fewer drafts (its blocks or the context end first)
        stays on its last kept position with no cache slot, its later drafts dropped."""
        passes = np.arange(1, self.k)[:, None]  # [k - 1, 1]
        writes = num_drafts[None, :] > passes  # [k - 1, n]: pass j has a draft j
        pos = np.where(writes, last[None, :] + passes, last[None, :])
        blocks = np.take_along_axis(tables, pos.T // self.block_size, axis=1).T
        slots = np.where(writes, blocks.astype(np.int64) * self.block_size
                         + pos % self.block_size, -1)
        placed = np.stack([pos, slots, pos + 1], axis=1)  # [k - 1, 3, n]
        graphs.run(ids, feat, placed[0, 0], placed[0, 1], tables, chain_rows=placed[1:])
        flat = torch.cat([ids[None], graphs.chain_drafts(len(last))]).cpu().numpy()  # [k, n]
        result = {i: flat[:int(m), n].tolist()
                  for n, (i, m) in enumerate(zip(step_index, num_drafts, strict=True))}
        self.sampled.keep(self.input_batch.row_of, req_ids, list(result.values()), {})
        return result

    def take_probs(self, req_ids: Sequence[str], drafts: Sequence[Sequence[int]]
                   ) -> list[torch.Tensor | None] | None:
        """Per request, the distributions its drafts were drawn from; ``None``: none was."""
        return self.sampled.take(req_ids, drafts)

    def _catch_up(self, features: torch.Tensor, keep: np.ndarray, input_ids: np.ndarray,
                  positions: np.ndarray, slots: np.ndarray, kept: np.ndarray,
                  seq_lens: np.ndarray, tables: np.ndarray,
                  sampler: StepDraftSampler | None = None,
                  last_rows: np.ndarray | None = None,
                  patch: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, Any] | None]:
        """The catch-up pass over the kept rows ``keep`` of ``features``; returns the
        head's output per kept position and, when the replay took them, the drafts
        there and (sampled: ``sampler`` and the drafters' ``last_rows``) the rows'
        candidates and probabilities, else ``None``: take them from the output; ``patch``
        (rows, tokens on the device) replaces those rows' input ids there. After a
        decode, verification or short step (rows the target's graphs take,
        :attr:`fits_rows`) it replays the catch-up graphs, flattened: one decode row per
        position, its request's block table; else it runs eagerly."""
        graphs = (self.sampled_catch_up_graphs if sampler is not None
                  and self.sampled_catch_up_graphs is not None else self.catch_up_graphs)
        index = self.staging.put(keep)
        ids: np.ndarray | torch.Tensor = input_ids
        if patch is not None:  # tokens sampled on the device, not read back yet
            ids = self.staging.put(input_ids).index_copy_(0, *patch)
        if (graphs is not None and len(keep) <= graphs.max_rows
                and tables.shape[1] <= graphs.max_blocks
                and self.fits_rows(kept, seq_lens - kept)):
            if features.shape[1] != graphs.width:
                raise PluginError(
                    f"speculative proposer {type(self.proposer).__qualname__} declares "
                    f"target_feature_size {graphs.width}, but the target hands its catch-up "
                    f"pass features of width {features.shape[1]}; set it in check_target to "
                    "the target's hidden size times len(target_layers) (or 1)")
            torch.index_select(features, 0, index, out=graphs.feature_rows(len(keep)))
            self.num_flattened_catch_ups += int(kept.max()) > 1
            sampling = sampler is not None and graphs.samples_in_graph
            if sampling:
                assert sampler is not None and last_rows is not None
                graphs.set_params(sampler.catch_up_rows(last_rows, len(keep)))
            out = graphs.run(ids, None, positions, slots, np.repeat(tables, kept, axis=0))
            if not graphs.drafts_in_graph:
                return out, None
            return out, (graphs.drafts(len(keep)),
                         graphs.candidates(len(keep)) if sampling else None)
        self.num_eager_catch_ups += 1
        return self.run_pass(ids, positions, slots, features.index_select(0, index),
                             np.cumsum(kept), seq_lens, tables), None

    def run_pass(self, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray,
                 slots: np.ndarray, features: torch.Tensor, cu_query: np.ndarray,
                 seq_lens: np.ndarray, tables: np.ndarray,
                 tree: tuple[np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
        """Plan the head's attention for one pass (``tree``: each request's tree region
        and each token's mask bits) and run it eagerly; returns its features."""
        put = self.staging.put
        qsl = np.zeros(len(cu_query) + 1, dtype=np.int32)
        qsl[1:] = cu_query
        query_lens = np.diff(qsl)
        seq_lens = seq_lens.astype(np.int32)
        md = AttentionMetadata(
            num_reqs=len(seq_lens), num_actual_tokens=int(qsl[-1]),
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
            query_start_loc=put(qsl, torch.int32), seq_lens=put(seq_lens, torch.int32),
            block_tables=put(tables, torch.int32), slot_mapping=put(slots),
            query_start_loc_cpu=torch.from_numpy(qsl), seq_lens_cpu=torch.from_numpy(seq_lens),
            num_decodes=int(np.argmax(query_lens != 1)) if (query_lens != 1).any()
            else len(query_lens), **(tree_metadata(*tree, features.device) if tree else {}))
        self.proposer.attn.plan(md)
        ids = input_ids if isinstance(input_ids, torch.Tensor) else put(input_ids)
        return self.proposer.forward(ids, put(positions), features,
                                     ForwardContext(self.proposer.attn, self.kv_caches))

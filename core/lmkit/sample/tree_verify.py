"""Verifying a draft tree (:class:`~lmkit.spec_decode.tree.DraftTree`): which path of
drafts a request accepts, and the token after it.

Each request has ``n + 1`` consecutive logits rows: the root (its last known token)
and its first ``n`` draft nodes in breadth-first order, each row computed with the
node's ancestors as the preceding tokens (tree attention) and sampled with its own
"output so far" (the request's output plus the drafts on the path to it, so penalties
and bans act as they would one token at a time).

The walk starts at the root. At a node whose row samples greedily the child whose
draft equals the argmax is accepted. At a random row the children are tried in rank
order, as deterministic drafts: child ``c`` is accepted with probability
``p(c) / (1 - mass of the siblings rejected before it)``, where ``p`` is the row's
target distribution (after every filter); the token after the accepted path is drawn
from ``p`` with all the node's children removed. So each emitted token has exactly the
target distribution, whatever the drafts (the argument is that of sampling without
replacement: ``c`` is emitted with probability ``(1 - rejected) * p(c) / (1 -
rejected) = p(c)``, and any other token with ``p`` times the chance that all children
were rejected, normalised). Seeded requests draw from their own generator only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmkit.api.outputs import TokenLogprob
from lmkit.api.sampling_kernels import SamplingKernels
from lmkit.sample.drafts import VerifiedTokens, seeded_uniforms
from lmkit.sample.draws import adjust_logits, compute_probs, sample_from_probs
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import row_logprobs
from lmkit.spec_decode.tree import DraftTree


@dataclass
class TreeVerified(VerifiedTokens):
    """:class:`~lmkit.sample.drafts.VerifiedTokens` plus, per request, the accepted
    draft nodes in path order (indices into its drafts, 1-based; empty: none)."""

    paths: list[list[int]] | None = None


def verify_tree(logits: torch.Tensor, md: SamplingMetadata, tree: DraftTree,
                drafts: Sequence[Sequence[int]], kernels: SamplingKernels
                ) -> TreeVerified:
    """Walk each request's draft tree (see the module docstring).

    Args:
        logits: ``[rows, vocab]``, ``len(drafts[i]) + 1`` consecutive rows per request
            (root, then its drafts); not modified.
        md: one row per logits row.
        tree: the tree; request ``i``'s drafts are its first ``len(drafts[i])`` nodes.
        drafts: per request its draft token ids, in node order.
        kernels: the engine's sampling kernels (penalties, argmax).

    Returns:
        per request the accepted drafts' tokens then one more, the accepted count, the
        accepted nodes, ``no_allowed_token`` for a final row with nothing allowed and,
        for requests asking, each emitted token's logprobs (from the raw logits of the
        row that emitted it: the root's, then each accepted node's).
    """
    counts = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
    starts = np.cumsum(counts + 1) - (counts + 1)
    if logits.shape[0] != md.num_rows or md.num_rows != int(counts.sum()) + len(drafts):
        raise ValueError(f"verify_tree expects one logits row per draft plus one per "
                         f"request ({int(counts.sum()) + len(drafts)}); got logits "
                         f"{tuple(logits.shape)}, metadata {md.num_rows} rows")
    device = logits.device
    raw_logprobs = (logits[md.logprob_rows].float().log_softmax(dim=-1)
                    if md.logprob_rows is not None else None)
    logits = logits.to(torch.float32, copy=True)
    if md.needs_logit_adjustment:
        logits = adjust_logits(logits, md, kernels)
    no_token = logits.amax(dim=-1) == float("-inf") if md.may_allow_no_token else None
    parts = [kernels.argmax(logits).double()]
    # every draft node: the row of its parent, and its token
    node_req = np.repeat(np.arange(len(drafts)), counts)
    node = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    parent_rows = starts[node_req] + tree.parents[node]
    tokens = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=len(node))
    if not md.all_greedy:
        probs = compute_probs(logits, md)
        rows_t = torch.from_numpy(parent_rows).to(device)
        tokens_t = torch.from_numpy(tokens).to(device)
        p_child = probs[rows_t, tokens_t]
        residual = probs.clone()
        residual[rows_t, tokens_t] = 0.0  # the token after a node is never one of its drafts
        after = sample_from_probs(residual, md.generators)  # (drawn before the uniforms)
        uniform = torch.rand(len(node), device=device)  # one per node; seeded: its own
        seeded_uniforms(uniform, md.generators, starts.tolist(), counts.tolist())
        parts += [after.double(), residual.sum(dim=-1).double(), p_child.double(),
                  uniform.double()]
    mixed = not (md.all_greedy or md.all_random)  # which rows are greedy: read back too
    if mixed:
        parts.append(md.is_greedy.double())
    if no_token is not None:
        parts.append(no_token.double())
    host = torch.cat(parts).cpu().numpy()  # the one device-to-host copy
    rows = md.num_rows
    greedy = host[:rows].astype(np.int64)
    random = None
    if not md.all_greedy:
        nn = len(node)
        random = (host[rows:2 * rows].astype(np.int64), host[2 * rows:3 * rows],
                  host[3 * rows:3 * rows + nn], host[3 * rows + nn:3 * rows + 2 * nn])
    empty = host[-rows:] > 0.5 if no_token is not None else None
    tail = rows if no_token is not None else 0
    is_greedy = host[len(host) - tail - rows:len(host) - tail] > 0.5 if mixed else None
    node_first = np.cumsum(counts) - counts  # each request's first node among all nodes
    out = TreeVerified([], [], paths=[])
    assert out.paths is not None
    for i, (start, n) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        if md.all_greedy or (is_greedy is not None and bool(is_greedy[start])):
            path, bonus = _greedy_walk(greedy, start, n, drafts[i], tree)
            cur = path[-1] if path else 0
        else:
            assert random is not None
            res, res_mass, p, u = random
            path, cur, bonus = [], 0, -1
            while True:
                kids = [(c, int(drafts[i][c - 1])) for _, c in tree.child_ranks(cur, n)]
                nxt, rejected, seen = None, 0.0, set()
                for c, t in kids:
                    j = node_first[i] + c - 1
                    pc = 0.0 if t in seen else float(p[j])
                    if u[j] * (1.0 - rejected) < pc:
                        nxt = c
                        break
                    rejected += pc
                    seen.add(t)
                # nothing left after the children (rounding): the last one tried
                bonus = int(res[start + cur]) if res_mass[start + cur] > 0 or not kids else (
                    kids[-1][1])
                if nxt is None:
                    break
                path.append(nxt)
                cur = nxt
        out.token_ids.append([int(drafts[i][c - 1]) for c in path] + [bonus])
        out.num_accepted.append(len(path))
        out.paths.append(path)
        if empty is not None and empty[start + cur]:
            out.no_allowed_token[i] = len(path)
    if raw_logprobs is not None:
        out.logprobs = _emitted_logprobs(out, starts, raw_logprobs, md)
    return out


def verify_tree_greedy(logits: torch.Tensor, tree: DraftTree, drafts: Sequence[Sequence[int]],
                       kernels: SamplingKernels) -> TreeVerified:
    """:func:`verify_tree` for requests whose every row takes the argmax of its logits as
    they are (plain greedy: no penalties, bans, bias, allowed ids, processors or
    logprobs, ``min_tokens`` reached; a grammar's mask already applied): one argmax and
    one device-to-host copy, no sampling metadata."""
    sizes = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
    starts = np.cumsum(sizes) - sizes
    greedy = kernels.argmax(logits).cpu().numpy()
    out = TreeVerified([], [], paths=[])
    assert out.paths is not None
    for start, n, d in zip(starts.tolist(), (sizes - 1).tolist(), drafts, strict=True):
        path, bonus = _greedy_walk(greedy, start, n, d, tree)
        out.token_ids.append([int(d[c - 1]) for c in path] + [bonus])
        out.num_accepted.append(len(path))
        out.paths.append(path)
    return out


def _greedy_walk(greedy: np.ndarray, start: int, n: int, drafts: Sequence[int],
                 tree: DraftTree) -> tuple[list[int], int]:
    """The accepted nodes of a request whose rows (from ``start``) have argmax
    ``greedy``: at each node the child drafting its argmax; and the token after them."""
    path: list[int] = []
    cur = 0
    while True:
        target = int(greedy[start + cur])
        nxt = next((c for _, c in tree.child_ranks(cur, n) if drafts[c - 1] == target), None)
        if nxt is None:
            return path, target
        path.append(nxt)
        cur = nxt


def _emitted_logprobs(out: TreeVerified, starts: np.ndarray, raw_logprobs: torch.Tensor,
                      md: SamplingMetadata) -> list[list[TokenLogprob]]:
    """Each request's emitted tokens' logprobs (empty for requests not asking): token
    ``j`` was emitted at the root's row (``j = 0``) or at accepted node ``j``'s."""
    assert out.paths is not None
    emitted = np.zeros(md.num_rows, dtype=np.int64)
    rows_of = []
    for start, tokens, path in zip(starts.tolist(), out.token_ids, out.paths, strict=True):
        rows = [start, *(start + c for c in path)]
        emitted[rows] = tokens
        rows_of.append(rows)
    per_row = row_logprobs(torch.from_numpy(emitted).to(raw_logprobs.device), raw_logprobs, md)
    assert per_row is not None
    return [[lp for r in rows if (lp := per_row[r]) is not None] for rows in rows_of]

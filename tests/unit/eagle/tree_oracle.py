"""Plant the true continuation on a draft tree's nodes (tests): wrap the runner's tree
drafting so that the nodes of one rank path carry the target's own greedy tokens, and
count the accepted nodes moved to a chain's slots. Used in the test process
(``monkeypatch.setattr``) and, under tensor parallelism, in every worker process
(``tp_site/sitecustomize.py``, plain ``setattr``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def plant(truth: Sequence[Sequence[int]], tree_paths: Sequence[Sequence[int]],
          path: Sequence[int] = (1, 0, 0),
          setattr_: Callable[[Any, str, Any], None] = setattr) -> list[int]:
    """Make every drafted tree carry, on the nodes of rank path ``path`` and its
    prefixes, the continuation in ``truth`` (prompt + greedy output token ids, per
    request) of the request's tokens so far; returns, per verified step, how many
    accepted nodes moved to a chain's slots (appended as steps run)."""
    import lmkit.worker.draft_runner as draft_runner
    import lmkit.worker.step_sampling as step_sampling
    from lmkit.spec_decode.tree import DraftTree

    tree = DraftTree.from_paths(tree_paths)
    planted = [tree.paths.index(tuple(path[:d])) + 1 for d in range(1, len(path) + 1)]
    real_draft, real_compact = draft_runner.draft_tree, step_sampling.compact_accepted
    moved: list[int] = []

    def oracle(drafter, tree, feat, last, num_drafts, req_rows, tables, step_index):
        out = real_draft(drafter, tree, feat, last, num_drafts, req_rows, tables, step_index)
        for n, (i, row) in enumerate(zip(step_index, req_rows, strict=True)):
            rid = drafter.input_batch.req_ids[row]
            state, drafts = drafter.requests[rid], out.get(i)
            committed = [*state.prompt_token_ids, *state.output_token_ids]
            full = next((t for t in truth if list(t[:len(committed)]) == committed), None)
            # the drafts follow the token after the last kept position (the one the step
            # sampled, committed or not yet: lmkit.worker.early_drafts)
            known = int(last[n]) + 2
            for depth, node in enumerate(planted if full is not None else (), start=1):
                if drafts is not None and node <= len(drafts) and known + depth <= len(full):
                    drafts[node - 1] = full[known + depth - 1]
        return out

    def spy(groups, kv_caches, step, plan, paths, features):
        moved.append(sum(node != j for p in paths for j, node in enumerate(p, start=1)))
        return real_compact(groups, kv_caches, step, plan, paths, features)

    setattr_(draft_runner, "draft_tree", oracle)
    setattr_(step_sampling, "compact_accepted", spy)
    return moved

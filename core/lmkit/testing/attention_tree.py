"""The attention suite's ``tree mask`` property: draft-tree attention
(:class:`~lmkit.api.AttentionMetadata` ``tree_region`` / ``tree_mask``), for backends
whose spec claims the ``tree_mask`` feature.

Speculative decoding verifies a token tree in one step (each node sees the context and
its ancestors) and a draft head drafts it level by level. The check drives an
:class:`~lmkit.testing.attention_world.AttentionWorld`: it prefills four requests' contexts
(compared with causal attention as every property does), then runs steps whose tree
requests carry random trees, each output compared with dense attention over the keys
the contract lets the token see (softmax over the allowed keys, in float64):

1. ``verify trees``: a 64-node tree (the largest region, so mask bit 63, the sign bit,
   is used) and a 10-node tree, each query = root + nodes with a region of exactly the
   query, mixed with a causal prefill chunk and a causal decode (region 0, their mask
   entries random: ignored);
2. ``draft the next level``: regions larger than the query: the region holds nodes
   written by the earlier step (read from the cache) and the queries are the last nodes
   (three children; one node whose region slides past the first tree's root);
3. ``single-token tree queries``: every query one token (a step a backend might
   otherwise give its decode kernel), tree requests and a causal decode together.

With a claimed ``sliding_window`` the steps run again with a window of 7 (by each query
token's slot index), and with a claimed ``logits_soft_cap`` again capped at 1.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lmkit.api.attention import MAX_TREE_REGION
from lmkit.testing.attention_world import (
    TOLERANCES,
    AttentionCase,
    AttentionWorld,
    dense_attention,
    masked_attention,
    tolerance_error,
)
from lmkit.testing.failure import NotApplicable, Target

SUITE = KIND = "attention"
PROPERTY = "tree mask"
FEATURE = "tree_mask"

#: a tree step's work item: (rid, number of new nodes, their parents); a parent is an
#: earlier key position of the request in the tree (-1: a root), ``None`` for a
#: causal request (region 0)
TreeWork = tuple[int, int, list[int] | None]


def to_int64(bits: int) -> int:
    """``bits`` (0 .. 2**64 - 1) as the int64 with that bit pattern (bit 63: negative)."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def tree_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, region: int,
                   masks: list[int], scale: float, window: int | None,
                   soft_cap: float | None) -> torch.Tensor:
    """Dense attention of one tree request's query tokens (float64): ``q`` ``[q_len, H,
    D]``, the last ``q_len`` of the ``L`` keys ``keys``/``values`` ``[L, Hkv, D]``;
    token ``i`` sees key ``p`` when ``p < L - region`` or bit ``p - (L - region)`` of
    ``masks[i]`` is set, and (with a window) ``p > L - q_len + i - window``."""
    q_len, total = q.shape[0], keys.shape[0]
    lo = total - region
    allowed = torch.zeros(q_len, total, dtype=torch.bool)
    for i, m in enumerate(masks):
        for p in range(total):
            allowed[i, p] = p < lo or bool((m >> (p - lo)) & 1)
            if window is not None and p <= total - q_len + i - window:
                allowed[i, p] = False
    return masked_attention(q, keys, values, allowed, scale, soft_cap)


class TreeDriver:
    """Tree steps over an :class:`AttentionWorld`: each request's tree nodes by key
    position (``parents[rid][pos]``, -1 for a root) and the metadata a runner gives."""

    def __init__(self, world: AttentionWorld) -> None:
        self.world = world
        self.parents: dict[int, dict[int, int]] = {}

    def random_parents(self, rid: int, num_nodes: int, region: int) -> list[int]:
        """Parents for ``num_nodes`` new nodes of ``rid``: each a random earlier node of
        the request's tree inside the step's region (the first ever: a root)."""
        start = self.world.context_len(rid)
        lo = start + num_nodes - region
        known = [p for p in self.parents.get(rid, {}) if p >= lo]
        out = []
        for i in range(num_nodes):
            if not known:
                out.append(-1)
            else:
                pick = int(torch.randint(len(known), (1,), generator=self.world.gen))
                out.append(known[pick])
            known.append(start + i)
        return out

    def mask(self, rid: int, pos: int, lo: int) -> int:
        """The int64 mask entry of ``rid``'s node at ``pos`` with its region at ``lo``:
        the node and its ancestors inside the region."""
        bits, node = 0, pos
        while node >= lo:
            bits |= 1 << (node - lo)
            node = self.parents[rid].get(node, -1)
        return to_int64(bits)

    def step(self, work: list[TreeWork], region_of: dict[int, int]
             ) -> tuple[str, int, int, int] | None:
        """Run one tree step; the first wrong request as ``(detail, rid, context,
        query_len)``, else ``None``. ``region_of``: each tree request's region."""
        w, c = self.world, self.world.case
        work = [x for x in work if x[1] == 1] + [x for x in work if x[1] != 1]
        contexts = {rid: w.context_len(rid) for rid, _, _ in work}
        qs, ks, vs, masks, regions = [], [], [], [], []
        for rid, n, parents in work:
            req = w.reqs[rid]
            w._ensure_blocks(req, contexts[rid] + n)
            q, k, v = (_rand(w, n, h, c.head_size) for h in
                       (c.num_heads, c.num_kv_heads, c.num_kv_heads))
            req.keys = torch.cat([req.keys, c.stored(k, 0)])
            req.values = torch.cat([req.values, c.stored(v, 1)])
            qs.append(q)
            ks.append(k)
            vs.append(v)
            if parents is None:  # causal: the entries are noise the backend must ignore
                regions.append(0)
                masks.append([to_int64(int(torch.randint(1 << 62, (1,), generator=w.gen)))
                              for _ in range(n)])
                continue
            region = region_of[rid]
            lo = contexts[rid] + n - region
            nodes = self.parents.setdefault(rid, {})
            for i, parent in enumerate(parents):
                nodes[contexts[rid] + i] = parent
            regions.append(region)
            masks.append([self.mask(rid, contexts[rid] + i, lo) for i in range(n)])
        md = w.metadata([(rid, n) for rid, n, _ in work], contexts)
        flat = [m for ms in masks for m in ms]
        md = replace(md, tree_region=torch.tensor(regions, dtype=torch.int32, device=c.device),
                     tree_region_cpu=torch.tensor(regions, dtype=torch.int32),
                     tree_mask=torch.tensor(flat, dtype=torch.int64, device=c.device))

        def dev(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts).to(dtype=c.dtype, device=c.device)

        w.backend.plan(md)
        out = w.backend.run(0, dev(qs), dev(ks), dev(vs), w.cache)
        w.num_steps += 1
        out64 = out.detach().to("cpu", torch.float64)
        atol, rtol = TOLERANCES.get(c.dtype, (1e-2, 1e-2))
        start = 0
        scale = c.head_size ** -0.5
        for (rid, n, _), q, ms, region in zip(work, qs, masks, regions, strict=True):
            req = w.reqs[rid]
            if region:
                ref = tree_reference(q, req.keys, req.values, region, ms, scale,
                                     c.sliding_window, c.logits_soft_cap)
            else:
                ref = dense_attention(q, req.keys, req.values, contexts[rid], scale,
                                      c.sliding_window, c.logits_soft_cap)
            error = tolerance_error(out64[start:start + n], ref, atol, rtol, contexts[rid])
            start += n
            if error is not None:
                kind = f"tree region {region}" if region else "causal (region 0)"
                return (f"{kind}: output differs from attention over the keys its mask "
                        f"allows: {error}", rid, contexts[rid], n)
        return None


def _rand(w: AttentionWorld, *shape: int) -> torch.Tensor:
    """Random data as the backend's dtype sees it, in float64 (CPU)."""
    x = torch.randn(*shape, generator=w.gen, dtype=torch.float32)
    return x.to(w.case.dtype).to(torch.float64)


def _run_tree_steps(t: Target, case: AttentionCase, num_blocks: int) -> None:
    backend = t.build(SUITE, KIND, PROPERTY, case.describe(), **case.kwargs(t.options))
    world = AttentionWorld(backend, case, num_blocks, seed=3)
    bs = case.block_size
    driver = TreeDriver(world)
    where = case.describe()
    bad = world.step([(0, bs + 3), (1, 2 * bs + 5), (2, 7), (3, 3 * bs + 1)])
    if bad is not None:
        raise t.fail(SUITE, PROPERTY, f"{where}; step 1 (prefill the contexts)",
                     f"request {bad.rid}: {bad.detail}")
    big = MAX_TREE_REGION
    # per step: (rid, new tokens) and the tree requests' regions (the others are causal)
    plan: list[tuple[str, list[tuple[int, int]], dict[int, int]]] = [
        ("verify trees", [(0, big), (1, 5), (2, 1), (3, 10)], {0: big, 3: 10}),
        ("draft the next level", [(3, 3), (0, 1)], {3: 13, 0: big}),
        ("single-token tree queries", [(3, 1), (2, 1), (0, 1)], {3: 14, 0: big}),
    ]
    for label, items, regions in plan:
        work: list[TreeWork] = [
            (rid, n, driver.random_parents(rid, n, regions[rid]) if rid in regions else None)
            for rid, n in items]
        described = ", ".join(f"req {rid}: context {world.context_len(rid)}, query {n}"
                              + (f", region {regions[rid]}" if rid in regions else "")
                              for rid, n, _ in work)
        step_where = f"{where}; step {world.num_steps + 1} ({label}): [{described}]"
        try:
            result = driver.step(work, regions)
        except Exception as e:
            raise t.fail(SUITE, PROPERTY, step_where,
                         f"plan()/run() raised {type(e).__name__}: {e}") from e
        if result is not None:
            detail, rid, context, n = result
            raise t.fail(SUITE, PROPERTY, step_where,
                         f"request {rid} (context {context}, query {n}): {detail}")


def check_tree_mask(t: Target, base: AttentionCase, num_blocks: int) -> None:
    """The ``tree mask`` property (see the module doc) on ``base``, then with a sliding
    window and a soft cap when claimed; only for specs claiming ``tree_mask``, whose
    class must declare ``supports_tree_mask``."""
    declared = bool(getattr(t.cls, "supports_tree_mask", False))
    if not t.has_feature(FEATURE, default=declared):  # no spec: as the class declares
        raise NotApplicable(f"{t.name} does not claim {FEATURE!r}")
    if not declared:
        raise t.fail(SUITE, PROPERTY, base.describe(),
                     "the spec claims 'tree_mask' but the class does not declare "
                     "supports_tree_mask = True")
    cases = [base]
    window = 7 if t.has_feature("sliding_window") else None
    if window:
        cases.append(replace(base, sliding_window=window))
    if t.has_feature("logits_soft_cap"):
        cases.append(replace(base, sliding_window=window, logits_soft_cap=1.0))
    for case in cases:
        _run_tree_steps(t, case, num_blocks)

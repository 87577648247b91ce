"""Draft trees (:mod:`lmkit.spec_decode.tree`) and their verification
(:mod:`lmkit.sample.tree_verify`): the tree's layout and refusals, the greedy walk, the
emitted tokens' distribution with deterministic drafts (and a biased walk that the
check catches), seeds, and penalties seeing the path to each node."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import SpeculativeConfig
from lmkit.errors import ConfigError
from lmkit.sample import tree_verify
from lmkit.sample.kernels import TorchSamplingKernels
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import make_generator
from lmkit.spec_decode.rows import sampling_rows
from lmkit.spec_decode.tree import DraftTree
from pydantic import ValidationError
from test_spec_rejection import chi_square_p_value

CPU = torch.device("cpu")
KERNELS = TorchSamplingKernels(device=None)
#   0 (root)
#   |- 1 (0,)  |- 3 (0,0)  |- 6 (0,0,0)
#   |          |- 4 (0,1)
#   |- 2 (1,)  |- 5 (1,0)
TREE = DraftTree.parse("[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]")


def test_the_tree_is_breadth_first_with_parents_depths_and_ancestor_masks():
    shuffled = DraftTree.from_paths([(0, 0, 0), (1, 0), (0, 1), (1,), (0, 0), (0,)])
    assert shuffled.paths == TREE.paths
    assert TREE.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert TREE.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert TREE.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert [TREE.path_to(i) for i in range(7)] == [[], [1], [2], [1, 3], [1, 4], [2, 5],
                                                   [1, 3, 6]]
    for i in range(7):  # bit j: j is i or one of its ancestors
        assert [j for j in range(7) if TREE.masks[i] >> j & 1] == sorted([0, *TREE.path_to(i)])
    assert (TREE.num_nodes, TREE.widest_parent_level) == (6, 2)  # depth 1: nodes 1, 2
    assert TREE.child_ranks(1) == [(0, 3), (1, 4)] and TREE.child_ranks(1, num_nodes=3) == [(0, 3)]
    chain = DraftTree.from_paths([(0,) * d for d in range(1, 64)])
    assert chain.masks[63] == -1  # all 64 bits, the sign bit too


@pytest.mark.parametrize(("paths", "message"), [
    ([], "no nodes"), ([[0], [0]], r"\[0\] is given twice"),
    ([[0, 1]], r"\[0, 1\] has no parent \[0\]"), ([[0], [-1]], "not a rank path"),
    ([[0], []], "not a rank path"), ([[0], [True]], "not a rank path"),
    ([[i] for i in range(64)], "64 nodes; at most 63"),
])
def test_trees_that_are_not_trees_are_refused(paths, message):
    with pytest.raises(ConfigError, match=message):
        DraftTree.from_paths(paths)


def test_the_config_takes_json_sets_k_and_refuses_a_contradicting_k():
    assert SpeculativeConfig(tree="[[1], [0]]").num_speculative_tokens == 2
    assert SpeculativeConfig(tree=[[0], [0, 0]], num_speculative_tokens=2).tree == [[0], [0, 0]]
    with pytest.raises(ValidationError, match="num_speculative_tokens is 3 but the tree has 2"):
        SpeculativeConfig(tree=[[0], [1]], num_speculative_tokens=3)
    with pytest.raises(ValidationError, match="is neither JSON"):
        SpeculativeConfig(tree="[[0], [1]")


def rows_metadata(params, drafts, generators=None, outputs=None, vocab=8):
    """Sampling metadata of tree rows (each node's output: the drafts on its path)."""
    states = []
    for i, (p, d) in enumerate(zip(params, drafts, strict=True)):
        states.append((_State(p, list(outputs[i]) if outputs else [],
                              generators[i] if generators else None), 0, d))
    r = sampling_rows(states, TREE)
    return SamplingMetadata.build(r.params, r.prompts, r.outputs, r.generators,
                                  r.eos_token_ids, vocab, CPU)


class _State:
    def __init__(self, params, output, generator):
        self.sampling_params, self.output_token_ids, self.generator = params, output, generator
        self.prompt_token_ids, self.eos_token_id = [0], None


def peaked(argmax_rows, vocab=8):
    logits = torch.full((len(argmax_rows), vocab), -4.0)
    logits[torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 4.0
    return logits


def test_the_greedy_walk_takes_the_matching_child_at_each_depth():
    greedy = SamplingParams(temperature=0.0)
    # request 0: the target follows node 2 (second rank), then node 5, then emits 7
    # request 1: only its first 3 drafts; the root's argmax matches node 1, then 4 is new
    # request 2: no drafts: one sampled token
    drafts = [[1, 2, 3, 4, 5, 6], [6, 5, 3], []]
    argmax = [2, 0, 5, 0, 0, 7, 0] + [6, 4, 0, 0] + [3]
    out = tree_verify.verify_tree(peaked(argmax), rows_metadata([greedy] * 3, drafts), TREE,
                                  drafts, KERNELS)
    assert out.token_ids == [[2, 5, 7], [6, 4], [3]]
    assert out.num_accepted == [2, 1, 0] and out.paths == [[2, 5], [1], []]


def emitted_distribution(walk, p_rows, drafts, trials, seed=0):
    """How often each first token (and the pair after node 1) comes out of ``trials``
    verifications of one request whose rows all have distribution ``p_rows``."""
    params = [SamplingParams(temperature=1.0)] * trials
    logits = torch.log(p_rows).repeat(trials, 1)
    torch.manual_seed(seed)
    out = walk(logits, rows_metadata(params, [drafts] * trials), TREE, [drafts] * trials,
               KERNELS)
    return [t[0] for t in out.token_ids], [tuple(t[:2]) for t in out.token_ids if len(t) > 1]


def test_sampled_walks_emit_the_target_distribution():
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.02, 0.08, 0.15, 0.05])
    rows = torch.stack([p] * 7)  # every node's row: the same distribution
    drafts = [3, 1, 6, 0, 7, 3]  # root's children: 3 (rank 0), 1; node 1's: 6, 0
    trials = 40_000
    firsts, pairs = emitted_distribution(tree_verify.verify_tree, rows, drafts, trials)
    counts = torch.bincount(torch.tensor(firsts), minlength=8).double()
    assert chi_square_p_value(counts, p.double()) > 1e-3, counts / trials
    # after the first draft (token 3, node 1) the second token has the target's p too
    second = torch.bincount(torch.tensor([b for a, b in pairs if a == 3]), minlength=8)
    assert chi_square_p_value(second.double(), p.double()) > 1e-3, second / second.sum()
    # drafts past the first are reached: the walk accepts beyond the root's children
    assert len(pairs) > 0.25 * trials


def test_a_walk_that_skips_the_renormalisation_is_caught(monkeypatch):
    # accepting child c with p(c) instead of p(c) / (1 - rejected) favours later siblings
    def biased(logits, md, tree, drafts, kernels):
        out = tree_verify.verify_tree(logits, md, tree, drafts, kernels)
        for t in out.token_ids:  # a second-ranked root draft (1) stands for a rejected 3
            if t[0] == 3 and np.random.rand() < 0.3:
                t[0] = 1
        return out

    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.02, 0.08, 0.15, 0.05])
    np.random.seed(0)
    firsts, _ = emitted_distribution(biased, torch.stack([p] * 7), [3, 1, 6, 0, 7, 3], 20_000)
    counts = torch.bincount(torch.tensor(firsts), minlength=8).double()
    assert chi_square_p_value(counts, p.double()) < 1e-6


def test_seeded_walks_repeat_and_depend_only_on_their_generator():
    p = torch.softmax(torch.randn(7, 8, generator=torch.Generator().manual_seed(1)), dim=-1)
    drafts = [int(p[0].argmax()), 1, 2, 3, 4, 5]
    params = [SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=0.9)]

    def walk(other_rows):
        logits = torch.cat([torch.log(p), torch.log(other_rows)])
        gens = [make_generator(5, CPU), None]
        md = rows_metadata(params, [drafts, drafts], generators=gens)
        return tree_verify.verify_tree(logits, md, TREE, [drafts, drafts], KERNELS).token_ids[0]

    first = walk(p)
    assert all(walk(torch.softmax(torch.randn(7, 8), -1)) == first for _ in range(5))


def test_penalties_see_the_path_to_each_node_not_the_earlier_siblings():
    # greedy under a repetition penalty (positive logits divided by 10 once seen)
    p = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    logits = torch.zeros(7, 8)
    logits[:, 4], logits[:, 5], logits[:, 2] = 2.0, 1.0, 0.5
    drafts = [4, 2, 5, 4, 4, 6]  # node 1 = 4, its sibling node 2 = 2; node 3 = 5
    md = rows_metadata([p], [drafts], outputs=[[7]])
    out = tree_verify.verify_tree(logits, md, TREE, [drafts], KERNELS)
    # root row: 4; node 1's row sees [7, 4]: 5 (node 3); node 3's row sees [7, 4, 5],
    # not the sibling's 2: 2 (0.5) beats 4 (0.2) and 5 (0.1). Chain rows would have
    # seen 2 too and emitted 4.
    assert out.token_ids == [[4, 5, 2]] and out.paths == [[1, 3]]


def test_the_stack_needs_tree_attention_and_a_draft_head():
    from types import SimpleNamespace

    from lmkit.api import LMKitConfig
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.plugin_host.resolve import resolve_stack
    from lmkit.worker.tree_step import tree_of

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})

    def config(**sections):
        return LMKitConfig.model_validate({"executor": {"device": "cpu"}, **sections})

    tree = {"backend": "eagle", "model": "/nowhere", "tree": [[0], [1]]}
    assert resolve_stack(config(speculative=tree), host).get("attention").name in ("cpu", "torch")
    with pytest.raises(ConfigError, match="tree_mask"):  # a backend without tree attention
        resolve_stack(config(speculative=tree, attention={"backend": "mla_torch"}), host)
    eagle = SimpleNamespace(get=lambda kind: host.registry.get("speculative", "eagle"))
    assert tree_of(config(speculative=tree), eagle).num_nodes == 2
    assert tree_of(config(speculative={"backend": "eagle"}), eagle) is None
    # tensor parallelism: every rank drafts and walks the same tree (test_spec_tree_tp.py)
    assert tree_of(config(speculative=tree, parallel={"tensor_parallel_size": 2}),
                   eagle).num_nodes == 2


def test_acceptance_by_position_counts_depths_under_a_tree():
    from lmkit.spec_decode.stats import SpecDecodeStats

    stats = SpecDecodeStats(6, TREE.depths.tolist())
    stats.record_step({"a": 6, "b": 2}, {"a": 2, "b": 1})  # b: nodes 1-2, depth 1 only
    assert (stats.drafted_at, stats.accepted_at) == ([2, 1, 1], [2, 1, 0])
    assert set(stats.as_dict()) >= {"spec_acceptance_rate_pos_2"}
    assert "spec_acceptance_rate_pos_3" not in stats.as_dict()


def test_tree_rows_get_depth_positions_and_masks_and_rows_before_them_stay_causal():
    from types import SimpleNamespace

    from lmkit.errors import PluginError
    from lmkit.worker.tree_step import mark_tree_rows

    # a plain decode (1 row at position 9); then 2 rows a scheduler put before a root
    # and its 3 drafts (positions 20..25 before marking)
    step = SimpleNamespace(positions=torch.tensor([9, 20, 21, 22, 23, 24, 25]),
                           cu_num_tokens=np.array([1, 7]), num_scheduled=np.array([1, 6]),
                           num_tokens=7)
    mark_tree_rows(step, ["a", "b"], {"b": [5, 6, 7]}, TREE)
    assert step.positions.tolist() == [9, 20, 21, 22, 23, 23, 24]  # root 22, depths 0,1,1,2
    assert step.tree_region.tolist() == [0, 6]
    bits = [[j for j in range(6) if m >> j & 1] for m in step.tree_mask[1:].tolist()]
    assert bits == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 3, 5]]
    untouched = SimpleNamespace(positions=torch.tensor([3]), cu_num_tokens=np.array([1]),
                                num_scheduled=np.array([1]), num_tokens=1, tree_mask=None)
    assert mark_tree_rows(untouched, ["a"], {}, TREE).tree_mask is None
    too_long = SimpleNamespace(positions=torch.arange(70), cu_num_tokens=np.array([70]),
                               num_scheduled=np.array([70]), num_tokens=70)
    with pytest.raises(PluginError, match="70 tokens scheduled with 3 tree drafts"):
        mark_tree_rows(too_long, ["b"], {"b": [1, 2, 3]}, TREE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_kv_slots_moves_accepted_nodes_reading_every_source_first(dtype):
    from lmkit_plugins.attention.torch_ref import TorchAttention

    attn = TorchAttention(num_heads=2, num_kv_heads=2, head_size=4, scale=1.0,
                          dtype=torch.float32, device="cpu", block_size=4)
    cache = torch.randn(attn.kv_cache_shape(3)).to(dtype)
    before = cache.clone()
    # path [2, 5] of a root at slot 3: node 2 (slot 5) -> slot 4, node 5 (slot 8) -> slot 5
    attn.copy_kv_slots(cache, torch.tensor([5, 8]), torch.tensor([4, 5]))

    def at(t, slot):
        return t[:, slot // 4, slot % 4].float()

    assert torch.equal(at(cache, 4), at(before, 5)) and torch.equal(at(cache, 5), at(before, 8))
    untouched = [s for s in range(12) if s not in (4, 5)]
    assert all(torch.equal(at(cache, s), at(before, s)) for s in untouched)


def test_logprobs_are_those_of_each_emitted_tokens_row():
    asking = SamplingParams(temperature=0.0, logprobs=2)
    drafts = [[1, 2, 3, 4, 5, 6], [6, 5, 3]]
    argmax = [2, 0, 5, 0, 0, 7, 0] + [6, 4, 0, 0]  # request 0 walks 2 -> 5, emits 7
    logits = peaked(argmax) + torch.randn(11, 8, generator=torch.Generator().manual_seed(0))
    md = rows_metadata([asking, SamplingParams(temperature=0.0)], drafts)
    out = tree_verify.verify_tree(logits, md, TREE, drafts, KERNELS)
    assert out.token_ids[0] == [2, 5, 7] and out.logprobs is not None
    raw = logits.log_softmax(-1)
    # token j from the root's row, then from node 2's row, then node 5's
    for lp, row, token in zip(out.logprobs[0], [0, 2, 5], [2, 5, 7], strict=True):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(raw[row, token]), abs=1e-6)
    assert out.logprobs[1] == []  # not asking


def test_the_plain_greedy_walk_equals_the_general_one():
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(3)
    drafts = [[int(t) for t in torch.randint(0, 4, (n,), generator=g)] for n in (6, 3, 0, 6)]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 8, generator=g)
    logits[:, :4] += 3.0  # argmaxes among the drafts' ids
    for row, node in ((0, 1), (1, 3), (3, 6)):  # request 0 walks nodes 1, 3, 6
        logits[row, drafts[0][node - 1]] += 10.0
    general = tree_verify.verify_tree(logits, rows_metadata([greedy] * 4, drafts), TREE,
                                      drafts, KERNELS)
    fast = tree_verify.verify_tree_greedy(logits, TREE, drafts, KERNELS)
    assert fast.token_ids == general.token_ids and fast.paths == general.paths
    assert fast.num_accepted == general.num_accepted and fast.paths[0] == [1, 3, 6]


def test_a_greedy_request_beside_a_sampled_one_walks_its_argmax():
    drafts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    argmax = [2, 0, 5, 0, 0, 7, 0]  # the greedy request walks nodes 2, 5, then emits 7
    near_flat = torch.zeros(7, 8)  # argmax by 0.5 only: a draw would often miss it
    near_flat[torch.arange(7), torch.tensor(argmax)] = 0.5
    logits = torch.cat([near_flat, torch.zeros(7, 8)])  # the sampled one: uniform
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)]
    out = tree_verify.verify_tree(logits, rows_metadata(params, drafts,
                                                        generators=[None, make_generator(1, CPU)]),
                                  TREE, drafts, KERNELS)
    assert out.token_ids[0] == [2, 5, 7] and out.paths[0] == [2, 5]
    assert all(0 <= t < 8 for t in out.token_ids[1])

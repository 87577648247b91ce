"""lmkit's MoE routing and :class:`~lmkit_plugins.models.moe.SparseMoE` block against
Hugging Face transformers' own modules (float32, CPU): Mixtral's top-k softmax router,
DeepSeek-V2's greedy and group-limited greedy routers, DeepSeek-V3's bias-corrected
sigmoid router with grouped top-k, and whole MoE blocks with shared experts loaded
from checkpoint-named tensors. Plus the refusal of routings lmkit does not build.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lmkit.api import ModelLoadError  # noqa: E402
from lmkit_plugins.models.llama import LlamaDims  # noqa: E402
from lmkit_plugins.models.moe import SparseMoE  # noqa: E402
from lmkit_plugins.models.moe_routing import MoERouting, route  # noqa: E402
from lmkit_plugins.models.tensor_parallel import TensorParallel  # noqa: E402
from moe_hf import (  # noqa: E402
    deepseek_v2_config,
    deepseek_v3_config,
    hf_moe_block,
    mixtral_config,
    randomize,
    sparse_moe_like,
)


def _same_routing(ours, theirs):
    """Equal (weight, id) pairs per token, whatever their order among the top k."""
    w, ids = ours
    hw, hids = theirs
    order, horder = ids.argsort(-1), hids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hids.long().gather(1, horder))
    torch.testing.assert_close(w.gather(1, order), hw.float().gather(1, horder),
                               atol=1e-6, rtol=1e-6)


def _hidden(n=37, width=32, seed=1):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def test_mixtral_router_matches_hf():
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = mixtral_config()
    router = randomize(MixtralTopKRouter(cfg))
    routing = MoERouting.from_hf(cfg)
    assert routing == MoERouting(num_experts=6, top_k=2)
    x = _hidden()
    logits, weights, ids = router(x)
    _same_routing(route(x @ router.weight.T, routing), (weights, ids))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router_matches_hf(method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = deepseek_v2_config(topk_method=method, n_group=4, topk_group=2)
    router = randomize(DeepseekV2TopkRouter(cfg))
    routing = MoERouting.from_hf(cfg)
    assert routing.num_groups == (4 if method == "group_limited_greedy" else 1)
    x = _hidden()
    _, weights, ids = router(x)
    _same_routing(route(x @ router.weight.T, routing), (weights, ids))


def test_deepseek_v3_router_matches_hf():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = deepseek_v3_config()
    router = randomize(DeepseekV3TopkRouter(cfg), seed=2)
    routing = MoERouting.from_hf(cfg)
    assert (routing.scoring, routing.group_score, routing.correction_bias) == (
        "sigmoid", "top2_sum", True)
    x = _hidden(64)
    _, weights, ids = router(x)
    ours = route(x @ router.weight.T, routing, router.e_score_correction_bias)
    _same_routing(ours, (weights, ids))
    # the bias changes the choice but not the weights: without it some choices differ
    plain = route(x @ router.weight.T, routing, torch.zeros(16))
    assert not torch.equal(plain[1].sort(-1)[0], ours[1].sort(-1)[0])
    # every chosen expert lies in one of the token's topk_group=2 groups
    assert all(len(set((row // 4).tolist())) <= 2 for row in ours[1])


@pytest.mark.parametrize("family", ["mixtral", "v2", "v3"])
def test_moe_block_matches_hf(family):
    """Whole blocks loaded from checkpoint names; DeepSeek's with shared experts."""
    cfg, hf = hf_moe_block(family)
    ours = sparse_moe_like(cfg, hf)
    assert (ours.shared_experts is None) == (family == "mixtral")
    x = _hidden(29)
    with torch.inference_mode():
        expected = hf(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_weight_shape_mismatch_is_named():
    cfg = mixtral_config()
    dims = LlamaDims.from_hf(cfg)
    moe = SparseMoE(dims, MoERouting.from_hf(cfg), torch.float32, torch.device("cpu"))
    targets = moe.weight_targets("b")
    with pytest.raises(ValueError, match=r"b.experts.2.w3: checkpoint shape \(4, 32\)"):
        targets["b.experts.2.w3.weight"](torch.zeros(4, 32))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_experts=4, top_k=5), "between 1 and the number of experts"),
    (dict(num_experts=6, top_k=2, num_groups=4), "must divide the number of experts"),
    (dict(num_experts=8, top_k=4, num_groups=4, topk_groups=1), "must hold at least"),
    (dict(num_experts=4, top_k=1, scoring="relu"), "scoring 'relu' is not supported"),
])
def test_invalid_routing_is_refused(kwargs, match):
    with pytest.raises(ModelLoadError, match=match):
        MoERouting(**kwargs)


def test_unknown_topk_method_is_refused():
    cfg = deepseek_v2_config(topk_method="noaux_tc")
    with pytest.raises(ModelLoadError, match="topk_method 'noaux_tc' is not supported"):
        MoERouting.from_hf(cfg)


class _RankOnly(TensorParallel):
    """A rank of a group whose all-reduce is left to the test: it returns the partial."""

    def all_reduce(self, x):
        return x


@pytest.mark.parametrize("family", ["mixtral", "v3"])
def test_tensor_parallel_shards_sum_to_the_whole_block(family):
    """Two ranks' blocks (a slice of every expert and of the shared experts, loaded from
    the same checkpoint names) give partial outputs that add up to the whole block's."""
    cfg, hf = hf_moe_block(family)
    whole = sparse_moe_like(cfg, hf)
    x = _hidden(23)
    partials = []
    for rank in range(2):
        block = sparse_moe_like(cfg, hf, tp=_RankOnly(rank, 2, None))
        assert block.w13.shape[1] == whole.w13.shape[1] // 2
        with torch.inference_mode():
            partials.append(block(x))
    with torch.inference_mode():
        torch.testing.assert_close(partials[0] + partials[1], whole(x), atol=1e-5, rtol=1e-5)


def test_deepseek_v2_norm_topk_prob_renormalises_before_scaling():
    """DeepSeek's own V2 code (transformers' port ignores the flag): the chosen weights
    sum to ``routed_scaling_factor`` with ``norm_topk_prob``, to less without."""
    logits = _hidden(11, 8)
    normed = route(logits, MoERouting.from_hf(deepseek_v2_config(norm_topk_prob=True)))[0]
    torch.testing.assert_close(normed.sum(-1), torch.full((11,), 1.5))
    plain = route(logits, MoERouting.from_hf(deepseek_v2_config()))[0]
    assert bool((plain.sum(-1) < 1.5).all())

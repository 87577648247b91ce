"""Draft-tree attention (``tree_mask``) in the ``triton`` backend and its prefill kernel,
in Triton's CPU interpreter (``TRITON_INTERPRET=1``), at small shapes.

The conformance suite's ``tree mask`` property (:mod:`lmkit.testing.attention_tree`)
runs against the registered spec re-declared for the CPU; a direct launch checks the
kernel's tree variant against the torch reference backend over a batch that mixes a
tree request with causal ones and padding rows. On a GPU the compiled kernels run the
same property in test_conformance_attention.py (``test_gpu_backends_pass_...``); their
front end compiles on the CPU in test_triton_front_end.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from interpret_mode import interpreted_spec, require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit.api import AttentionMetadata  # noqa: E402
from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.testing.attention import NUM_BLOCKS, base_case, check_attention_backend  # noqa: E402
from lmkit.testing.attention_tree import check_tree_mask, to_int64  # noqa: E402
from lmkit.testing.failure import resolve_target  # noqa: E402
from lmkit_kernels.paged_attention import paged_attention  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from lmkit_plugins.attention.triton_backend import TritonAttention  # noqa: E402


def _spec(**values):
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return interpreted_spec(host.registry.get("attention", "triton").spec, **values)


def test_triton_passes_the_tree_mask_property():
    """float32 (32-key tiles), GQA 8/2, head size 64, block size 16."""
    spec = _spec(head_size={64})
    assert "tree_mask" in spec.caps.features
    assert check_attention_backend(spec, only=["tree mask"]) == {"tree mask": "passed"}


@pytest.mark.parametrize(("dtype", "block_size", "heads"),
                         [(torch.float16, 32, (4, 4)), (torch.bfloat16, 16, (8, 1))])
def test_triton_tree_mask_in_half_precision(dtype, block_size, heads):
    """64-key tiles (a region straddling them), MHA and MQA, the other block size."""
    t = resolve_target(_spec(head_size={64}))
    case = replace(base_case(t), dtype=dtype, block_size=block_size, num_heads=heads[0],
                   num_kv_heads=heads[1])
    check_tree_mask(t, case, NUM_BLOCKS)


def _tree_batch():
    """A mixed batch (decode, chunk, a 6-node tree whose region holds 3 earlier nodes,
    a prompt) with padding rows, as paged-batch tensors plus tree metadata."""
    reqs = [(40, 1), (33, 20), (51, 6), (0, 9)]
    batch = make_paged_batch(reqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                             dtype=torch.float32, extra_rows=3, table_width=12, seed=11)
    parents = [-1, 0, 0, 1, 2, 3, 3, 5, 4]  # region: nodes 0-8; the query: nodes 3-8
    ancestors = []
    for node in range(9):
        bits, a = 0, node
        while a >= 0:
            bits |= 1 << a
            a = parents[a]
        ancestors.append(bits)
    regions = torch.tensor([0, 0, 9, 0], dtype=torch.int32)
    rows = batch.q.shape[0]
    mask = torch.randint(-(1 << 62), 1 << 62, (rows,), dtype=torch.int64)  # noise: ignored
    start = int(batch.query_start_loc[2])
    mask[start:start + 6] = torch.tensor([to_int64(b) for b in ancestors[3:]])
    return batch, regions, mask


def test_prefill_kernel_tree_variant_matches_the_reference():
    batch, regions, mask = _tree_batch()
    md = AttentionMetadata(**batch.metadata_kwargs())
    md = replace(md, tree_region=regions, tree_region_cpu=regions, tree_mask=mask)
    ref = TorchAttention(num_heads=8, num_kv_heads=2, head_size=64, scale=64 ** -0.5,
                         dtype=torch.float32, device=torch.device("cpu"), block_size=16)
    ref.plan(md)
    expected = ref.run(0, batch.q, batch.k, batch.v, batch.kv_cache.clone())
    cache = batch.kv_cache.clone()
    tri = TritonAttention(num_heads=8, num_kv_heads=2, head_size=64, scale=64 ** -0.5,
                          dtype=torch.float32, device=torch.device("cpu"), block_size=16)
    tri.plan(md)
    assert tri._plan is not None and tri._plan.num_decodes == 0  # the decode one-token request too
    got = tri.run(0, batch.q, batch.k, batch.v, cache)
    n = batch.num_tokens
    torch.testing.assert_close(got[:n], expected[:n], atol=2e-5, rtol=2e-5)
    # without the tree the tree request is causal, and differs
    causal = paged_attention(batch.q, cache, batch.query_start_loc, batch.seq_lens,
                             batch.block_tables, max_query_len=batch.max_query_len)
    rows = slice(int(batch.query_start_loc[2]), int(batch.query_start_loc[3]))
    assert not torch.allclose(causal[rows], expected[rows], atol=1e-3)
    others = slice(0, rows.start)
    torch.testing.assert_close(causal[others], expected[others], atol=2e-5, rtol=2e-5)


def test_paged_attention_takes_tree_region_and_mask_together():
    batch, regions, mask = _tree_batch()
    args = (batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_tables)
    with pytest.raises(ValueError, match="come together"):
        paged_attention(*args, max_query_len=9, tree_region=regions)
    with pytest.raises(ValueError, match="tree_mask has dtype"):
        paged_attention(*args, max_query_len=9, tree_region=regions, tree_mask=mask.int())
    with pytest.raises(ValueError, match="tree_region"):
        paged_attention(*args, max_query_len=9, tree_region=regions[:2], tree_mask=mask)

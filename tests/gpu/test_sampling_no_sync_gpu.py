"""The sampled step's host-side tensor work never waits for the device: under torch's
CUDA sync debug mode (``"error"``) the kept penalty tables (a new request's prompt,
then each step's new tokens), allowed ids, token bans and the recovery weights of
rejection sampling build without a synchronising call. An indexing assignment of a
Python number (``seen[rows, tokens] = True``) copies it from pageable memory and waits
for the queued work: behind a decode step launched ahead it held every penalised step's
host ~10 ms (session 31); :func:`lmkit.sample.row_cache.put_scalar` makes the number
on the device instead."""

from __future__ import annotations

import contextlib

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit.api.sampling_params import SamplingParams  # noqa: E402
from lmkit.sample.penalties import apply_token_mask  # noqa: E402
from lmkit.sample.rejection import recovery_weights  # noqa: E402
from lmkit.sample.row_cache import SamplingCache  # noqa: E402

CUDA = torch.device("cuda")
VOCAB = 151936


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_kept_tables_and_bans_build_without_a_sync():
    cache = SamplingCache(VOCAB, CUDA)
    params = [SamplingParams(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.3,
                             allowed_token_ids=[5, 9, 100]) for _ in range(8)]
    prompts = [[3 + i, 17, 400 + i] for i in range(8)]
    outputs = [[7, 8 + i] for i in range(8)]
    keys, rows = [f"r{i}" for i in range(8)], list(range(8))
    with no_sync():
        first = cache.penalty_rows(keys, params, prompts, outputs, rows)  # new entries
        for out in outputs:
            out.append(11)
        cache.penalty_rows(keys, params, prompts, outputs, rows)  # one new token each
        slot = cache.allowed_slot("r0", params[0])
        logits = torch.zeros(8, VOCAB, device=CUDA)
        apply_token_mask(logits, torch.arange(8, device=CUDA), torch.full((8,), 2, device=CUDA))
        probs = torch.full((8, VOCAB), 1.0 / VOCAB, device=CUDA)
        weights = recovery_weights(probs, torch.arange(8, device=CUDA),
                                   torch.full((8,), 3, device=CUDA))
    assert bool(first.seen[first.slots[0], 17]) and bool(first.seen[first.slots[0], 8])
    assert int(first.counts[first.slots[2], 11]) == 1 and int(first.counts[first.slots[2], 17]) == 0
    assert bool(cache.allowed_table()[slot, 100]) and not bool(cache.allowed_table()[slot, 6])
    assert torch.isneginf(logits[:, 2]).all() and not torch.isneginf(logits[:, 3]).any()
    assert bool((weights[:, 3] == 0).all()) and bool((weights[:, 4] > 0).all())


def test_the_check_catches_an_indexing_assignment():
    """The debug mode does flag what the helper replaced (else the test above proves
    nothing)."""
    seen = torch.zeros(4, VOCAB, dtype=torch.bool, device=CUDA)
    at = (torch.arange(4, device=CUDA), torch.arange(4, device=CUDA))
    with pytest.raises(RuntimeError, match="synchroniz"), no_sync():
        seen[at] = True

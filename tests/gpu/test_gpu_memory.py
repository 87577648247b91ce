"""KV-cache sizing on CUDA: ``gpu_memory_utilization`` is each engine's own share."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def test_two_engines_in_one_process_both_get_their_share(tmp_path):
    from lmkit import LLM, SamplingParams
    from lmkit.testing.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = LLM(str(model_dir), device="cuda", gpu_memory_utilization=0.3)
    second = LLM(str(model_dir), device="cuda", gpu_memory_utilization=0.3)
    try:
        a, b = first.engine.num_blocks, second.engine.num_blocks
        # the second engine does not count the first one's KV cache against its share
        assert b > 0.8 * a, (a, b)
        outs = [e.generate([[5, 6, 7]], params)[0].outputs[0].token_ids for e in (first, second)]
        assert outs[0] == outs[1] and len(outs[0]) == 8
    finally:
        first.shutdown()
        second.shutdown()


def live_cuda_tensors(top: int = 12) -> list[str]:
    """The largest CUDA tensors Python still reaches, with who holds them (for the
    failure message: what an engine left behind)."""
    import gc

    gc.collect()
    found = []
    for obj in gc.get_objects():
        try:
            if not (isinstance(obj, torch.Tensor) and obj.is_cuda):
                continue
        except Exception:  # noqa: BLE001 - some objects refuse isinstance checks
            continue
        holders = sorted({type(r).__qualname__ for r in gc.get_referrers(obj)
                          if not isinstance(r, list) or len(r) < 1000})[:6]
        found.append((obj.numel() * obj.element_size(), tuple(obj.shape), str(obj.dtype),
                      holders))
    found.sort(key=lambda f: -f[0])
    return [f"{b / 2**20:.1f} MiB {shape} {dtype} held by {holders}"
            for b, shape, dtype, holders in found[:top]]


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_shutdown_returns_the_engines_memory(tmp_path, attention):
    """After ``shutdown`` an engine holds no device memory (KV cache, graphs, lookahead),
    so engines created one after another each get the full share."""
    from lmkit import LLM, SamplingParams
    from lmkit.testing.tiny_model import make_tiny_model

    # head size 64: the smallest the triton backend supports
    model_dir = make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = torch.cuda.memory_allocated()
    blocks = []
    for _ in range(3):  # 3 x 0.6 of the device: only fits if each one is released
        with LLM(str(model_dir), device="cuda", attention=attention,
                 gpu_memory_utilization=0.6) as llm:
            blocks.append(llm.engine.num_blocks)
            assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 8
        left = torch.cuda.memory_allocated() - before
        free, total = torch.cuda.mem_get_info()
        print(f"engine {len(blocks)} ({attention}): {blocks[-1]} blocks; after shutdown "
              f"{left / 2**20:.1f} MiB still allocated, {torch.cuda.memory_reserved() / 2**20:.0f}"
              f" MiB reserved, {free / 2**30:.2f} of {total / 2**30:.2f} GiB free")
        assert left < 64 * 2**20, (f"{left / 2**20:.1f} MiB still allocated after shutdown; "
                                   f"alive: {live_cuda_tensors()}")
    assert min(blocks) > 0.9 * max(blocks), blocks

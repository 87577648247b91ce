"""Tiny random DeepSeek-V2 and V3 models served through the engine by ``mla_triton``'s
kernels in Triton's CPU interpreter: greedy outputs equal transformers' when prompts
are prefilled in chunks of 16 tokens beside other requests' decodes (the absorbed and
the decompressed paths in one step), and after a prefix-cache hit on the latent cache.

The registered ``mla_triton`` runs on CUDA only; this module registers it for the CPU
as ``mla_triton_interpreted`` (a test plugin, ``plugins=[__name__]``). float32.
"""

from __future__ import annotations

import pytest
from interpret_mode import interpreted_spec, require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from deepseek_reference import hf_greedy, tiny_deepseek_and_hf, tokens  # noqa: E402
from lmkit import LLM, SamplingParams  # noqa: E402
from lmkit.api import hookimpl  # noqa: E402
from lmkit_plugins import attention as builtin_attention  # noqa: E402

LMKIT_PLUGIN_API = ">=1.0,<2"
BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=BLOCK, attention="mla_triton_interpreted",
              max_num_batched_tokens=16, plugins=[__name__])


@hookimpl
def register_attention_backends(register):
    specs: list = []
    builtin_attention.register_attention_backends(specs.append)
    register(interpreted_spec(next(s for s in specs if s.name == "mla_triton")))


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def deepseek(request, tmp_path_factory):
    """``(directory, HF model)``: DeepSeek-V2 without q-LoRA, V3 with q-LoRA and YaRN."""
    return tiny_deepseek_and_hf(tmp_path_factory, request.param)



@pytest.mark.slow
def test_greedy_matches_hf_with_prefills_decodes_and_a_prefix_hit(deepseek):
    directory, hf = deepseek
    prefix = tokens(7, 2 * BLOCK + 3)
    prompts = [tokens(1, 5), tokens(2, 21), prefix + [1, 2]]
    with LLM(str(directory), **ENGINE) as llm:
        assert llm.engine.stack.get("attention").name == "mla_triton_interpreted"
        # 16 tokens a step: the longer prompts' chunks run beside the short one's decodes
        outs = llm.generate(prompts, PARAMS)
        again = llm.generate([prefix + [9, 8, 7]], PARAMS)[0]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, PARAMS.max_tokens)
    assert again.num_cached_tokens == 2 * BLOCK
    assert again.outputs[0].token_ids == hf_greedy(hf, prefix + [9, 8, 7], PARAMS.max_tokens)

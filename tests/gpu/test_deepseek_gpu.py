"""A DeepSeek-V2-Lite-shaped model (bf16, CUDA) on each MLA attention backend
(``mla_torch``, ``mla_triton``, ``mla_flashinfer``; one skips, with the reason, where it
cannot run) against transformers' own DeepseekV2 implementation.

The model has DeepSeek-V2-Lite's real sizes (hidden 2048, 16 heads, ``kv_lora_rank``
512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128, no q-LoRA,
YaRN factor 40, vocabulary 102400, 64 routed experts of 1408 with top-6 and 2 shared
ones) but 3 layers: a dense first layer, then two MoE layers (about 1.7B parameters,
3.4 GB in bf16).

Random Gaussian weights would make every argmax a coin toss under bf16 rounding (see
``copy_circuit_model``), so layer 0 is an MLA "previous-token copy" circuit, built the
same way as the Llama one: scores come only from the RoPE part (``q_pe . k_pe`` peaks
at the previous position; ``q_nope`` and ``W_UK`` are zero), the latent ``c_kv`` holds
the token's embedding (its first ``kv_lora_rank`` dimensions), ``W_UV`` and ``o_proj``
copy it back into the residual stream. The argmax is then the token one position back
by a margin of about 25 logits, and only if the latent cache, RoPE (V2's interleaved
pairs, YaRN) and both MLA paths (decompressed prefill, absorbed decode) work. Every
other weight (MoE routers, experts, shared experts, later MLA layers) is small
Gaussian noise, exercising every part without deciding the argmax.

Checks (``test_engine_gpu``'s teacher forcing): lmkit generates greedily in bf16 with
top-5 logprobs of every prompt and output position; transformers scores the same
sequences in bf16 and float32. lmkit's argmax equals HF bf16's at >= 99% of the
positions HF decides stably, and its logprobs are as close to HF float32 as HF's own
bf16 run (mean error at most twice HF bf16's plus 0.02). Greedy tokens (no logprobs)
equal transformers' bf16 ``generate`` and follow the copy circuit.

Run::

    OMP_NUM_THREADS=4 PYTHONPATH=$PWD/core:$PWD/plugins:$PWD/kernels \\
        python -m pytest -q -s tests/gpu/test_deepseek_gpu.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
DEVICE = os.environ.get("LMKIT_GPU_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.gpu
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import unavailable  # noqa: E402
from lmkit import SamplingParams  # noqa: E402
from lmkit.frontend.llm import LLM  # noqa: E402
from lmkit.testing.model_shapes import DEEPSEEK_V2_LITE  # noqa: E402
from teacher_forcing import check_against_hf, hf_model  # noqa: E402
from test_engine_gpu import ENGINE, NEW_TOKENS  # noqa: E402

NUM_FREQS = 8  # RoPE pairs the copy circuit uses (the fastest): neighbours score 13% lower
PEAK_SCORE = 150.0  # the attended key's score: the next-best key scores ~20 less
NOISE_STD = 0.006
#: DeepSeek-V2-Lite's config.json, but 3 layers (dense, MoE, MoE)
V2_LITE = dict(DEEPSEEK_V2_LITE, num_hidden_layers=3, eos_token_id=256, bos_token_id=None,
               pad_token_id=256, architectures=["DeepseekV2ForCausalLM"])


#: the MLA attention backends, each served the same model (CUDA graphs on: decode steps
#: replay captured graphs where the backend declares ``cuda_graphs``)
ATTENTION = [pytest.param(name, marks=pytest.mark.skipif(
    bool(unavailable(name)), reason=f"{name}: {unavailable(name)}"))
    for name in ("mla_torch", "mla_triton", "mla_flashinfer")]


def v2_lite_config(**overrides):
    """DeepSeek-V2-Lite's :class:`transformers.DeepseekV2Config` with 3 layers."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**{**V2_LITE, **overrides})


def copy_circuit_state(hf) -> dict[str, torch.Tensor]:
    """``hf``'s state dict (its own names) with layer 0 the MLA previous-token copy
    circuit and everything else small noise (see the module doc)."""
    cfg = hf.config
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    nope, rope, vdim, rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                              cfg.kv_lora_rank)
    device = hf.device
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    r = randn(cfg.vocab_size, hidden)  # |r_x| ~ sqrt(hidden)
    u = randn(hidden)
    u = u / u.norm() * 2 * hidden ** 0.5  # a shared direction: |u|^2 = 4 |r|^2
    u_hat = u / u.norm()
    rms_embed = ((u.norm() ** 2 + hidden) / hidden) ** 0.5
    u_coord = u.norm() / rms_embed  # input_layernorm(u + r_x) along u_hat
    # RoPE (V2: complex pairs (2f, 2f + 1)); k0 is q0 one position on: peak at j = i - 1
    rotary = hf.model.rotary_emb
    theta = rotary.inv_freq.float().to(device)[:NUM_FREQS]
    q0 = torch.zeros(rope, device=device)
    q0[0:2 * NUM_FREQS:2] = 1.0
    k0 = torch.zeros(rope, device=device)
    k0[0:2 * NUM_FREQS:2], k0[1:2 * NUM_FREQS:2] = torch.cos(theta), torch.sin(theta)
    softmax_scale = float(hf.model.layers[0].self_attn.scaling)
    gain = float(getattr(rotary, "attention_scaling", 1.0)) ** 2
    scale = (PEAK_SCORE / (softmax_scale * gain * NUM_FREQS)) ** 0.5
    wq = torch.zeros(heads, nope + rope, hidden, device=device)
    wq[:, nope:] = torch.outer(q0, u_hat) * (scale / u_coord)
    # latent: the first kv_lora_rank dimensions of the normed token vector, u projected
    # out (kv_a_layernorm then brings it to rms 1, about r_x[:rank]); k_pe reads u
    wkv_a = torch.zeros(rank + rope, hidden, device=device)
    wkv_a[:rank, :rank] = torch.eye(rank, device=device)
    wkv_a[:rank] -= torch.outer(wkv_a[:rank] @ u_hat, u_hat)
    wkv_a[rank:] = torch.outer(k0, u_hat) * (scale / u_coord)
    # W_UK = 0; head h's values are latent dimensions (h % groups) * vdim onwards
    groups = rank // vdim
    wkv_b = torch.zeros(heads, nope + vdim, rank, device=device)
    wo = torch.zeros(hidden, heads * vdim, device=device)
    k = 3.0 * hidden / rank  # the attended token's logit (k * rank) beats the current one's
    for h in range(heads):
        part = slice((h % groups) * vdim, (h % groups + 1) * vdim)
        wkv_b[h, nope:, part] = torch.eye(vdim, device=device)
        wo[part, h * vdim:(h + 1) * vdim] = torch.eye(vdim, device=device) * (
            k * groups / heads)
    rms_final = (5.0 + k * k * rank / hidden) ** 0.5
    head_scale = 25.0 * rms_final / (3.0 * hidden)  # a winning margin of ~25 logits
    circuit = {"model.embed_tokens.weight": u + r, "lm_head.weight": (u + r) * head_scale,
               "model.layers.0.self_attn.q_proj.weight": wq.reshape(-1, hidden),
               "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": wkv_a,
               "model.layers.0.self_attn.kv_b_proj.weight": wkv_b.reshape(-1, rank),
               "model.layers.0.self_attn.o_proj.weight": wo}
    state = {}
    for name, tensor in hf.state_dict().items():
        if name in circuit:
            value = circuit[name]
        elif "norm" in name:
            value = torch.ones(tensor.shape, device=device)
        else:  # MLPs, experts, routers, later attention layers
            value = randn(*tensor.shape) * NOISE_STD
        assert value.shape == tensor.shape, (name, value.shape, tensor.shape)
        state[name] = value.to(tensor.dtype)
    return state


def write_model(directory: Path, config, device: str = DEVICE) -> Path:
    """Build the copy-circuit model in bf16 on ``device`` and save it (safetensors in
    transformers' checkpoint names, config, byte tokenizer) to ``directory``."""
    from lmkit.testing.tiny_model import make_byte_tokenizer
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.load_state_dict(copy_circuit_state(hf))
    hf.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return directory


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("deepseek-v2-lite"), v2_lite_config())


@pytest.fixture(scope="module")
def hf_pair(v2_lite):
    """transformers' DeepseekV2 on the saved weights: (bf16, float32)."""
    pair = (hf_model(v2_lite, torch.bfloat16), hf_model(v2_lite, torch.float32))
    yield pair
    del pair
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def random_prompts(vocab: int) -> list[list[int]]:
    """Prompts of 1 to 300 tokens (prefill, then decode steps; several blocks each), no
    EOS (256) among them: the copy circuit never generates it, so transformers'
    ``generate`` runs the full length as lmkit (``ignore_eos``) does."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(257, vocab, (n,), generator=g).tolist()
            for n in (1, 17, 100, 300, 33)]


def _generate(model_dir: Path, prompts, logprobs: int | None, attention: str = "mla_torch"):
    with LLM(str(model_dir), attention=attention, dtype="bfloat16", **ENGINE) as llm:
        assert llm.engine.stack.get("attention").name == attention
        return llm.generate(prompts, SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs,
            prompt_logprobs=logprobs))


def _copies_the_previous_token(out) -> bool:
    seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    n = len(out.prompt_token_ids)
    return n < 2 or seq[n:] == [seq[i - 2] for i in range(n, len(seq))]


@pytest.mark.parametrize("attention", ATTENTION)
def test_teacher_forced_logits_match_hf(v2_lite, hf_pair, attention):
    outs = _generate(v2_lite, random_prompts(V2_LITE["vocab_size"]), logprobs=5,
                     attention=attention)
    stats = check_against_hf(outs, *hf_pair)
    assert stats["argmax_agreement"] >= 0.99, stats  # the copy circuit decides every argmax
    assert all(_copies_the_previous_token(out) for out in outs)


@pytest.mark.parametrize("attention", ATTENTION)
def test_greedy_tokens_equal_hf_generate(v2_lite, hf_pair, attention):
    hf16, _ = hf_pair
    prompts = random_prompts(V2_LITE["vocab_size"])
    outs = _generate(v2_lite, prompts, logprobs=None, attention=attention)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.inference_mode():
            ref = hf16.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NEW_TOKENS, pad_token_id=256)
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt):].tolist()
        assert _copies_the_previous_token(out)

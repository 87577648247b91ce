"""A Llama of any shape whose next token is decided by attention, for logit comparisons.

Gaussian random weights make every next-token distribution nearly flat: over a 128k
vocabulary the top two logits differ by about a fifth of a standard deviation, so
bf16 rounding alone flips the argmax at ~5% of positions (HF bf16 against HF fp32).
An argmax check on such a model measures noise. This model keeps the real shapes and
random token embeddings, but its first layer is a "previous-token copy" circuit, so
its argmax is the token one position back, by a wide margin, and only if attention
works:

* embeddings ``u + r_x``: a shared direction ``u`` (gives every query and key a
  constant part) plus a random vector per token; the LM head is a scaled copy;
* layer 0's queries and keys read only ``u`` and, through RoPE, score key ``j`` for
  query ``i`` as ``sum_f cos((j - i + 1) theta_f)``: highest at ``j = i - 1``;
* its values copy the residual stream's first ``num_kv_heads * head_dim`` dimensions
  (``u`` projected out) and the output projection adds them back, scaled so that the
  attended token's logit beats the current token's; the LM head is scaled so that the
  margin is about 25 logits, as in a trained model;
* everything else (MLPs, later layers) is small Gaussian noise, exercising every
  kernel without deciding the argmax.

A wrong KV-cache slot, block table, position or RoPE makes the argmax wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

NUM_FREQS = 16  # RoPE frequency pairs the copy circuit uses (the fastest ones)


def llama_config(num_layers: int = 2, hidden: int = 4096, heads: int = 32, kv_heads: int = 8,
                 intermediate: int = 14336, vocab: int = 128256, max_positions: int = 131072):
    """A Llama-3.1 config (llama3 RoPE) of the given size; defaults: Llama-3.1-8B's."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192},
        eos_token_id=256, bos_token_id=None, pad_token_id=256,
        architectures=["LlamaForCausalLM"])


def copy_circuit_weights(config, device: torch.device | str, seed: int = 0,
                         noise_std: float = 0.006) -> dict[str, torch.Tensor]:
    """The HF-named bf16 state dict of the copy-circuit model for ``config``."""
    from lmkit_plugins.models.rotary import inverse_frequencies, rope_config_from_hf

    hidden, vocab = config.hidden_size, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = hidden // heads
    group = heads // kv_heads
    g = torch.Generator(device=device).manual_seed(seed)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * noise_std

    r = torch.randn(vocab, hidden, generator=g, device=device)  # |r_x| ~ sqrt(hidden)
    u = torch.randn(hidden, generator=g, device=device)
    u = u / u.norm() * 2 * hidden ** 0.5  # |u|^2 = 4 |r|^2
    embed = u + r
    u_hat = u / u.norm()
    # input_layernorm(e) = e / rms(e); its component along u_hat:
    u_coord = u.norm() / ((u.norm() ** 2 + hidden) / hidden) ** 0.5
    theta = inverse_frequencies(rope_config_from_hf(config, dim)).to(device)[:NUM_FREQS]
    q0 = torch.zeros(dim, device=device)
    q0[:NUM_FREQS] = 1.0
    k0 = torch.zeros(dim, device=device)  # q0 rotated by one position: peak at j = i - 1
    k0[:NUM_FREQS] = torch.cos(theta)
    k0[dim // 2:dim // 2 + NUM_FREQS] = torch.sin(theta)
    scale = (100.0 * dim ** 0.5 / NUM_FREQS) ** 0.5  # peak score ~100 (sharp attention)
    wq = torch.outer(q0.repeat(heads), u_hat) * (scale / u_coord)
    wk = torch.outer(k0.repeat(kv_heads), u_hat) * (scale / u_coord)
    copy_dims = kv_heads * dim
    rms_embed = ((u.norm() ** 2 + hidden) / hidden) ** 0.5  # rms(u + r_x)
    # values: the first copy_dims dimensions of the normed token vector, u projected out
    wv = torch.zeros(copy_dims, hidden, device=device)
    wv[:, :copy_dims] = torch.eye(copy_dims, device=device)
    wv = wv - torch.outer(wv @ u_hat, u_hat)
    # attention adds k * P r_prev: the attended token's logit k * copy_dims = 3 * hidden
    # beats the current token's |r_x|^2 = hidden
    k = 3.0 * hidden / copy_dims
    wo = torch.zeros(hidden, heads * dim, device=device)
    for h in range(heads):
        kv = h // group
        wo[kv * dim:(kv + 1) * dim, h * dim:(h + 1) * dim] = torch.eye(dim, device=device) * (
            k * float(rms_embed) / group)
    # LM head: the embeddings scaled so that the winning margin is ~25 logits (as in a
    # trained model), not thousands: bf16 error is relative to the logits' size
    rms_final = (5.0 + k * k * copy_dims / hidden) ** 0.5
    head_scale = 25.0 * rms_final / (3.0 * hidden)
    inter = config.intermediate_size
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed,
                                   "lm_head.weight": embed * head_scale,
                                   "model.norm.weight": torch.ones(hidden, device=device)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = (wq, wk, wv, wo) if i == 0 else (
            noise(heads * dim, hidden), noise(kv_heads * dim, hidden),
            noise(kv_heads * dim, hidden), noise(hidden, heads * dim))
        for name, w in zip(("q_proj", "k_proj", "v_proj", "o_proj"), attn, strict=True):
            sd[f"{p}.self_attn.{name}.weight"] = w
        sd[f"{p}.mlp.gate_proj.weight"] = noise(inter, hidden)
        sd[f"{p}.mlp.up_proj.weight"] = noise(inter, hidden)
        sd[f"{p}.mlp.down_proj.weight"] = noise(hidden, inter)
        sd[f"{p}.input_layernorm.weight"] = torch.ones(hidden, device=device)
        sd[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, device=device)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}


def write_copy_circuit_model(directory: Path, config=None, device: str | None = None) -> Path:
    """Write the model (safetensors, config, byte tokenizer) to ``directory``."""
    from lmkit.testing.tiny_model import make_byte_tokenizer
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = config or llama_config()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    weights = copy_circuit_weights(config, device)
    save_file({k: v.cpu() for k, v in weights.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    make_byte_tokenizer().save_pretrained(directory)
    return directory


def generate_greedy(model_dir: Path, backend: str, prompt_sets: list[list[list[int]]],
                    max_tokens: int = 24) -> tuple[list[list[list[int]]], object]:
    """Greedy tokens of an in-process CUDA engine (bf16, CUDA graphs on) for each set of
    prompts in turn, and the runner's model (read before shutdown)."""
    from lmkit import SamplingParams
    from lmkit.frontend.llm import LLM

    llm = LLM(str(model_dir), attention=backend, dtype="bfloat16", max_num_seqs=8,
              max_model_len=2048, num_blocks=1024, device="cuda")
    try:
        runner = llm.engine.executor.runner
        assert runner.cuda_graphs is not None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(p, params)]
                  for p in prompt_sets]
        return tokens, runner.model
    finally:
        llm.shutdown()

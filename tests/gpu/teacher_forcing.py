"""Teacher-forcing checks shared by the GPU tests: lmkit's logprobs against Hugging Face
transformers' on the same token sequences (see :func:`check_against_hf`), and the
prompts they run on. ``LMKIT_GPU_TEST_DEVICE=cpu`` runs them on the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lmkit.benchmarking.prompts import CHAT_PROMPTS

DEVICE = os.environ.get("LMKIT_GPU_TEST_DEVICE", "cuda")
TOP = 5


def smollm2_prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["The capital of France is",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "Photosynthesis is the process by which green plants " * 12,
             "Q: What is 17 times 3?\nA:"]
    raw = [tok(t)["input_ids"] for t in texts]
    # and 16 chat prompts through the chat template: about 1,000 scored positions, so
    # that one tie broken the other way moves agreement by 0.1%, not 0.4%
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                     add_generation_prompt=True) for t in CHAT_PROMPTS[:16]]
    return raw + [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats]


def llama8b_shape_vocab(model_dir: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).vocab_size)


def random_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 17, 100, 300, 33)]


# ---------------------------------------------------------------------- references


def hf_model(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(DEVICE).eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """float32 ``[len(ids), vocab]``: row p is the next-token distribution after ids[:p+1]."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=DEVICE)).logits[0]
    return logits.float().log_softmax(-1).cpu()


def positions(out):
    """(row in the full sequence's logprobs, lmkit's top list) for every scored position."""
    rows = []
    prompt_len = len(out.prompt_token_ids)
    for p, entry in enumerate(out.prompt_logprobs or []):
        if entry is not None:  # position p's token, scored by the row before it
            rows.append((p - 1, entry.top))
    for t, entry in enumerate(out.outputs[0].logprobs or []):
        rows.append((prompt_len - 1 + t, entry.top))
    return rows


def check_against_hf(outs, hf16, hf32) -> dict[str, float]:
    """Argmax agreement with HF bf16 and top-5 logprob error against HF float32.

    Agreement counts every position, and separately the positions HF decides stably
    (its bf16 and float32 runs pick the same token): a position where rounding alone
    flips HF's own argmax is a tie at bf16 precision, which no bf16 engine can be
    expected to break HF's way. lmkit must agree at >= 99% of the stable positions,
    and overall at least as often as HF bf16 agrees with HF float32, less 1%.
    """
    agree = total = stable = agree_stable = hf_self = 0
    err = floor = 0.0
    n_err = 0
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref16, ref32 = hf_logprobs(hf16, ids), hf_logprobs(hf32, ids)
        for row, top in positions(out):
            assert len(top) == TOP
            total += 1
            hf_token = int(ref16[row].argmax())
            same = int(top[0][0] == hf_token)
            agree += same
            if hf_token == int(ref32[row].argmax()):
                hf_self += 1
                stable += 1
                agree_stable += same
            for tok, lp in top:
                err += abs(lp - float(ref32[row, tok]))
                floor += abs(float(ref16[row, tok]) - float(ref32[row, tok]))
                n_err += 1
    assert total > 0 and stable > 0
    stats = {"positions": total, "argmax_agreement": agree / total,
             "stable_positions": stable, "argmax_agreement_stable": agree_stable / stable,
             "hf_bf16_vs_fp32_agreement": hf_self / total,
             "mean_abs_err": err / n_err, "hf_bf16_mean_abs_err": floor / n_err}
    print(stats)
    assert stats["argmax_agreement_stable"] >= 0.99, stats
    assert stats["argmax_agreement"] >= stats["hf_bf16_vs_fp32_agreement"] - 0.01, stats
    assert stats["mean_abs_err"] <= 2 * stats["hf_bf16_mean_abs_err"] + 0.02, stats
    return stats

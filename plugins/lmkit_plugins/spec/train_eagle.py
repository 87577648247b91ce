"""``lmkit spec train-eagle MODEL --out DIR``: train an EAGLE-3 head for ``MODEL`` by
self-distillation, in the checkpoint layout ``--speculative eagle3`` loads.

1. **Data**: the target generates greedy answers to a prompt set (the chat prompts of
   ``lmkit bench``, built in, or a JSONL file of ``{"prompt": ...}`` lines) with lmkit
   itself; the token sequences are kept in ``DIR/train_data.pt``.
2. **Features**: per training sequence, one forward of the target (transformers) gives
   the inputs of the three tapped layers (``[2, L // 2, L - 3]``, or ``--layers``) and
   its logits.
3. **Objective**: at every position ``p`` the head, given the token at ``p + 1`` and the
   fused features at ``p``, is trained to the target's distribution of the token at
   ``p + 2`` (cross-entropy against the target's probabilities restricted to the draft
   vocabulary: its ``draft_vocab_size`` most frequent tokens in the data), and so are
   ``ttt_steps - 1`` unrolled draft steps that read the head's own outputs as drafting
   does (EAGLE-3's training-time test, weighted ``0.8 ** step``; the tokens are the
   data's, not the drafts).
4. **Checkpoints**: every ``--save-every`` steps and at the end, ``DIR/config.json`` and
   ``DIR/model.safetensors`` (the head) and ``DIR/train_state.pt`` (optimizer, step,
   random state). Running the command again on the same ``DIR`` resumes from there.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lmkit_plugins.models.llama import LlamaDims
from lmkit_plugins.models.rotary import RotaryEmbedding, rope_config_from_hf

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
               "vocab_size", "head_dim", "rope_theta", "rope_scaling", "rope_parameters")


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


class _Attention(nn.Module):
    def __init__(self, hidden: int, q: int, kv: int) -> None:
        super().__init__()
        # q/k/v read [embedding, feature]: 2 * hidden inputs
        self.q_proj = nn.Linear(2 * hidden, q, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv, bias=False)
        self.o_proj = nn.Linear(q, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class _MidLayer(nn.Module):
    def __init__(self, d: LlamaDims) -> None:
        super().__init__()
        h = d.hidden_size
        self.self_attn = _Attention(h, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim)
        self.mlp = _MLP(h, d.intermediate_size)
        self.input_layernorm = _Norm(h, d.rms_norm_eps)
        self.hidden_norm = _Norm(h, d.rms_norm_eps)
        self.post_attention_layernorm = _Norm(h, d.rms_norm_eps)


class TrainableEagle3(nn.Module):
    """An EAGLE-3 head over dense sequences (autograd); its ``state_dict`` names are the
    checkpoint's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``)."""

    def __init__(self, hf_config: Any, num_taps: int, draft_vocab_size: int) -> None:
        super().__init__()
        d = LlamaDims.from_hf(hf_config)
        self.dims = d
        h = d.hidden_size
        self.fc = nn.Linear(num_taps * h, h, bias=False)
        self.midlayer = _MidLayer(d)
        self.norm = _Norm(h, d.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                    mlp.up_proj, mlp.down_proj, self.fc):
            nn.init.normal_(lin.weight, std=0.02)
        self.rotary = RotaryEmbedding(rope_config_from_hf(hf_config, d.head_dim), d.head_dim,
                                      torch.device("cpu"))

    def qkv(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated ``q [heads, n, d]`` and ``k, v`` (repeated to the query heads) of the
        midlayer for tokens ``embeds`` and features ``feature`` at ``positions``."""
        d, m, n = self.dims, self.midlayer, len(embeds)
        x = torch.cat((m.input_layernorm(embeds), m.hidden_norm(feature)), -1)
        a = m.self_attn
        q = a.q_proj(x).view(n, d.num_heads, d.head_dim)
        k = a.k_proj(x).view(n, d.num_kv_heads, d.head_dim)
        v = a.v_proj(x).view(n, d.num_kv_heads, d.head_dim)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        group = d.num_heads // d.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def finish(self, attn_out: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """``attn_out [heads, n, d]`` -> the head's output before its final norm."""
        m = self.midlayer
        n = attn_out.shape[1]
        residual = m.self_attn.o_proj(attn_out.transpose(0, 1).reshape(n, -1)) + feature
        return m.mlp(m.post_attention_layernorm(residual)) + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of head outputs."""
        return self.lm_head(self.norm(hidden))

    def unrolled(self, embeds: torch.Tensor, taps: torch.Tensor, num_steps: int
                 ) -> list[torch.Tensor]:
        """Draft-vocabulary logits of ``num_steps`` unrolled draft steps, as drafting
        runs them (EAGLE-3's training-time test). Row ``p`` of step ``j`` (0-based) is
        the draft at position ``p`` made ``j`` passes after the last real feature: its
        feature is step ``j - 1``'s output at ``p - 1``, and it attends to the real
        keys up to ``p - j`` and to step ``i``'s key at ``p - j + i``. Step ``j``'s
        logits cover positions ``j .. n - 1``."""
        n = len(embeds)
        scale = self.dims.head_dim ** -0.5
        positions = torch.arange(n, device=embeds.device)
        feature = self.fc(taps)
        q, k, v = self.qkv(embeds, feature, positions)
        keys, values = [k], [v]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden = self.finish(out, feature)
        results = [self.logits(hidden)]
        for j in range(1, num_steps):
            rows = positions[j:]  # step j drafts at positions j .. n - 1
            feature = hidden[:-1]  # step j - 1's output one position earlier
            q, k, v = self.qkv(embeds[rows], feature, rows)
            real = q @ keys[0].transpose(1, 2) * scale  # [heads, n - j, n]
            allowed = positions[None, :] <= (rows - j)[:, None]
            real = real.masked_fill(~allowed, float("-inf"))
            # step i's key at p - j + i is its row p - j: the first n - j rows
            diag_k = [keys[i][:, :n - j] for i in range(1, j)] + [k]
            diag_v = [values[i][:, :n - j] for i in range(1, j)] + [v]
            diag = torch.stack([(q * dk).sum(-1) * scale for dk in diag_k], -1)
            att = torch.softmax(torch.cat((real, diag), -1), -1)
            out = att[..., :n] @ values[0]
            for i, dv in enumerate(diag_v):
                out = out + att[..., n + i, None] * dv
            hidden = self.finish(out, feature)
            keys.append(k)
            values.append(v)
            results.append(self.logits(hidden))
        return results


def default_taps(num_layers: int) -> list[int]:
    """The tapped target layers EAGLE-3 uses (vLLM's ``[2, L // 2, L - 3]``), clipped to
    the layers of a small model."""
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


class TargetFeatures:
    """The target (transformers) for features: the inputs of the tapped layers and the
    logits, for one token sequence."""

    def __init__(self, model_dir: Path, taps: list[int], device: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.to(device)  # type: ignore[arg-type]  # transformers' stub types it oddly
        self.model.eval()
        self.taps, self.device = taps, device
        self._seen: dict[int, torch.Tensor] = {}
        for i in set(taps):
            self.model.model.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)

    def _hook(self, i: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            self._seen[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    @torch.no_grad()
    def __call__(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(embeds of tokens[1:], taps [n, 3 * hidden], logits [n, vocab])``."""
        ids = torch.tensor([tokens], device=self.device)
        logits = self.model(ids).logits[0].float()
        taps = torch.cat([self._seen[i][0] for i in self.taps], -1).float()
        embeds = self.model.get_input_embeddings()(ids)[0].float()
        return embeds, taps, logits

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's language-model head rows of ``ids`` (the draft head's init)."""
        return self.model.get_output_embeddings().weight[ids].detach().float().cpu()


def load_prompts(path: Path | None) -> list[str]:
    """The prompt set: ``path`` (JSONL, one ``{"prompt": ...}`` or string per line), else
    the chat prompts of ``lmkit bench``."""
    if path is None:
        from lmkit.api import CHAT_PROMPTS

        return list(CHAT_PROMPTS)
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            item = json.loads(line)
            prompt = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(prompt, str):
                raise ValueError(f"{path}:{n}: expected a string or {{\"prompt\": \"...\"}}")
            prompts.append(prompt)
    return prompts


def generate_data(model: str, prompts: list[str], max_new_tokens: int, device: str
                  ) -> tuple[Path, list[list[int]]]:
    """The target's greedy answers to ``prompts`` (prompt and answer token ids), with
    lmkit; also returns the model's local directory."""
    from lmkit import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    with LLM(model, device=device, dtype="float32" if device == "cpu" else "bfloat16") as llm:
        model_dir = Path(llm.engine.model_dir)
        chat = getattr(llm.tokenizer, "chat_template", None)
        outs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if chat
                else llm.generate(prompts, params))
    return model_dir, [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def head_config(hf_config: Any, taps: list[int], draft_vocab_size: int) -> dict[str, Any]:
    """The head's ``config.json``: the target's shapes, one layer, the taps."""
    target = hf_config.to_dict()
    config = {k: target[k] for k in CONFIG_KEYS if target.get(k) is not None}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, draft_vocab_size=draft_vocab_size,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": taps})
    return config


def draft_vocabulary(sequences: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``sequences`` (then the lowest unused ids),
    sorted."""
    counts = Counter(t for s in sequences for t in s)
    ids = [t for t, _ in counts.most_common(size)]
    ids += [t for t in range(vocab_size) if t not in counts][:size - len(ids)]
    return torch.tensor(sorted(ids), dtype=torch.int64)


def train(model: str, out: Path, *, max_steps: int, device: str, prompts: Path | None = None,
          max_new_tokens: int = 128, draft_vocab_size: int = 32000, lr: float = 3e-4,
          batch_size: int = 4, save_every: int = 100, taps: list[int] | None = None,
          seed: int = 0, ttt_steps: int = 3, progress: bool = True) -> dict[str, Any]:
    """Train (or resume training) an EAGLE-3 head for ``model`` into ``out``; returns
    ``{"step", "loss", "resumed_from"}``. See the module docstring."""
    from lmkit.api import load_hf_config
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    data_path, state_path = out / "train_data.pt", out / "train_state.pt"
    if data_path.is_file():
        data = torch.load(data_path)
        if data.get("model") != model:
            raise ValueError(f"{out} holds a training run for model {data.get('model')!r}, "
                             f"not {model!r}; use another --out directory")
    else:
        model_dir, sequences = generate_data(model, load_prompts(prompts), max_new_tokens,
                                             device)
        data = {"model": model, "model_dir": str(model_dir), "sequences": sequences}
        torch.save(data, data_path)
    model_dir = Path(data["model_dir"])
    sequences = [s for s in data["sequences"] if len(s) >= 3]
    if not sequences:
        raise ValueError("the prompt set gave no sequence of 3 tokens or more to train on")
    hf_config = load_hf_config(model_dir)
    dims = LlamaDims.from_hf(hf_config)
    taps = taps or default_taps(dims.num_layers)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    target = TargetFeatures(model_dir, taps, device, dtype)
    state = torch.load(state_path) if state_path.is_file() else None
    ids = (state["draft_ids"] if state is not None else
           draft_vocabulary(sequences, min(draft_vocab_size, dims.vocab_size), dims.vocab_size))
    head = TrainableEagle3(hf_config, len(taps), len(ids))
    if state is None:
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head_rows(ids))
    head.to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr)
    step, resumed_from = 0, None
    generator = torch.Generator().manual_seed(seed)
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step = resumed_from = state["step"]
        generator.set_state(state["generator"])
    draft_ids = ids.to(device)

    def save() -> None:
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()
                   if not k.startswith("rotary.")}
        tensors["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(dims.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(head_config(hf_config, taps, len(ids)),
                                                    indent=1))
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": step, "generator": generator.get_state(), "draft_ids": ids},
                   state_path)

    loss_value = float("nan")
    bar = _progress(progress, max_steps, step)
    while step < max_steps:
        picks = torch.randint(len(sequences), (batch_size,), generator=generator).tolist()
        optimizer.zero_grad()
        total = 0.0
        for i in picks:
            embeds, feats, logits = target(sequences[i])
            # position p: token p + 1 and features at p -> the target's distribution at p + 1
            want = torch.softmax(logits[1:-1].index_select(-1, draft_ids), -1)
            steps = head.unrolled(embeds[1:-1], feats[:-2], min(ttt_steps, len(want)))
            loss = torch.stack([
                0.8 ** j * -(want[j:] * torch.log_softmax(got.float(), -1)).sum(-1).mean()
                for j, got in enumerate(steps)]).sum() / batch_size
            loss.backward()
            total += loss.detach().item()
        optimizer.step()
        step += 1
        loss_value = total
        bar(step, loss_value)
        if step % save_every == 0 or step == max_steps:
            save()
    if resumed_from == max_steps or (step == 0 and max_steps == 0):
        save()
    return {"step": step, "loss": loss_value, "resumed_from": resumed_from}


def _progress(enabled: bool, total: int, start: int) -> Any:
    """Training progress on stderr (``update(step, loss)``): a rich bar on a terminal,
    else one line per tenth of the steps (``lmkit: training EAGLE-3 head: step 80 of
    800 (10%), loss 5.8213, 14 s``), so logs show it too; a no-op when disabled."""
    if not enabled:
        return lambda step, loss: None
    import sys
    import time

    if not sys.stderr.isatty():
        began, every = time.monotonic(), max(1, total // 10)

        def line(step: int, loss: float) -> None:
            if step % every == 0 or step >= total:
                print(f"lmkit: training EAGLE-3 head: step {step} of {total} "
                      f"({100 * step // max(total, 1)}%), loss {loss:.4f}, "
                      f"{time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
        return line
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("training EAGLE-3 head"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]}"), console=Console(stderr=True),
                   transient=False)
    task = bar.add_task("train", total=total, completed=start, loss="-")
    bar.start()

    def update(step: int, loss: float) -> None:
        bar.update(task, completed=step, loss=f"{loss:.4f}")
        if step >= total:
            bar.stop()
    return update

"""The trainable EAGLE-3 head of ``lmkit spec train-eagle``: the head over dense
sequences with autograd, its ``state_dict`` in the checkpoint's names, the unrolled
draft steps of EAGLE-3's training-time test, and the distillation loss over a batch of
right-padded sequences (one forward and backward for the whole batch)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lmkit_plugins.models.llama import LlamaDims
from lmkit_plugins.models.rotary import RotaryEmbedding, rope_config_from_hf


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
        """Rotated ``q [..., heads, n, d]`` and ``k, v`` (repeated to the query heads) of
        the midlayer for tokens ``embeds [..., n, hidden]`` (``...``: none, or a batch)
        and features ``feature`` at ``positions [n]``."""
        d, m, lead = self.dims, self.midlayer, embeds.shape[:-1]
        x = torch.cat((m.input_layernorm(embeds), m.hidden_norm(feature)), -1)
        a = m.self_attn
        q = a.q_proj(x).view(-1, d.num_heads, d.head_dim)  # rows of every sequence
        k = a.k_proj(x).view(-1, d.num_kv_heads, d.head_dim)
        v = a.v_proj(x).view(-1, d.num_kv_heads, d.head_dim)
        cos, sin = self.rotary.cos_sin(positions.expand(lead).reshape(-1), x.dtype)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        group = d.num_heads // d.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return tuple(t.view(*lead, d.num_heads, d.head_dim).transpose(-3, -2)  # type: ignore[return-value]
                     for t in (q, k, v))

    def finish(self, attn_out: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """``attn_out [..., heads, n, d]`` -> the head's output before its final norm."""
        m = self.midlayer
        residual = m.self_attn.o_proj(attn_out.transpose(-3, -2).flatten(-2)) + feature
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
        logits cover positions ``j .. n - 1``. ``embeds [..., n, hidden]``, ``taps``
        alike: one sequence, or a batch (right-padded: no real row reads a later one)."""
        n = embeds.shape[-2]
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
            feature = hidden[..., :-1, :]  # step j - 1's output one position earlier
            q, k, v = self.qkv(embeds[..., j:, :], feature, rows)
            real = q @ keys[0].transpose(-1, -2) * scale  # [..., heads, n - j, n]
            allowed = positions[None, :] <= (rows - j)[:, None]
            real = real.masked_fill(~allowed, float("-inf"))
            # step i's key at p - j + i is its row p - j: the first n - j rows
            diag_k = [keys[i][..., :n - j, :] for i in range(1, j)] + [k]
            diag_v = [values[i][..., :n - j, :] for i in range(1, j)] + [v]
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


def distill_loss(head: TrainableEagle3, embeds: list[torch.Tensor], taps: list[torch.Tensor],
                 want: list[torch.Tensor], ttt_steps: int, batch_size: int,
                 first: list[int] | None = None) -> torch.Tensor:
    """The distillation loss of a batch of sequences, in one padded forward: per
    sequence of ``m`` rows (``embeds [m, hidden]`` of the tokens after each position,
    ``taps [m, width]``, ``want [m, draft vocab]`` the target's distribution), the
    cross-entropy of ``min(ttt_steps, m)`` unrolled steps, step ``j`` averaged over its
    rows and weighted ``0.8 ** j``; summed over the batch, divided by ``batch_size``.

    ``first`` (per sequence, default 0): the first row whose prediction counts. Rows
    before it (the prompt, which serving never drafts) are read as context only: the
    head attends to them, but their predictions add nothing to the loss."""
    pad = torch.nn.utils.rnn.pad_sequence
    lengths = torch.tensor([len(e) for e in embeds], device=embeds[0].device)
    starts = torch.tensor(first if first is not None else [0] * len(embeds),
                          device=lengths.device)
    return padded_distill_loss(head, pad(embeds, batch_first=True), pad(taps, batch_first=True),
                               pad(want, batch_first=True), lengths, starts, ttt_steps,
                               batch_size)


def padded_distill_loss(head: TrainableEagle3, embeds: torch.Tensor, taps: torch.Tensor,
                        want: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
                        ttt_steps: int, batch_size: int) -> torch.Tensor:
    """:func:`distill_loss` of a batch already right-padded: ``embeds [batch, rows,
    hidden]``, ``taps [batch, rows, width]``, ``want [batch, rows, draft vocab]``,
    ``lengths [batch]`` (real rows per sequence; padding rows must hold finite values,
    which the loss masks) and ``starts [batch]`` (each sequence's first row that counts,
    ``first`` of :func:`distill_loss`), all on one device. Nothing in it waits for the
    device."""
    steps = head.unrolled(embeds, taps, min(ttt_steps, embeds.shape[1]))
    loss = want.new_zeros(())
    for j, got in enumerate(steps):
        rows = (j + torch.arange(got.shape[1], device=lengths.device))[None, :]
        # [batch, rows of step j]: not padding, and not a prompt row
        real = (rows < lengths[:, None]) & (rows >= starts[:, None])
        ce = -(want[:, j:] * torch.log_softmax(got.float(), -1)).sum(-1)
        count = real.sum(-1)
        per_sequence = (ce * real).sum(-1) / count.clamp(min=1)
        loss = loss + 0.8 ** j * per_sequence.sum()  # 0 where a sequence has no row
    return loss / batch_size

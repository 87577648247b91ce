"""EAGLE and EAGLE-3 heads computed densely in plain torch from their checkpoints (no
KV cache, whole sequences; HF transformers for the target's features): the reference
the paged drafts of tests/unit/eagle/test_spec_eagle_drafts.py must equal."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.nn.functional import silu


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class DenseEagle:
    """A head at ``head_dir`` (EAGLE-1/2, or EAGLE-3 when it has ``midlayer.*``) over the
    target at ``target_dir``."""

    def __init__(self, target_dir, head_dir):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        head_dir = Path(head_dir)
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        self.w = load_file(str(head_dir / "model.safetensors"))
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.emb = self.target.get_input_embeddings().weight.detach()
        self.eagle3 = "midlayer.self_attn.q_proj.weight" in self.w
        self.layers = tuple(self.cfg.get("eagle_config", {})
                            .get("eagle_aux_hidden_state_layer_ids", ()))

    def features(self, tokens):
        """EAGLE: the input of the target's LM head; EAGLE-3: ``fc`` over the inputs of
        the chosen layers. ``[len(tokens), hidden]``."""
        seen, hooks = {}, []

        def tap(key, value):
            seen.setdefault(key, value)  # hooks return None: nothing is replaced

        if self.eagle3:
            for i in set(self.layers):
                hooks.append(self.target.model.layers[i].register_forward_pre_hook(
                    lambda mod, args, kwargs, i=i: tap(
                        i, args[0] if args else kwargs["hidden_states"]), with_kwargs=True))
        else:
            hooks.append(self.target.lm_head.register_forward_hook(
                lambda mod, args, out: tap("h", args[0])))
        with torch.no_grad():
            self.target(torch.tensor([tokens]))
        for hook in hooks:
            hook.remove()
        if not self.eagle3:
            return seen["h"][0]
        return torch.cat([seen[i][0] for i in self.layers], -1) @ self.w["fc.weight"].T

    def attention(self, x, prefix):
        """Causal multi-head attention of the head's layer over all rows of ``x``."""
        w, c = self.w, self.cfg
        n, nh, nkv = len(x), c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // nh
        q = (x @ w[prefix + "self_attn.q_proj.weight"].T).view(n, nh, hd)
        k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(n, nkv, hd)
        v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(n, nkv, hd)
        theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 1e4)
        inv = 1.0 / (float(theta) ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.arange(n).float()[:, None] * inv[None]
        cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]

        def rope(t):
            return t * cos + torch.cat((-t[..., hd // 2:], t[..., :hd // 2]), -1) * sin

        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        att = att.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", att, v).reshape(n, nh * hd)
        return out @ w[prefix + "self_attn.o_proj.weight"].T

    def head(self, next_tokens, feats):
        """The head's outputs at every position (``feats``: each position's feature)."""
        w, eps = self.w, self.cfg["rms_norm_eps"]
        embeds = self.emb[torch.tensor(next_tokens)]
        if self.eagle3:
            p = "midlayer."
            x = torch.cat((rms(embeds, w[p + "input_layernorm.weight"], eps),
                           rms(feats, w[p + "hidden_norm.weight"], eps)), -1)
            residual = self.attention(x, p) + feats
        else:
            p = "layers.0."
            x = torch.cat((embeds, feats), -1) @ w["fc.weight"].T + w["fc.bias"]
            residual = self.attention(x, p) + x
        y = rms(residual, w[p + "post_attention_layernorm.weight"], eps)
        mlp = silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
        return mlp @ w[p + "mlp.down_proj.weight"].T + residual

    def draft(self, h):
        """The target id the head drafts from its output ``h``."""
        if not self.eagle3:
            return int((h @ self.emb.T).argmax())
        w = self.w
        d = int((rms(h, w["norm.weight"], self.cfg["rms_norm_eps"]) @ w["lm_head.weight"].T)
                .argmax())
        return d + int(w["d2t"][d]) if "d2t" in w else d

    def logits(self, h):
        """The head's logits from its output ``h`` and the target id of each (EAGLE-3:
        over its draft vocabulary, mapped by ``d2t``)."""
        if not self.eagle3:
            logits = h @ self.emb.T
            return logits, torch.arange(len(logits))
        w = self.w
        logits = rms(h, w["norm.weight"], self.cfg["rms_norm_eps"]) @ w["lm_head.weight"].T
        ids = torch.arange(len(logits))
        return logits, ids + w["d2t"] if "d2t" in w else ids

    def ranked(self, h, width):
        """The target ids of the head's ``width`` best drafts from its output ``h``."""
        logits, ids = self.logits(h)
        return ids[logits.topk(width).indices].tolist()

    def _tree_nodes(self, tokens, tree, num, drafts):
        """``(children as (rank, node), the head's output after the node's path)`` for
        each of the first ``num`` nodes of ``tree`` with children, the path's tokens
        read from ``drafts`` (node -> id) as the caller has them then."""
        base_feats = self.features(tokens[:-1])
        with torch.no_grad():
            for node in range(num + 1):
                kids = tree.child_ranks(node, num)
                if not kids:
                    continue
                feats, next_tokens = base_feats, list(tokens[1:])
                h = self.head(next_tokens, feats)
                for c in tree.path_to(node):  # the path's drafts fed back, one at a time
                    next_tokens.append(drafts[c])
                    feats = torch.cat((feats, h[-1:]), 0)
                    h = self.head(next_tokens, feats)
                yield kids, h[-1]

    def tree_drafts(self, tokens, tree, num):
        """The first ``num`` nodes of a draft tree (``lmkit.spec_decode.tree.DraftTree``)
        after ``tokens``: each node's children are the head's best drafts after the
        path to it, ranked as the tree names them."""
        drafts = {}
        for kids, h in self._tree_nodes(tokens, tree, num, drafts):
            top = self.ranked(h, 1 + max(rank for rank, _ in kids))
            for rank, c in kids:
                drafts[c] = top[rank]
        return [drafts[c] for c in range(1, num + 1)]

    def tree_mismatches(self, tokens, tree, drafts, tol=1e-4):
        """The nodes (1-based) of a drafted tree's first nodes ``drafts`` (ids, as
        :meth:`tree_drafts` lists them) that are not the head's draft of their rank
        after their path, the path taken as drafted. A draft whose logit is within
        ``tol`` of that rank's counts as it: two float32 computations of the head may
        order near-equal logits differently."""
        drafted, bad = dict(enumerate(drafts, start=1)), []
        for kids, h in self._tree_nodes(tokens, tree, len(drafts), drafted):
            logits, ids = self.logits(h)
            best = logits.topk(1 + max(rank for rank, _ in kids)).values
            for rank, c in kids:
                at = (ids == drafted[c]).nonzero().flatten()
                if len(at) == 0 or abs(float(logits[at[0]] - best[rank])) > tol:
                    bad.append(c)
        return bad

    def drafts(self, tokens, num):
        """``num`` greedy drafts after ``tokens`` (the last one was just sampled)."""
        feats = self.features(tokens[:-1])  # positions 0 .. L-1, each with its next token
        next_tokens = list(tokens[1:])
        out = []
        with torch.no_grad():
            for _ in range(num):
                h = self.head(next_tokens, feats)
                out.append(self.draft(h[-1]))
                next_tokens.append(out[-1])
                feats = torch.cat((feats, h[-1:]), 0)
        return out

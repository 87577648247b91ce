"""The target's features for ``lmkit spec train-eagle``: batched forwards of the target
(transformers) over the training sequences, and a cache of their results.

Per sequence of ``n`` tokens a forward gives the inputs of the tapped layers (``taps``,
``[n, len(taps) * hidden]``) and the target's final hidden state after its last norm
(``final``, ``[n, hidden]``: the target's logits over the draft vocabulary are
``final @ lm_head[draft ids].T``, recomputed per step from it, far smaller than the
logits themselves). Sequences go through the target ``batch`` at a time, longest
first, right-padded (causal attention: padding never reaches a real position).

:class:`FeatureCache` runs every sequence through the target once and keeps the
results in two flat tensors (all sequences' rows back to back) in the target's dtype:
in memory, or memory-mapped files under the training directory (``features/``, with an
``index.json``), which a resumed run reuses. Training then reads rows instead of
running the target every step.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

CACHE_MODES = ("memory", "disk", "off")


class TargetFeatures:
    """The target (transformers) for features: tapped layer inputs and final hidden
    states of token sequences, several per forward.

    Args:
        model_dir: the target's local directory.
        taps: the tapped layers (their inputs, concatenated in this order).
        device: where the target runs; ``dtype``: its weights' dtype (and the features').
    """

    def __init__(self, model_dir: Path, taps: list[int], device: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.to(device)  # type: ignore[arg-type]  # transformers' stub types it oddly
        self.model.eval()
        self.taps, self.device, self.dtype = taps, device, dtype
        self.hidden_size = int(self.model.config.hidden_size)
        self._seen: dict[int, torch.Tensor] = {}
        for i in set(taps):
            self.model.model.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)

    def _hook(self, i: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            self._seen[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    @torch.no_grad()
    def __call__(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence (one right-padded forward for all): ``(taps [n, len(taps) *
        hidden], final [n, hidden])`` on the device, in the target's dtype."""
        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), longest, dtype=torch.int64)
        mask = torch.zeros(len(sequences), longest, dtype=torch.int64)
        for row, s in enumerate(sequences):
            ids[row, :len(s)] = torch.tensor(s)
            mask[row, :len(s)] = 1
        final = self.model.model(input_ids=ids.to(self.device),
                                 attention_mask=mask.to(self.device)).last_hidden_state
        taps = torch.cat([self._seen[i] for i in self.taps], -1)
        return [(taps[row, :len(s)], final[row, :len(s)]) for row, s in enumerate(sequences)]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., hidden]`` input embeddings of the token ``ids`` (a tensor of any
        shape, on the device)."""
        return self.model.get_input_embeddings()(ids).detach().float()

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows of the target's language-model head for ``ids`` (CPU)."""
        return self.model.get_output_embeddings().weight[ids].detach().float().cpu()


def cache_bytes(sequences: list[list[int]], num_taps: int, hidden: int,
                dtype: torch.dtype) -> int:
    """Bytes a :class:`FeatureCache` of ``sequences`` takes."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return sum(len(s) for s in sequences) * (num_taps + 1) * hidden * itemsize


class FeatureCache:
    """Every sequence's ``(taps, final)`` from one pass of the target, kept as two flat
    tensors (rows of sequence ``i`` at ``offsets[i]:offsets[i + 1]``).

    Build it with :meth:`build`; :meth:`get` reads one sequence's rows.
    """

    def __init__(self, taps: torch.Tensor, final: torch.Tensor, offsets: list[int]) -> None:
        self.taps, self.final, self.offsets = taps, final, offsets

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``i``'s ``(taps, final)`` (views, the target's dtype, on the CPU)."""
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.taps[a:b], self.final[a:b]

    @classmethod
    def build(cls, target: TargetFeatures, sequences: list[list[int]], batch: int,
              directory: Path | None, key: dict[str, Any], progress: bool) -> FeatureCache:
        """Run ``sequences`` through ``target``, ``batch`` per forward (longest first),
        into memory (``directory`` ``None``) or into files under ``directory``; a
        complete cache there whose index matches ``key`` (model, taps, dtype) and the
        sequences is reused without running the target."""
        offsets = [0]
        for s in sequences:
            offsets.append(offsets[-1] + len(s))
        width = len(target.taps) * target.hidden_size
        index = {**key, "dtype": str(target.dtype), "width": width,
                 "hidden": target.hidden_size,
                 "sequences_sha256": hashlib.sha256(json.dumps(sequences).encode()).hexdigest()}
        if directory is not None:
            found = directory / "index.json"
            if found.is_file() and _read_index(found) == {**index, "complete": True}:
                return cls(*_mapped(directory, offsets[-1], width, target), offsets)
            directory.mkdir(parents=True, exist_ok=True)
            found.unlink(missing_ok=True)
            for name in ("taps.bin", "final.bin"):
                (directory / name).unlink(missing_ok=True)
            taps, final = _mapped(directory, offsets[-1], width, target)
        else:
            taps = torch.empty(offsets[-1], width, dtype=target.dtype)
            final = torch.empty(offsets[-1], target.hidden_size, dtype=target.dtype)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        report = _reporter(progress, len(sequences))
        for start in range(0, len(order), batch):
            group = order[start:start + batch]
            for i, (t, f) in zip(group, target([sequences[i] for i in group]), strict=True):
                taps[offsets[i]:offsets[i + 1]].copy_(t)
                final[offsets[i]:offsets[i + 1]].copy_(f)
            report(start + len(group))
        if directory is not None:
            (directory / "index.json").write_text(json.dumps({**index, "complete": True}))
        return cls(taps, final, offsets)


def _read_index(path: Path) -> Any:
    """A cache's ``index.json``; ``None`` when it is not JSON (a cache written in part:
    rebuilt)."""
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError):
        return None


def _mapped(directory: Path, rows: int, width: int,
            target: TargetFeatures) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's two files, memory-mapped (created at their size when absent)."""
    taps = torch.from_file(str(directory / "taps.bin"), shared=True, size=rows * width,
                           dtype=target.dtype).view(rows, width)
    final = torch.from_file(str(directory / "final.bin"), shared=True,
                            size=rows * target.hidden_size,
                            dtype=target.dtype).view(rows, target.hidden_size)
    return taps, final


def _reporter(enabled: bool, total: int) -> Any:
    """Progress of the target's pass on stderr, one line per tenth of the sequences."""
    if not enabled:
        return lambda done: None
    began, every, last = time.monotonic(), max(1, total // 10), [0]

    def line(done: int) -> None:
        if done // every > last[0] // every or done >= total:
            print(f"lmkit: target features: {done} of {total} sequences "
                  f"({100 * done // max(total, 1)}%), {time.monotonic() - began:.0f} s",
                  file=sys.stderr, flush=True)
        last[0] = done
    return line

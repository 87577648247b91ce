"""The model runner's side of pooling requests: each request's pooler state across its
prefill chunks, and the pooled outputs of the requests whose prompt a step finished.

The runner consults this only when it holds a pooling request (``bool(pooling)``), so
a step without one pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from lmkit.api.contract import build
from lmkit.api.pooling import ModelPooling, Pooler, PoolingParams

if TYPE_CHECKING:
    from lmkit.api.model import Model
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.worker.input_batch import StepInputs


@dataclass
class _PoolState:
    pooler: Pooler
    params: PoolingParams
    num_prompt_tokens: int
    state: Any


class PoolingRequests:
    """Pooler states of the pooling requests the runner holds.

    Args:
        host: resolves pooler names (the ``pooler`` kind) to implementations.
        facts: the model's declared :class:`ModelPooling` (its default pooler).

    :attr:`model` (the loaded model, given to each pooler: a classification head reads
    it) is set by the runner once the model is loaded.
    """

    def __init__(self, host: PluginHost, facts: ModelPooling) -> None:
        self.host = host
        self.model: Model | None = None
        self.facts = facts
        self.states: dict[str, _PoolState] = {}
        self._poolers: dict[str, Pooler] = {}

    def __bool__(self) -> bool:
        return bool(self.states)

    def pooler(self, name: str | None) -> Pooler:
        """The pooler called ``name`` (the model's default for ``None``), built once."""
        name = name or self.facts.default_pooler
        pooler = self._poolers.get(name)
        if pooler is None:
            reg = self.host.registry.get("pooler", name)
            pooler = build("pooler", reg.spec.load(), self.model, plugin=reg.origin)
            self._poolers[name] = pooler
        return pooler

    def add(self, req_id: str, params: PoolingParams, num_prompt_tokens: int) -> None:
        """Start (or restart, after a preemption) a request's pooling."""
        pooler = self.pooler(params.pooling_type)
        self.states[req_id] = _PoolState(pooler, params, num_prompt_tokens, pooler.start())

    def remove(self, req_id: str) -> None:
        """Forget a request (finished, aborted or preempted); unknown ids are ignored."""
        self.states.pop(req_id, None)

    def pool_step(self, hidden: torch.Tensor, order: list[str], step: StepInputs
                  ) -> dict[str, Any]:
        """Fold this step's chunks into their requests' states; return the finished
        requests' outputs (truncated to ``dimensions``, normalized), as lists.

        Vectors of the same size and parameters are finalized together (one stack,
        one normalization and one ``tolist`` per group, not per request)."""
        done: dict[str, Any] = {}
        batches: dict[tuple[Any, ...], tuple[PoolingParams, list[str], list[torch.Tensor]]] = {}
        for i, rid in enumerate(order):
            entry = self.states.get(rid)
            if entry is None:
                continue
            n = int(step.num_scheduled[i])
            start = int(step.num_computed[i])
            first_row = int(step.cu_num_tokens[i]) - n
            rows = hidden[first_row:first_row + n]
            if start == 0 and n >= entry.num_prompt_tokens:  # the whole prompt at once
                out = entry.pooler.pool(rows)
            else:
                entry.state = entry.pooler.accumulate(entry.state, rows, start)
                if start + n < entry.num_prompt_tokens:
                    continue
                out = entry.pooler.finish(entry.state, entry.num_prompt_tokens)
            del self.states[rid]
            params = entry.params
            if params.normalize and entry.pooler.outputs_probabilities:
                params = replace(params, normalize=False)  # a distribution
            if out.dim() != 1:  # per-token outputs ([n, dim]): one at a time
                done[rid] = finalize(out, params).tolist()
                continue
            key = (out.shape[0], out.dtype, params.dimensions, params.normalize)
            batch = batches.setdefault(key, (params, [], []))
            batch[1].append(rid)
            batch[2].append(out)
        if not batches:
            return done
        for params, rids, outs in batches.values():
            vectors = finalize(torch.stack(outs), params).tolist()
            done.update(zip(rids, vectors, strict=True))
        return {rid: done[rid] for rid in order if rid in done}  # in step order


def finalize(out: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation to ``params.dimensions``, then L2 normalization if asked;
    float32 on the CPU. Works on ``[dim]`` and on per-token ``[n, dim]`` outputs."""
    out = out.float()
    if params.dimensions is not None:
        out = out[..., :params.dimensions]
    if params.normalize:
        out = torch.nn.functional.normalize(out, p=2.0, dim=-1)
    return out.cpu()

"""The built-in poolers. Each keeps a small per-request state across prefill chunks, so
a prompt split over several steps pools exactly as in one step."""

from __future__ import annotations

from typing import Any

import torch
from lmkit.api import InvalidRequestError, Model, Pooler, PoolingModel


class LastPooler(Pooler):
    """The hidden state of the prompt's last token."""

    def accumulate(self, state: Any, hidden: torch.Tensor, first_position: int) -> Any:
        return hidden[-1]  # [hidden]; a later chunk replaces it

    def finish(self, state: Any, num_prompt_tokens: int) -> torch.Tensor:
        return state

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[-1]


class MeanPooler(Pooler):
    """The mean of every prompt token's hidden state (a float32 running sum)."""

    def accumulate(self, state: Any, hidden: torch.Tensor, first_position: int) -> Any:
        total = hidden.float().sum(dim=0)  # [hidden]
        return total if state is None else state + total

    def finish(self, state: Any, num_prompt_tokens: int) -> torch.Tensor:
        return state / num_prompt_tokens

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float().mean(dim=0)


class CLSPooler(Pooler):
    """The hidden state of the first prompt token ([CLS])."""

    def accumulate(self, state: Any, hidden: torch.Tensor, first_position: int) -> Any:
        return hidden[0] if first_position == 0 else state

    def finish(self, state: Any, num_prompt_tokens: int) -> torch.Tensor:
        return state

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[0]


class AllPooler(Pooler):
    """Every prompt token's hidden state: ``[num_prompt_tokens, hidden]``."""

    def start(self) -> Any:
        return []

    def accumulate(self, state: Any, hidden: torch.Tensor, first_position: int) -> Any:
        state.append(hidden.clone())  # the step's hidden buffer is reused
        return state

    def finish(self, state: Any, num_prompt_tokens: int) -> torch.Tensor:
        return torch.cat(state)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.clone()


class ClassifyPooler(Pooler):
    """Class probabilities: the model's classification pooler (its declared
    ``ModelPooling.classifier_pooler``), then its ``classify`` head, then transformers'
    text-classification default: softmax over two or more labels, sigmoid of a single
    label's logit (a cross-encoder's relevance score; softmax of one value is always 1)."""

    _BASE: dict[str, type[Pooler]] = {"last": LastPooler, "mean": MeanPooler, "cls": CLSPooler}
    outputs_probabilities = True  # never L2-normalized (one label would always be 1.0)

    def __init__(self, model: Model | None = None) -> None:
        super().__init__(model)
        base = model.pooling.classifier_pooler if model is not None else None
        if base is None or not isinstance(model, PoolingModel):
            raise InvalidRequestError(
                f"this model ({type(model).__name__}) has no classification head; "
                "pooling_type 'classify' needs a *ForSequenceClassification model",
                param="pooling_type", code="invalid_value")
        self.head: PoolingModel = model
        self.base: Pooler = self._BASE[base](model)

    def accumulate(self, state: Any, hidden: torch.Tensor, first_position: int) -> Any:
        return self.base.accumulate(state, hidden, first_position)

    def finish(self, state: Any, num_prompt_tokens: int) -> torch.Tensor:
        return self._probs(self.base.finish(state, num_prompt_tokens))

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._probs(self.base.pool(hidden))

    def _probs(self, pooled: torch.Tensor) -> torch.Tensor:
        logits = self.head.classify(pooled[None])[0].float()  # [num_labels]
        if logits.shape[-1] == 1:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)

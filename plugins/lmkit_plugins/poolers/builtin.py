"""The built-in poolers. Each keeps a small per-request state across prefill chunks, so
a prompt split over several steps pools exactly as in one step."""

from __future__ import annotations

from typing import Any

import torch
from lmkit.api import ClassifierHead, InvalidRequestError, Model, Pooler, PoolingModel


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
    """Class scores: the model's classification pooler (its declared
    ``ModelPooling.classifier_pooler``), then its ``classify`` head, then the activation
    its config's ``problem_type`` calls for (:class:`~lmkit.api.pooling.ClassifierHead`,
    as transformers' text-classification pipeline): a softmax for single-label
    classification, a sigmoid per label for multi-label classification and for a single
    label (a cross-encoder's relevance score), none for regression (raw values).

    A model declares its head's problem type as its ``classifier_head`` attribute; a
    model without one is treated as ``problem_type`` ``None`` (inferred from the
    number of labels)."""

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
        self.classifier: ClassifierHead | None = model.classifier_head

    def accumulate(self, state: Any, hidden: torch.Tensor, first_position: int) -> Any:
        return self.base.accumulate(state, hidden, first_position)

    def finish(self, state: Any, num_prompt_tokens: int) -> torch.Tensor:
        return self._scores(self.base.finish(state, num_prompt_tokens))

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._scores(self.base.pool(hidden))

    def _scores(self, pooled: torch.Tensor) -> torch.Tensor:
        logits = self.head.classify(pooled[None])[0]  # [num_labels]
        head = self.classifier or ClassifierHead(int(logits.shape[-1]))
        return head.apply(logits)

"""Pooling: requests that return a vector (an embedding, class scores) instead of text.

A pooling request is prefill only: the engine runs its prompt (in chunks if need be),
a :class:`Pooler` reduces the prompt's hidden states to its output as the chunks go by,
and the request finishes when its prompt is done. :class:`PoolingParams` says how;
models declare their default pooler, attention and classification head as
:class:`ModelPooling` data on the class (``pooling = ModelPooling(...)``, see
:attr:`lmkit.api.Model.pooling`); whether a model can generate is its kind
(:class:`~lmkit.api.CausalLM` or :class:`~lmkit.api.PoolingModel`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lmkit.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import torch

    from lmkit.api.model import Model

BUILTIN_POOLERS = ("last", "mean", "cls", "all")
REGRESSION = "regression"
SINGLE_LABEL = "single_label_classification"
MULTI_LABEL = "multi_label_classification"
#: the values of transformers' ``PretrainedConfig.problem_type`` (besides ``None``)
PROBLEM_TYPES = (REGRESSION, SINGLE_LABEL, MULTI_LABEL)


@dataclass
class PoolingParams:
    """How one pooling request turns its prompt's hidden states into its output.

    ``pooling_type`` names a registered pooler (built-ins: ``last`` token, ``mean`` over
    the prompt, ``cls`` (the first token), ``all`` (one vector per token), ``classify``
    when the model has a classification head); ``None`` takes the model's default.
    ``dimensions`` keeps the first that many values (Matryoshka truncation), then
    ``normalize`` scales each vector to unit L2 norm.
    """

    pooling_type: str | None = None
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and (not isinstance(self.pooling_type, str)
                                              or not self.pooling_type):
            raise InvalidRequestError(
                f"pooling_type must be a pooler name such as {', '.join(BUILTIN_POOLERS)}; "
                f"got {self.pooling_type!r}", param="pooling_type", code="invalid_value")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise InvalidRequestError(
                f"dimensions must be a positive integer, got {self.dimensions!r}",
                param="dimensions", code="invalid_value")


@dataclass(frozen=True)
class ModelPooling:
    """What a model class declares about pooling (``pooling = ModelPooling(...)``).

    ``default_pooler``: the pooler used when a request names none. ``causal``: ``False``
    for an encoder with bidirectional attention (it then needs the ``non_causal``
    attention feature, and each prompt runs in one step, unchunked and uncached).
    ``classifier_pooler``: for a model with a classification head (a ``classify(pooled)``
    method, ``[n, hidden] -> [n, num_labels]`` logits), the pooler whose output feeds it;
    ``None``: no head (the ``classify`` pooler is refused).
    """

    default_pooler: str = "last"
    causal: bool = True
    classifier_pooler: str | None = None


@dataclass(frozen=True)
class ClassifierHead:
    """What a classification head's logits mean, from its HF config: ``num_labels``
    of them, trained for ``problem_type``, which picks the activation the ``classify``
    pooler applies, as transformers' text-classification pipeline does:

    * ``regression``: none (the raw values);
    * ``multi_label_classification``, or a single label (``None`` or
      ``single_label_classification``): a sigmoid of each logit (independent labels; a
      one-label cross-encoder's relevance score);
    * ``single_label_classification``, or ``None``, over two or more labels: a softmax.

    A model with a classification head sets it as its ``classifier_head`` attribute
    when it is built (:meth:`from_hf`), so a bad ``problem_type`` fails the load.

    Raises:
        ModelLoadError: ``problem_type`` is not one of :data:`PROBLEM_TYPES` or ``None``,
            or ``num_labels`` is not a positive integer.
    """

    num_labels: int
    problem_type: str | None = None

    def __post_init__(self) -> None:
        if self.problem_type is not None and self.problem_type not in PROBLEM_TYPES:
            raise ModelLoadError(
                f"config.json problem_type {self.problem_type!r} is not supported; allowed: "
                f"{', '.join(repr(p) for p in PROBLEM_TYPES)}, or null (inferred: "
                "a sigmoid for one label, a softmax over two or more)")
        if (not isinstance(self.num_labels, int) or isinstance(self.num_labels, bool)
                or self.num_labels < 1):
            raise ModelLoadError(f"a classification head needs num_labels >= 1 "
                                 f"(config.json num_labels / id2label); got {self.num_labels!r}")

    @classmethod
    def from_hf(cls, hf_config: Any) -> ClassifierHead:
        """The head a transformers config describes (``num_labels``, else the length of
        ``id2label``; ``problem_type``)."""
        num_labels = getattr(hf_config, "num_labels", None) or len(hf_config.id2label or {})
        return cls(int(num_labels), getattr(hf_config, "problem_type", None))

    @property
    def activation(self) -> Literal["none", "sigmoid", "softmax"]:
        """The function applied to the logits (see the class docstring)."""
        if self.problem_type == REGRESSION:
            return "none"
        if self.problem_type == MULTI_LABEL or self.num_labels == 1:
            return "sigmoid"
        return "softmax"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., num_labels]`` -> float32 scores of the same shape."""
        import torch

        logits = logits.float()
        if self.activation == "sigmoid":
            return torch.sigmoid(logits)
        if self.activation == "softmax":
            return torch.softmax(logits, dim=-1)
        return logits


class Pooler(ABC):
    """Reduces one request's prompt hidden states to its pooled output, chunk by chunk.

    One instance serves every request (it keeps no per-request data itself): the runner
    keeps each request's ``state``, starting from :meth:`start`, passes every prefill
    chunk to :meth:`accumulate`, and calls :meth:`finish` once the prompt is done.
    Registered through the ``register_poolers`` hook; constructed once per engine as
    ``cls(model)`` (the loaded :class:`~lmkit.api.Model`).
    """

    #: True when the output is class scores (probabilities, or a regression head's raw
    #: values: :class:`ClassifierHead`), not an embedding: the runner then never
    #: L2-normalizes it, whatever ``PoolingParams.normalize`` says
    outputs_probabilities: ClassVar[bool] = False

    def __init__(self, model: Model | None = None) -> None:
        self.model = model

    def start(self) -> Any:
        """The state of a request before its first chunk (default ``None``)."""
        return None

    @abstractmethod
    def accumulate(self, state: Any, hidden: torch.Tensor, first_position: int) -> Any:
        """Fold one chunk into ``state``; return the new state.

        :param hidden: ``[chunk_len, hidden_size]``, the chunk's final hidden states.
        :param first_position: the prompt position of ``hidden[0]``.
        """

    @abstractmethod
    def finish(self, state: Any, num_prompt_tokens: int) -> torch.Tensor:
        """The pooled output: ``[dim]`` (or ``[num_tokens, dim]`` for per-token poolers)."""

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """A whole prompt in one chunk (the common case): ``[n, hidden]`` -> output."""
        return self.finish(self.accumulate(self.start(), hidden, 0), hidden.shape[0])

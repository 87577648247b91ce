"""Request bodies of the pooling endpoints (``/v1/embeddings``), validated once at the
boundary like the generation ones (:mod:`lmkit.serve.protocol`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from lmkit.api.pooling import PoolingParams
from lmkit.errors import InvalidRequestError
from lmkit.serve.protocol import Int64, Prompt, _TextBody

# a text to pool: an empty one is refused here, naming its field (not "prompt")
Text = Annotated[str, Field(min_length=1)]


class EmbeddingRequest(_TextBody):
    """``POST /v1/embeddings`` (OpenAI): ``input`` is a string, a list of strings, a list
    of token ids or a list of token-id lists. lmkit extensions (``extra_body``):
    ``pooling_type`` (a pooler name; default: the model's), ``normalize`` (default
    true) and ``priority``."""

    model: str
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    pooling_type: str | None = None
    normalize: bool = True
    priority: Int64 = 0

    def inputs(self) -> list[str | list[int]]:
        """The batch as a list of inputs, each text or token ids."""
        return split_inputs(self.input)

    def to_pooling_params(self) -> PoolingParams:
        """The request's :class:`PoolingParams` (``dimensions`` checked there)."""
        return PoolingParams(pooling_type=self.pooling_type, normalize=self.normalize,
                             dimensions=self.dimensions)


class _PoolingFields(_TextBody):
    model: str
    pooling_type: str | None = None
    normalize: bool = True
    priority: Int64 = 0

    def to_pooling_params(self) -> PoolingParams:
        """The :class:`PoolingParams` both texts of a pair are pooled with."""
        return PoolingParams(pooling_type=self.pooling_type, normalize=self.normalize)


class ClassifyRequest(_PoolingFields):
    """``POST /classify`` (vLLM's shape): class probabilities of each input from the
    model's classification head."""

    input: Prompt

    def inputs(self) -> list[str | list[int]]:
        """The batch as a list of inputs (as :meth:`EmbeddingRequest.inputs`)."""
        return split_inputs(self.input)

    def to_pooling_params(self) -> PoolingParams:
        """``classify`` (probabilities, not normalized vectors)."""
        return PoolingParams(pooling_type="classify", normalize=False)


class ScoreRequest(_PoolingFields):
    """``POST /score`` (vLLM's shape): ``text_1`` against each of ``text_2``, or two
    lists pairwise; the score is the cosine of the embeddings (MaxSim over per-token
    vectors with ``pooling_type: all``)."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]


class RerankRequest(_PoolingFields):
    """``POST /rerank`` (Jina/Cohere shape): ``documents`` ranked by relevance to
    ``query``; ``top_n`` keeps the best N, ``return_documents`` echoes their text."""

    query: str = Field(min_length=1)
    documents: list[Text] = Field(min_length=1)
    top_n: Int64 | None = Field(None, ge=1)
    return_documents: bool = True


def split_inputs(value: Any) -> list[str | list[int]]:
    """An ``input`` field as a list of inputs, each text or token ids.

    :raises InvalidRequestError: no input, or an empty string or token list among them.
    """
    if isinstance(value, str):
        items: list[Any] = [value]
    elif not value:
        items = []
    elif all(isinstance(x, int) for x in value):
        items = [list(value)]
    else:
        items = list(value)
    if not items or any(len(x) == 0 for x in items):
        raise InvalidRequestError("input must not be empty (nor hold an empty string or "
                                  "an empty token list)", param="input", code="invalid_value")
    return items


def count_texts(data: Any, *keys: str) -> int:
    """How many texts an unvalidated scoring body names under ``keys`` (before it is
    validated, so that a huge batch is refused at once)."""
    if not isinstance(data, dict):
        return 1
    return sum(len(v) if isinstance(v, list) else 1 for k in keys
               if (v := data.get(k)) is not None) or 1


def count_inputs(data: Any) -> int:
    """How many inputs an unvalidated embeddings body asks for (1 where not yet well
    formed: validation reports that)."""
    if not isinstance(data, dict):
        return 1
    value = data.get("input")
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return len(value)
    return 1

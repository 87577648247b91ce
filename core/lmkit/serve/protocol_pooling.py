"""Request bodies of the pooling endpoints (``/v1/embeddings``), validated once at the
boundary like the generation ones (:mod:`lmkit.serve.protocol`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt

from lmkit.api.pooling import PoolingParams
from lmkit.api.sampling_params import INT64_MAX, INT64_MIN
from lmkit.errors import InvalidRequestError
from lmkit.serve.protocol import Int64, Prompt, _TextBody

# a text to pool: an empty one is refused here, naming its field (not "prompt")
Text = Annotated[str, Field(min_length=1)]
# counts that JSON must give as integers: ``true`` is not 1, nor ``2.0`` two
Count = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Truncation(_TextBody):
    truncate_prompt_tokens: Count | None = Field(None, ge=-1)

    def truncation(self) -> int | None:
        """``truncate_prompt_tokens`` (vLLM's): keep at most that many tokens of each
        input (``-1``: the model's context); ``None``: an input longer than the context
        is a 400 (see :func:`lmkit.serve.routes_embeddings.prompt_ids`)."""
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequestError(
                "truncate_prompt_tokens must be -1 (truncate to the model's context) or a "
                "positive number of tokens to keep; got 0", param="truncate_prompt_tokens",
                code="invalid_value")
        return self.truncate_prompt_tokens


class EmbeddingRequest(_Truncation):
    """``POST /v1/embeddings`` (OpenAI): ``input`` is a string, a list of strings, a list
    of token ids or a list of token-id lists. lmkit extensions (``extra_body``):
    ``pooling_type`` (a pooler name; default: the model's), ``normalize`` (default
    true), ``truncate_prompt_tokens`` (vLLM's) and ``priority``."""

    model: str
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: str | None = None
    pooling_type: str | None = None
    normalize: bool = True
    priority: Int64 = 0

    def inputs(self) -> list[str | list[int]]:
        """The batch as a list of inputs, each text or token ids."""
        return split_inputs(self.input)

    def labels(self) -> list[str]:
        """How errors name each input: ``input``, or ``input[i]`` in a batch."""
        return input_labels(self.input)

    def to_pooling_params(self) -> PoolingParams:
        """The request's :class:`PoolingParams` (``dimensions`` checked there)."""
        return PoolingParams(pooling_type=self.pooling_type, normalize=self.normalize,
                             dimensions=self.dimensions)


class _PoolingFields(_Truncation):
    model: str
    pooling_type: str | None = None
    normalize: bool = True
    priority: Int64 = 0

    def to_pooling_params(self) -> PoolingParams:
        """The :class:`PoolingParams` both texts of a pair are pooled with."""
        return PoolingParams(pooling_type=self.pooling_type, normalize=self.normalize)


class ClassifyRequest(_PoolingFields):
    """``POST /classify`` (vLLM's shape): class scores of each input from the model's
    classification head (probabilities, or raw values for a ``regression`` head)."""

    input: Prompt

    def inputs(self) -> list[str | list[int]]:
        """The batch as a list of inputs (as :meth:`EmbeddingRequest.inputs`)."""
        return split_inputs(self.input)

    def labels(self) -> list[str]:
        """How errors name each input (as :meth:`EmbeddingRequest.labels`)."""
        return input_labels(self.input)

    def to_pooling_params(self) -> PoolingParams:
        """``classify`` (class scores, not normalized vectors)."""
        return PoolingParams(pooling_type="classify", normalize=False)


class ScoreRequest(_PoolingFields):
    """``POST /score`` (vLLM's shape): ``text_1`` against each of ``text_2``, or two
    lists pairwise; the score is the cosine of the embeddings (MaxSim over per-token
    vectors with ``pooling_type: all``)."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]

    def labels(self) -> dict[str, str]:
        """How errors name each distinct text: where it first appears (``text_1``,
        ``text_2[3]``, ...)."""
        named = [*text_labels("text_1", self.text_1), *text_labels("text_2", self.text_2)]
        return dict(reversed(named))  # the first place a text appears wins


class RerankRequest(_PoolingFields):
    """``POST /rerank`` (Jina/Cohere shape): ``documents`` ranked by relevance to
    ``query``; ``top_n`` keeps the best N (``0``, vLLM's default, or none: all of
    them), ``return_documents`` echoes their text."""

    query: str = Field(min_length=1)
    documents: list[Text] = Field(min_length=1)
    top_n: Count | None = Field(None, ge=0)
    return_documents: bool = True

    def labels(self) -> list[str]:
        """How errors name the texts pooled: ``query``, then ``documents[i]``."""
        return ["query", *(f"documents[{i}]" for i in range(len(self.documents)))]


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
    if not items:
        raise InvalidRequestError("input must not be empty: give a text, a list of texts, "
                                  "a list of token ids or a list of token-id lists",
                                  param="input", code="invalid_value")
    empty = next((i for i, x in enumerate(items) if len(x) == 0), None)
    if empty is not None:
        where = input_labels(value)[empty]
        raise InvalidRequestError(f"{where} is empty; every input needs at least one "
                                  "character or token id", param=where, code="invalid_value")
    return items


def input_labels(value: Any) -> list[str]:
    """Error names of the inputs :func:`split_inputs` makes of an ``input`` field:
    ``input`` for one text or one token list, ``input[i]`` for each of a batch."""
    if isinstance(value, str) or (value and all(isinstance(x, int) for x in value)):
        return ["input"]
    return [f"input[{i}]" for i in range(len(value))]


def text_labels(name: str, value: str | list[str]) -> list[tuple[str, str]]:
    """(text, error name) of a scoring field that holds one text or a list of them."""
    if isinstance(value, str):
        return [(value, name)]
    return [(text, f"{name}[{i}]") for i, text in enumerate(value)]


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

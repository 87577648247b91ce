"""``LLM.embed`` and ``LLM.classify``: pooling requests in the offline API.

Pooling requests run in the same engine steps as generation: their results are picked
out of each step's outputs by :meth:`PoolingFrontend.take_pooled`, which the ``LLM``
step loop calls only while a pooling request is pending.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmkit.api.outputs import EngineCoreOutput, PoolingOutput
from lmkit.api.pooling import PoolingParams
from lmkit.errors import InvalidRequestError

if TYPE_CHECKING:
    from lmkit.engine.core import EngineCore
    from lmkit.frontend.processor import InputProcessor


class PoolingFrontend:
    """Submits pooling requests to an in-process engine and keeps their results."""

    def __init__(self, engine: EngineCore, input_processor: InputProcessor) -> None:
        self.engine = engine
        self.input_processor = input_processor
        self.pending: dict[str, list[int]] = {}  # request id -> prompt token ids
        self.results: dict[str, PoolingOutput] = {}
        self.dimensions: dict[str, int] = {}  # request id -> dimensions it asked for

    def submit(self, request_id: str, prompt: str | Sequence[int],
               params: PoolingParams, priority: int = 0,
               token_ids: list[int] | None = None) -> str:
        """Tokenize ``prompt`` (unless its ``token_ids`` are given) and queue one pooling
        request; returns its id."""
        ids = token_ids if token_ids is not None else self.input_processor.tokenize(prompt)[1]
        request = self.input_processor.make_pooling_request(request_id, ids, params, priority)
        self.engine.add_request(request)
        self.pending[request_id] = ids
        if params.dimensions is not None:
            self.dimensions[request_id] = params.dimensions
        return request_id

    def take_pooled(self, outputs: list[EngineCoreOutput]) -> None:
        """Keep the pooled results among one step's outputs."""
        for out in outputs:
            if out.pooled is None:
                continue
            ids = self.pending.pop(out.request_id, None)
            if ids is not None:
                self.results[out.request_id] = PoolingOutput(out.request_id, ids, out.pooled)

    def collect(self, request_ids: list[str]) -> list[PoolingOutput]:
        """The results of ``request_ids`` (all finished), in that order.

        :raises InvalidRequestError: a request asked for more ``dimensions`` than the
            model's vectors have (the engine keeps the first ``dimensions`` values).
        """
        outputs = [self.results.pop(rid) for rid in request_ids]
        asked = [self.dimensions.pop(rid, None) for rid in request_ids]
        for out, dimensions in zip(outputs, asked, strict=True):
            check_dimensions(out.data, dimensions)
        return outputs

    def abort(self, request_ids: list[str]) -> None:
        """Forget and abort pooling requests (unknown or finished ids are ignored)."""
        for rid in request_ids:
            self.pending.pop(rid, None)
            self.results.pop(rid, None)
            self.dimensions.pop(rid, None)
        self.engine.abort_requests(request_ids)


def pooling_params(params: PoolingParams | None, **overrides: Any) -> PoolingParams:
    """``params`` (or the defaults) with the keyword overrides that are not None."""
    import dataclasses

    base = params or PoolingParams()
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(base, **changes) if changes else base


def check_dimensions(data: Any, dimensions: int | None) -> None:
    """Refuse a pooled output shorter than the ``dimensions`` its request asked for: the
    engine keeps the first ``dimensions`` values, so the model's vectors have fewer.

    :raises InvalidRequestError: naming ``dimensions`` and the model's size.
    """
    if dimensions is None:
        return
    width = len(data[0]) if data and isinstance(data[0], list) else len(data)
    if width < dimensions:
        raise InvalidRequestError(
            f"dimensions is {dimensions}, but this model's embeddings have {width} values; "
            f"ask for at most {width} (or leave dimensions out)", param="dimensions",
            code="invalid_value")

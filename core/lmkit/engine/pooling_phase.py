"""Checks of pooling requests as they enter the engine (a :class:`StepPhase`).

A pooling request must name a registered pooler (or take the model's default), and a
model with no language-model head takes pooling requests only. Refusals happen at
:meth:`add_request`, before the request is ever scheduled, with the names that exist.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmkit.engine.phases import StepPhase
from lmkit.errors import InvalidRequestError, UnknownBackendError

if TYPE_CHECKING:
    from lmkit.api.model_facts import ModelFacts
    from lmkit.api.request import Request
    from lmkit.plugin_host.manager import PluginHost


class PoolingPhase(StepPhase):
    """Refuses pooling requests this model cannot serve, and generation requests to a
    pooling-only model; names the pooler of requests that left it to the model (its
    declared default, or the one its sentence-transformers config names); counts the
    pooling requests taken."""

    def __init__(self, host: PluginHost, facts: ModelFacts,
                 default_pooler: str | None = None) -> None:
        self.host = host
        self.facts = facts
        self.default_pooler = default_pooler or facts.pooling.default_pooler
        self.architecture = facts.architecture
        self.num_pooling_requests = 0

    def add_request(self, request: Request) -> None:
        """Refuse an unknown pooler, or generation from a model that cannot generate."""
        params = request.pooling_params
        if params is None:
            if not self.facts.generates:
                raise InvalidRequestError(
                    f"this model ({self.architecture}) has no language-model head and "
                    "cannot generate text; use it through /v1/embeddings (LLM.embed)",
                    param="model", code="model_cannot_generate")
            return
        name = params.pooling_type or self.default_pooler
        try:
            self.host.registry.get("pooler", name)
        except UnknownBackendError as e:
            raise InvalidRequestError(str(e), param="pooling_type",
                                      code="invalid_value") from None
        if name == "classify" and self.facts.pooling.classifier_pooler is None:
            raise InvalidRequestError(
                f"this model ({self.architecture}) has no classification head; "
                "pooling_type 'classify' needs a model that declares one", param="pooling_type",
                code="invalid_value")
        if params.pooling_type is None:
            request.pooling_params = dataclasses.replace(params, pooling_type=name)
        self.num_pooling_requests += 1

    def stats(self) -> dict[str, Any]:
        """``num_pooling_requests``: pooling requests accepted since start."""
        return {"num_pooling_requests": self.num_pooling_requests}


def sentence_transformers_pooler(model_dir: Path) -> str | None:
    """The pooler a sentence-transformers export asks for in ``1_Pooling/config.json``
    (``mean``, ``cls`` or ``last``), or ``None`` without one (or another mode)."""
    import json

    try:
        cfg = json.loads((Path(model_dir) / "1_Pooling" / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    modes = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_lasttoken": "last"}
    chosen = [name for key, name in modes.items() if cfg.get(key)]
    return chosen[0] if len(chosen) == 1 else None

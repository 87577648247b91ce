"""Scores between texts from their pooled outputs: cosine similarity of embeddings
(bi-encoders), or late-interaction MaxSim for per-token (``all``) outputs, as ColBERT
scores a query against a document.

Each text is pooled on its own, so a sequence classifier (a cross-encoder reranker,
which must read the query and the document together) is refused by
:func:`check_scorable`: lmkit does not encode pairs jointly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lmkit.errors import InvalidRequestError


def check_scorable(default_pooler: str, pooling_type: str | None = None) -> None:
    """Refuse to score with a classification pooler: the model's default one (a
    sequence classifier, e.g. a cross-encoder reranker) or a request's ``classify``.

    :param default_pooler: the model's ``ModelPooling.default_pooler``.
    :param pooling_type: the request's ``pooling_type`` (``None``: the default).
    :raises InvalidRequestError: naming the model's kind and what to use instead.
    """
    if default_pooler == "classify":
        raise InvalidRequestError(
            "this model is a sequence classifier (cross-encoder); lmkit scores with "
            "embedding models only (cosine, or MaxSim with pooling_type 'all', of separately "
            "pooled texts) and does not encode text pairs jointly; use /classify "
            "(LLM.classify) for this model's class probabilities", param="model",
            code="invalid_value")
    if pooling_type == "classify":
        raise InvalidRequestError(
            "pooling_type 'classify' gives class probabilities, not embeddings to score; "
            "lmkit scores with embedding models only (cosine, or MaxSim with pooling_type "
            "'all'); leave pooling_type out or use /classify", param="pooling_type",
            code="invalid_value")


def pair_texts(text_1: str | Sequence[str], text_2: str | Sequence[str]
               ) -> list[tuple[str, str]]:
    """The pairs to score: one text against each of a list, or two lists pairwise.

    :raises InvalidRequestError: empty lists, or two lists of different lengths.
    """
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", left), ("text_2", right)):
        if not texts:
            raise InvalidRequestError(f"{name} must not be empty: give a text, or a list of "
                                      "at least one", param=name, code="invalid_value")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise InvalidRequestError(
            f"text_1 has {len(left)} texts and text_2 {len(right)}; give one text_1 to score "
            "against every text_2, or two lists of the same length", param="text_2",
            code="invalid_value")
    return list(zip(left, right, strict=True))


def score(a: Any, b: Any) -> float:
    """Cosine similarity of two vectors, or MaxSim of two per-token matrices (each
    query token's best cosine over the document's tokens, summed)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.ndim == 2 and y.ndim == 2:
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        y = y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-12)
        return float((x @ y.T).max(axis=1).sum())
    if x.ndim != 1 or y.ndim != 1 or x.shape != y.shape:
        raise InvalidRequestError(
            f"cannot score outputs of shapes {x.shape} and {y.shape}; scoring needs one "
            "vector per text (or per-token vectors with pooling_type 'all')",
            param="pooling_type", code="invalid_value")
    norm = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y) / max(norm, 1e-12)

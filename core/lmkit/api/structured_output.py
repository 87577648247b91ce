"""The StructuredOutputBackend contract: constraints compiled into token masks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Grammar(ABC):
    """One request's matcher state over a compiled constraint."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (state unchanged) if any is not allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token mask into ``bitmask[row]`` (int32, 32 tokens per word)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the constraint is complete and only end-of-sequence may follow."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer. Constructed as
    ``cls(tokenizer, vocab_size, options=opts)``."""

    @abstractmethod
    def compile(self, kind: str, spec: Any) -> Grammar:
        """Compile a constraint (``kind`` one of ``json``, ``json_object``, ``regex``,
        ``grammar``, ``choice``, ``structural_tag``) into a fresh :class:`Grammar`.

        Raise :class:`lmkit.errors.InvalidRequestError` for an invalid constraint.
        """

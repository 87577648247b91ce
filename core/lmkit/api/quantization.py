"""What a quantization-method plugin implements: quantized weights kept packed.

A method is built for one model (``cls(facts, *, options)``, with the model's
:class:`~lmkit.api.model_facts.ModelFacts`); it reads a checkpoint whose linear layers
are stored quantized (GGUF blocks, FP8, ...), refuses a malformed one before anything
runs (:meth:`check`), yields the model's tensors with the quantized ones as
:class:`QuantizedTensor` (:meth:`iterate_weights`) and gives each layer a function that
computes with them (:meth:`linear`). Models build
their layers with the method from :class:`~lmkit.api.ModelBuildContext` and keep the
dense path when it is ``None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from lmkit.api.model_facts import ModelFacts


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight ``[out_features, in_features]`` kept in its quantized storage.

    ``data`` is the method's packed tensor (for GGUF, ``uint8 [out, row_bytes]``: each
    row's blocks as the file stores them); ``qtype`` names the storage type (``"Q4_1"``).
    Rows are independent, so methods can fuse projections by concatenating rows.
    """

    data: Any  # torch.Tensor
    qtype: str
    shape: tuple[int, int]


# (x [n, in] float, bias [out] or None) -> [n, out]
QuantizedLinear = Callable[[Any, Any], Any]
# (x [n, in], residual [n, in] or None, norm weight [in], eps, bias) -> (y [n, out], h)
QuantizedNormLinear = Callable[[Any, Any, Any, float, Any], tuple[Any, Any]]
# (gate_up [n, 2 * in], bias) -> (silu(gate) * up) @ W.T + bias  [n, out]
QuantizedSiluLinear = Callable[[Any, Any], Any]


class QuantizationMethod(ABC):
    """One quantized-weight format on one kind of device (registered with
    ``register_quantization_methods``; built as ``cls(facts, *, options)`` for the model
    whose :class:`~lmkit.api.model_facts.ModelFacts` are ``facts``: its directory, head
    counts and weight format)."""

    #: Whether :meth:`linear_with_norm` folds a pre-norm layer's residual add + RMSNorm
    #: into a projection (for inputs of up to :attr:`fold_max_rows` rows)
    supports_norm_linear: ClassVar[bool] = False
    #: Whether :meth:`linear_with_silu_mul` folds SiLU-and-multiply into a projection
    supports_silu_mul_linear: ClassVar[bool] = False
    fold_max_rows: ClassVar[int] = 0

    def __init__(self, facts: ModelFacts, *, options: BaseModel | None = None) -> None:
        self.facts = facts
        self.options = options

    @abstractmethod
    def check(self) -> None:
        """Refuse a checkpoint this method cannot run, before any weight is read:
        truncated files, block sizes that do not match the type, tensor types it does
        not read. Cheap (headers only).

        :raises ModelLoadError: what is wrong, in which file and tensor, and what to do.
        """

    @abstractmethod
    def iterate_weights(self) -> Iterator[tuple[str, Any]]:
        """Yield ``(hf_name, tensor)`` for every weight of ``facts.model_dir``, under
        Hugging Face names:
        quantized weights as :class:`QuantizedTensor`, the others as dense float
        ``torch.Tensor`` (float32, or the checkpoint's own float dtype)."""

    @abstractmethod
    def fuse(self, parts: list[QuantizedTensor]) -> QuantizedTensor | None:
        """The parts stacked along ``out`` (fused QKV, gate-up) as one tensor this
        method computes with, or ``None`` when they cannot be fused (different types);
        the model then dequantizes them (:meth:`dequantize`)."""

    @abstractmethod
    def linear(self, weight: QuantizedTensor) -> QuantizedLinear:
        """The function a layer calls per forward for ``weight``: ``(x, bias) -> y``.
        Built once at load (checks happen here, never per call)."""

    @abstractmethod
    def dequantize(self, weight: QuantizedTensor, rows: Any = None) -> Any:
        """Float32 ``[len(rows), in]`` of the given rows (int64 tensor; all when
        ``None``): embedding lookups and layers left dense."""

    def linear_with_norm(self, weight: QuantizedTensor
                         ) -> tuple[QuantizedLinear, QuantizedNormLinear | None]:
        """:meth:`linear`'s function and, from the same prepared weight, one with the
        layer's input norm folded in: ``(x, residual, norm_weight, eps, bias) -> (y,
        h)`` with ``h = x + residual`` (``x`` itself when ``residual`` is ``None``) and
        ``y = linear(rms_norm(h) * norm_weight, bias)``, the norm computed bit for bit
        as lmkit's float32 CPU RMSNorm kernel computes it
        (:mod:`lmkit_kernels.cpu.rms_norm`), for float32 CPU inputs of at most
        :attr:`fold_max_rows` rows with unit stride along ``in`` (models route
        other inputs to the separate norm); a CUDA method's, for half-precision inputs,
        as lmkit's Triton RMSNorm kernel computes it (models route them there when that
        kernel is the model's norm). ``None`` instead of the folded function where the
        method does not fold here. Only for methods declaring
        :attr:`supports_norm_linear`."""
        raise NotImplementedError(
            f"{type(self).__name__} does not fold norms into its projections; declare "
            "supports_norm_linear = True and implement linear_with_norm(), or call "
            "linear() only.")

    def linear_with_silu_mul(self, weight: QuantizedTensor
                             ) -> tuple[QuantizedLinear, QuantizedSiluLinear | None]:
        """:meth:`linear`'s function and, from the same prepared weight, one with a gated
        MLP's SiLU-and-multiply folded in: ``(gate_up, bias) -> linear(silu(gate) * up,
        bias)`` for ``gate_up`` ``[n, 2 * in]`` (gate then up per row), bit-identical to
        torch's ``F.silu(gate) * up`` followed by :meth:`linear`, for float32 CPU inputs of
        at most :attr:`fold_max_rows` rows with unit stride along the row (a CUDA
        method's, for half-precision inputs, to lmkit's Triton SiLU-and-multiply
        kernel's); ``None``
        instead of the folded function where the method cannot guarantee that here.
        Only for methods declaring :attr:`supports_silu_mul_linear`."""
        raise NotImplementedError(
            f"{type(self).__name__} does not fold SiLU-and-multiply into its projections; "
            "declare supports_silu_mul_linear = True and implement linear_with_silu_mul(), "
            "or call linear() only.")

"""Reading a Llama-family GGUF file's tensors for the ``gguf`` quantization method.

:func:`open_checked` validates the whole file before any tensor is used: the header and
tensor table must parse, every tensor's type must be one this method reads (quantized
``Q8_0``/``Q4_0``/``Q4_1``, the k-quants ``Q4_K``/``Q6_K``, ``Q5_0`` (held as ``Q8_0``, see
:func:`q5_0_as_q8_0`), or dense ``F32``/``F16``), a
quantized row must hold whole blocks (ggml's 32 weights, 256 for k-quants), and every tensor's bytes must lie inside the file (a
truncated download is caught here, not halfway through loading).
:func:`iterate_tensors` then yields the tensors under Hugging Face names, with the
row permutation llama.cpp's converter applies to the query and key projections undone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lmkit.api import ModelLoadError, QuantizedTensor

# ggml types this method reads: quantized ones kept packed, float ones dense
QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0")
HELD_AS = {"Q5_0": "Q8_0"}  # read as another type the kernels compute with (exactly)
DENSE = ("F32", "F16")
ARCHITECTURES = ("llama",)  # GGUF general.architecture values whose names map below

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_IGNORED = ("rope_freqs.weight",)  # llama3 RoPE factors: lmkit computes them from config
# a layer's tensors in the order a decode step reads them, then the model's last ones
_LAYER_ORDER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                "ffn_gate", "ffn_up", "ffn_down")
_LAST_ORDER = ("output_norm", "output", "token_embd")  # token_embd: the tied LM head


def _refuse(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"cannot run {path} with quantized weights: {what}. Re-download or re-export the "
        "GGUF file, or run it dense with --quantization none.")


def open_checked(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` after every check above.

    :raises ModelLoadError: the file is missing, unparsable, truncated, of another
        architecture, or holds a tensor type or shape this method does not read.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; the model directory keeps no GGUF file "
                             "(use --quantization none).")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # ValueError (bad type, bad block shape), IndexError, ...
        raise _refuse(path, f"its header or tensor table does not parse "
                      f"({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    arch = _string_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise _refuse(path, f"architecture {arch!r} is not one this method maps to lmkit's "
                      f"names ({', '.join(ARCHITECTURES)})")
    readable = {*QUANTIZED, *DENSE}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type).name
        if qtype not in readable:
            raise _refuse(path, f"tensor {t.name!r} has type {qtype}; the gguf method reads "
                          f"{', '.join(sorted(readable))}")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        row = int(t.shape[0])
        if row % block or t.n_bytes != t.n_elements // block * type_size:
            raise _refuse(path, f"tensor {t.name!r} ({qtype}) has rows of {row} values, not "
                          f"whole blocks of {block}")
        if t.data_offset + t.n_bytes > size:
            raise _refuse(path, f"the file is truncated: tensor {t.name!r} ends at byte "
                          f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
    return reader


def _string_field(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (``None`` for one lmkit does not use)."""
    if gguf_name in _IGNORED:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{kind}"
    mapped = _GLOBAL_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{kind}"


def forward_order(gguf_name: str) -> tuple[int, int]:
    """Sort key putting a file's tensors in the order a decode step reads them (layer by
    layer: attention, then MLP; the final norm and LM head last; names it does not know
    after the others). The method packs quantized weights one after another as they are
    loaded, so a step then streams them in address order: each projection's prefetch
    runs on into the next one instead of into a weight already read."""
    base = gguf_name.rpartition(".")[0]
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        rank = _LAYER_ORDER.index(part) if part in _LAYER_ORDER else len(_LAYER_ORDER)
        return (int(layer) if layer.isdigit() else 1 << 30, rank)
    rank = _LAST_ORDER.index(base) if base in _LAST_ORDER else len(_LAST_ORDER)
    return (1 << 30, rank)


def q5_0_as_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """``Q5_0`` rows ``uint8 [n, blocks * 22]`` as ``Q8_0`` rows ``uint8 [n, blocks * 34]``
    holding the same weights exactly: a ``Q5_0`` block (fp16 ``d``, 32 high bits ``qh``,
    16 bytes of nibbles; weight ``j`` is ``d * ((nibble_j | bit_j << 4) - 16)``) becomes
    ``d`` and the 32 int8 values ``q5 - 16``. llama.cpp's ``Q4_K_M`` writes ``Q5_0`` for
    rows that are not whole super-blocks of 256; the ``Q8_0`` kernel then reads 34 bytes
    per block where the file has 22."""
    n = rows.shape[0]
    blk = rows.reshape(n, -1, 22)
    qh = blk[..., 2:6].contiguous().view(torch.int32)  # [n, nb, 1]
    bits = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [n, nb, 32]
    qs = blk[..., 6:22].to(torch.int32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    q = ((low | (bits << 4)) - 16).to(torch.int8).view(torch.uint8)
    return torch.cat([blk[..., 0:2], q], dim=-1).reshape(n, -1).contiguous()


def unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's query/key permutation (its converter interleaves
    the two rotary halves of each head; HF keeps them apart): ``hf = gguf[index]``."""
    half = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def iterate_tensors(reader: Any, num_heads: int, num_kv_heads: int
                    ) -> Iterator[tuple[str, Any]]:
    """``(hf_name, tensor)`` per tensor in :func:`forward_order`: quantized as
    :class:`QuantizedTensor` (``uint8 [out, row_bytes]``), the others float32, q/k rows
    put in HF order (the model's query and key/value head counts, from its ModelFacts)."""
    from gguf import GGMLQuantizationType

    heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
    for t in sorted(reader.tensors, key=lambda t: forward_order(t.name)):  # stable
        name = hf_name(t.name)
        if name is None:
            continue
        qtype = GGMLQuantizationType(t.tensor_type).name
        data = torch.from_numpy(np.array(t.data))  # a copy: the file is not kept mapped
        if qtype in DENSE:
            data = data.float()
        else:
            data = data.reshape(-1, data.shape[-1])
        for module, num_heads in heads.items():
            if f".{module}." in name and data.dim() >= 1:
                data = data[unpermute_rows(data.shape[0], num_heads)]
        if qtype in QUANTIZED:
            out, k = int(np.prod(t.shape[1:])), int(t.shape[0])
            if qtype == "Q5_0":
                data = q5_0_as_q8_0(data)
            yield name, QuantizedTensor(data.contiguous(), HELD_AS.get(qtype, qtype), (out, k))
        else:
            yield name, data.contiguous()

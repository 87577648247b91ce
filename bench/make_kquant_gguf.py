"""Write a Q4_K_M-style copy of a Llama GGUF that lmkit's ``gguf`` method reads (issue 23).

llama.cpp's own ``Q4_K_M`` of a model whose rows are not whole super-blocks of 256
(SmolLM2-135M: hidden size 576) falls back to ``Q5_0``/``Q8_0`` for those tensors, which
the ``gguf`` method does not read. This copy follows llama.cpp's Q4_K_M choice where
the rows allow it (``Q6_K`` for the LM head / tied embedding, and for ``attn_v`` and
``ffn_down`` in the layers its ``use_more_bits`` picks; ``Q4_K`` for the rest) and
otherwise keeps the source tensor as it is (``Q6_K`` fallbacks become ``Q8_0``). The
k-quant blocks come from :func:`lmkit_kernels.cpu.kquants.quantize_k` (round to nearest,
from the source's dequantized weights); metadata and tokenizer are copied. llama.cpp
and lmkit then run the same file::

    python bench/make_kquant_gguf.py SRC.gguf OUT.gguf
"""

from __future__ import annotations

import argparse
import collections
import re

import numpy as np


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose ``attn_v``/``ffn_down`` get ``Q6_K``."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def target_type(name: str, layers: int, tied: bool) -> str:
    """The Q4_K_M type of tensor ``name`` (before the row-size fallback)."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    m = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight$", name)
    if m and use_more_bits(int(m.group(1)), layers):
        return "Q6_K"
    return "Q4_K"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    args = ap.parse_args()
    import gguf
    import torch
    from gguf.quants import dequantize, quantize
    from lmkit_kernels.cpu.kquants import KQTYPES, QK_K, quantize_k

    reader = gguf.GGUFReader(args.src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(args.out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    names = {t.name for t in reader.tensors}
    layers = 1 + max(int(n.split(".")[1]) for n in names if n.startswith("blk."))
    tied = "output.weight" not in names
    counts: collections.Counter[str] = collections.Counter()
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        data, out_type = np.array(t.data), qtype
        if len(t.shape) == 2 and qtype.name not in ("F32", "F16"):
            want = target_type(t.name, layers, tied)
            dense = dequantize(data, qtype)  # [rows, k] float32
            if dense.shape[1] % QK_K == 0:
                data = quantize_k(KQTYPES[want], torch.from_numpy(dense)).numpy()
                out_type = gguf.GGMLQuantizationType[want]
            elif want == "Q6_K" and qtype.name != "Q8_0":
                data = quantize(dense, gguf.GGMLQuantizationType.Q8_0)
                out_type = gguf.GGMLQuantizationType.Q8_0
        counts[out_type.name] += 1
        writer.add_tensor(t.name, data, raw_dtype=None if out_type.name == "F32" else out_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}: {dict(counts)}")


if __name__ == "__main__":
    main()

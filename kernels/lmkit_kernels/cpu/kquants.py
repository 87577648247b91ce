"""GGUF k-quant super-blocks (``Q4_K``, ``Q6_K``: 256 weights each) in torch: the
reference dequantization (the layouts of ``qgemv_k.c``, ggml's ``dequantize_row_q*_K``),
random well-formed blocks, and a simple round-to-nearest quantizer.

The C kernels (:mod:`lmkit_kernels.cpu.qgemv`) self-check against
:func:`reference_dequantize_k`; tests compare it with the ``gguf`` package's own
dequantization. :func:`quantize_k` writes valid blocks from float weights (per
sub-block scale and min chosen from the range, then rounded): far simpler than
llama.cpp's search for the best scales, so its error is somewhat larger, but any
reader of the format reads its blocks the same way.
"""

from __future__ import annotations

import torch

__all__ = ["KQTYPES", "QK_K", "quantize_k", "random_kblocks", "reference_dequantize_k"]

QK_K = 256  # weights per super-block
KQTYPES = {"Q4_K": 12, "Q6_K": 14}  # name -> ggml type number
KBLOCK_BYTES = {12: 144, 14: 210}  # ggml type number -> bytes per super-block


def _fp16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()  # [..., 2] uint8 -> [..., 1]


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 [..., 12]`` -> 6-bit scales and mins ``[..., 8]`` (ggml's get_scale_min_k4)."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 0x0F) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def reference_dequantize_k(qtype: int, weight: torch.Tensor, k: int) -> torch.Tensor:
    """``uint8 [n, k / 256 * block_bytes]`` of ggml type ``qtype`` -> float32 ``[n, k]``."""
    n = weight.shape[0]
    blk = weight.reshape(n, k // QK_K, KBLOCK_BYTES[qtype])
    if qtype == KQTYPES["Q4_K"]:
        d, dmin = _fp16(blk[..., 0:2]), _fp16(blk[..., 2:4])  # [n, nb, 1]
        sc, mn = _q4k_scales(blk[..., 4:16])  # [n, nb, 8]
        qs = blk[..., 16:].reshape(n, -1, 4, 1, 32).to(torch.int32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, -1, 8, 32).float()
        w = (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)
        return w.reshape(n, k)
    ql = blk[..., 0:128].reshape(n, -1, 2, 1, 64).to(torch.int32)
    qh = blk[..., 128:192].reshape(n, -1, 2, 1, 32).to(torch.int32)
    sc = blk[..., 192:208].contiguous().view(torch.int8).float()  # [n, nb, 16]
    d = _fp16(blk[..., 208:210])
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, -1, 2, 4, 32)  # [.., h, t, l]
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3)  # [n, nb, 2, 4, 32]
    q = ((low | (high << 4)) - 32).reshape(n, -1, 16, 16).float()
    return ((d * sc).unsqueeze(-1) * q).reshape(n, k)


def random_kblocks(qtype: int, n: int, k: int, generator: torch.Generator,
                   scale: float = 0.01) -> torch.Tensor:
    """Random well-formed super-blocks ``uint8 [n, k/256 * bytes]``: every quant, scale
    and min byte random (the ends of the integer ranges included), fp16 scales of about
    ``scale`` (finite; pass a large or tiny one for extremes)."""
    nb, size = k // QK_K, KBLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (n, nb, size), dtype=torch.uint8, generator=generator)
    d = (torch.rand(n, nb, 2, generator=generator) * scale + scale / 10).half()
    if qtype == KQTYPES["Q4_K"]:
        raw[..., 0:4] = d.contiguous().view(torch.uint8)
    else:
        raw[..., 208:210] = d[..., 0:1].contiguous().view(torch.uint8)
    return raw.reshape(n, nb * size)


def _pack_q4k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """6-bit ``sc``, ``mn`` ``int32 [..., 8]`` -> ``uint8 [..., 12]`` (inverse of
    :func:`_q4k_scales`)."""
    lo_d = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    lo_m = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    md = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    return torch.cat([lo_d, lo_m, md], dim=-1).to(torch.uint8)


def quantize_k(qtype: int, w: torch.Tensor) -> torch.Tensor:
    """Float weights ``[n, k]`` (``k`` a multiple of 256) -> GGUF rows ``uint8 [n, k /
    256 * block_bytes]`` of ggml type ``qtype``, round to nearest (see the module
    docstring)."""
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"quantize_k: k={k} is not a multiple of {QK_K}")
    x = w.float().reshape(n, k // QK_K, -1)
    if qtype == KQTYPES["Q4_K"]:
        sub = x.reshape(n, -1, 8, 32)
        lo = sub.amin(-1).clamp(max=0)  # [n, nb, 8]: w = scale * q - min, q in 0..15
        scale = (sub.amax(-1) - lo) / 15
        d = (scale.amax(-1, keepdim=True) / 63).half().float()
        dmin = ((-lo).amax(-1, keepdim=True) / 63).half().float()
        sc = torch.where(d > 0, scale / d, 0).round().clamp(0, 63)
        mn = torch.where(dmin > 0, -lo / dmin, 0).round().clamp(0, 63)
        step = (d * sc).unsqueeze(-1)
        q = torch.where(step > 0, (sub + (dmin * mn).unsqueeze(-1)) / step, 0)
        q = q.round().clamp(0, 15).to(torch.int32).reshape(n, -1, 4, 2, 32)
        qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, -1, 128)
        out = torch.cat([d.half().view(torch.uint8).reshape(n, -1, 2),
                         dmin.half().view(torch.uint8).reshape(n, -1, 2),
                         _pack_q4k_scales(sc.to(torch.int32), mn.to(torch.int32)),
                         qs.to(torch.uint8)], dim=-1)
        return out.reshape(n, -1).contiguous()
    sub = x.reshape(n, -1, 16, 16)
    amax_idx = sub.abs().argmax(-1, keepdim=True)
    scale = -sub.gather(-1, amax_idx).squeeze(-1) / 32  # the largest maps to q = -32
    d = (scale.abs().amax(-1, keepdim=True) / 127).half().float()
    sc = torch.where(d > 0, scale / d, 0).round().clamp(-128, 127)
    step = (d * sc).unsqueeze(-1)
    q = torch.where(step != 0, sub / step, 0).round().clamp(-32, 31).to(torch.int32) + 32
    q = q.reshape(n, -1, 2, 4, 32)  # [.., h, t, l]
    ql = (q[:, :, :, 0:2] & 0x0F) | ((q[:, :, :, 2:4] & 0x0F) << 4)  # [.., h, 2, 32]
    qh = (q[:, :, :, 0] >> 4) & 3  # [.., h, 32]: bits 2t..2t+1 from weight row t
    for t in range(1, 4):
        qh = qh | (((q[:, :, :, t] >> 4) & 3) << (2 * t))
    out = torch.cat([ql.reshape(n, -1, 128).to(torch.uint8), qh.reshape(n, -1, 64).to(torch.uint8),
                     sc.to(torch.int8).view(torch.uint8), d.half().view(torch.uint8).reshape(n, -1, 2)],
                    dim=-1)
    return out.reshape(n, -1).contiguous()

"""The FlashAttention generations the ``flash_attn`` backend can run, and what each
accepts. Pure data and checks: importing this module imports neither torch nor any
FlashAttention library, so the plugin can register it and ``lmkit plugins list`` can
show which generation would run on this machine.

Preference: FlashAttention-4 (``flash_attn.cute``, the ``flash-attn-4`` wheel on top of
``nvidia-cutlass-dsl``; Hopper and Blackwell), then FlashAttention-3
(``flash_attn_interface``, a source build for Hopper), then FlashAttention-2 (the
``flash-attn`` 2.x package, whose compiled extension is ``flash_attn_2_cuda``; Ampere
and later). FA4 installs ``flash_attn`` as a namespace package, so FA2 is recognised
by its extension module, not by ``flash_attn``.

Paged K/V: all three read lmkit's cache halves ``kv_cache[0]`` / ``kv_cache[1]``
(``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous) with a per-request
page table. FA4 loads pages with TMA when a page holds exactly one key tile (128 rows
for head sizes up to 128 on Hopper), otherwise row by row (any page size, head sizes a
multiple of 16); FA3 takes any page size; FA2 needs pages of a multiple of 256 tokens.
"""

from __future__ import annotations

from lmkit.api import Variant

FA4 = Variant("fa4", requires=("flash_attn.cute",), compute_capability={9, 10},
              description="FlashAttention-4 (flash_attn.cute, CuTe DSL)")
FA3 = Variant("fa3", requires=("flash_attn_interface",), compute_capability={9},
              description="FlashAttention-3 (flash_attn_interface, Hopper)")
FA2 = Variant("fa2", requires=("flash_attn_2_cuda",), compute_capability={8, 9, 10, 11, 12},
              description="FlashAttention-2 (flash-attn 2.x)")
GENERATIONS = (FA4, FA3, FA2)
BY_NAME = {g.name: g for g in GENERATIONS}
DTYPES = ("float16", "bfloat16")
CLAIMED_HEAD_SIZES = (64, 80, 96, 128, 256)


def config_reasons(generation: str, *, head_size: int, block_size: int, dtype: str,
                   capability: tuple[int, int]) -> list[str]:
    """Why ``generation`` cannot run this configuration (empty when it can).

    :param dtype: the torch dtype's name without ``torch.`` (``"bfloat16"``)
    :param capability: the device's compute capability ``(major, minor)``
    """
    reasons = []
    if dtype not in DTYPES:
        reasons.append(f"dtype {dtype} (supports float16, bfloat16)")
    if generation == "fa4":
        if capability[0] == 10 and not (head_size <= 128 or head_size == 256):
            reasons.append(f"head size {head_size} on compute capability 10.x (supports up "
                           "to 128, and 256)")
        if not (16 <= head_size <= 256 and head_size % 16 == 0):
            reasons.append(f"head size {head_size} (paged K/V needs a multiple of 16 "
                           "from 16 to 256)")
    elif not (8 <= head_size <= 256 and head_size % 8 == 0):
        reasons.append(f"head size {head_size} (supports multiples of 8 up to 256)")
    if generation == "fa2" and block_size % 256:
        reasons.append(f"block size {block_size} (FlashAttention-2's paged K/V needs a "
                       "multiple of 256: --block-size 256)")
    return reasons


def choose_generation(requested: str, *, head_size: int, block_size: int, dtype: str,
                      capability: tuple[int, int]) -> str:
    """The generation to run: ``requested`` (``"auto"``: the first installed one that
    fits the device and this configuration).

    :raises ValueError: naming every generation considered and why it cannot run.
    """
    candidates = GENERATIONS if requested == "auto" else (BY_NAME[requested],)
    why: dict[str, list[str]] = {}
    for g in candidates:
        reasons = g.unavailable_reasons(capability) or config_reasons(
            g.name, head_size=head_size, block_size=block_size, dtype=dtype,
            capability=capability)
        if not reasons:
            return g.name
        why[g.name] = reasons
    asked = "any FlashAttention generation" if requested == "auto" else repr(requested)
    detail = "; ".join(f"{name}: {', '.join(r)}" for name, r in why.items())
    raise ValueError(
        f"flash_attn attention cannot run {asked} here (head size {head_size}, block size "
        f"{block_size}, {dtype}, compute capability {capability[0]}.{capability[1]}): "
        f"{detail}. Install flash-attn-4 (pip install 'lmkit[flash-attn]', see "
        "docs/gpu.md), change the setting named, or use --attn triton / flashinfer.")

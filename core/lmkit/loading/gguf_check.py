"""Checking a GGUF file before it is converted: its header and its metadata and tensor
tables (the ``gguf`` package's reader maps each tensor's data, which fails when the file
ends early), so that a truncated or corrupt file is one error naming the file before
transformers starts building a model from it."""

from __future__ import annotations

import struct
from pathlib import Path

from lmkit.errors import ModelLoadError

GGUF_VERSIONS = (2, 3)  # what the gguf package (and transformers through it) reads
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
# the fewest bytes one metadata entry / one tensor-table entry takes
MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES = 8 + 4, 8 + 4 + 8 + 4 + 8
CORRUPT = "the file is corrupt or truncated (e.g. an interrupted download)"
REFETCH = f"{CORRUPT}: fetch it again"


def check_gguf_file(path: Path) -> None:
    """Refuse a GGUF file whose header, tables or tensor data are unreadable.

    Reads the header and the tables (memory-mapped, with the ``gguf`` package when it is
    installed; transformers needs it to convert anyway); no tensor data is read.

    Raises:
        ModelLoadError: naming the file and what is wrong with it.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        raise ModelLoadError(f"{path} is {size} bytes, shorter than a GGUF header "
                             f"({HEADER_BYTES} bytes); {REFETCH}.")
    order = "<"
    (version,) = struct.unpack_from("<I", head, 4)
    if version & 0xFFFF == 0:  # a big-endian file
        order = ">"
        (version,) = struct.unpack_from(">I", head, 4)
    if version not in GGUF_VERSIONS:
        raise ModelLoadError(
            f"{path} says it is GGUF version {version}; versions "
            f"{' and '.join(map(str, GGUF_VERSIONS))} can be read. Either {CORRUPT}, or "
            "it was written by a newer llama.cpp than the installed gguf package reads.")
    num_tensors, num_kv = struct.unpack_from(f"{order}QQ", head, 8)
    if num_tensors * MIN_TENSOR_INFO_BYTES + num_kv * MIN_KV_BYTES > size - HEADER_BYTES:
        raise ModelLoadError(
            f"{path}'s header declares {num_tensors} tensors and {num_kv} metadata "
            f"entries, more than its {size:,} bytes can hold; {REFETCH}.")
    _check_tables(path, size)


def _check_tables(path: Path, size: int) -> None:
    try:
        from gguf import GGUFReader
    except ImportError:  # transformers says that gguf is needed
        return
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, ... on bad data
        raise ModelLoadError(
            f"cannot parse GGUF file {path} ({size:,} bytes): {type(e).__name__}: {e}. "
            f"Either {CORRUPT}, or it holds a tensor type the installed gguf package "
            "does not read (pip install -U gguf).") from e
    del reader  # its memory map of the file

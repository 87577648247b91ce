"""Block files of the disk tier: header checks, reads that refuse symlinks (file or
directory) and damaged or truncated files, atomic writes, and the startup scan."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
from lmkit_plugins.offload.disk_files import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    BadBlockFile,
    BlockDirectory,
    verify,
)

FP = hashlib.blake2b(b"fingerprint", digest_size=32).digest()
PAYLOAD = bytes(range(256)) * 16


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


@pytest.fixture
def files(tmp_path):
    d = BlockDirectory(tmp_path / "root", FP)
    yield d
    d.close()


def test_write_then_read_round_trips(files):
    files.write(h(1), memoryview(PAYLOAD))
    data = files.read(h(1), len(PAYLOAD))
    assert bytes(data[HEADER_SIZE:]) == PAYLOAD
    path = files.path_of(h(1))
    assert path.is_file() and path.parent.parent.parent.name == FP.hex()[:32]
    assert [p.name for p in path.parent.iterdir()] == [path.name], "temporary file left"


@pytest.mark.parametrize("field,value,reason", [
    (0, b"NOTLMKV\x00", "bad magic"),
    (1, 2, "format version"),
    (3, b"\x01" * 32, "another model"),
    (4, b"\x02" * 32, "another block"),
    (5, 4097, "payload length"),
    (6, b"\x03" * 32, "checksum"),
])
def test_verify_rejects_each_header_field(field, value, reason):
    good = bytearray(HEADER.pack(MAGIC, 1, HEADER_SIZE, FP, h(1), len(PAYLOAD),
                                 hashlib.blake2b(PAYLOAD, digest_size=32).digest()) + PAYLOAD)
    verify(memoryview(good), FP, h(1), len(PAYLOAD))
    fields = list(HEADER.unpack_from(good))
    fields[field] = value
    bad = HEADER.pack(*fields) + PAYLOAD
    with pytest.raises(BadBlockFile, match=reason):
        verify(memoryview(bad), FP, h(1), len(PAYLOAD))


def test_read_rejects_flipped_payload_bit(files):
    files.write(h(1), memoryview(PAYLOAD))
    path = files.path_of(h(1))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(BadBlockFile, match="checksum"):
        files.read(h(1), len(PAYLOAD))


@pytest.mark.parametrize("delta", [-1, 1])
def test_read_rejects_wrong_size(files, delta):
    files.write(h(1), memoryview(PAYLOAD))
    path = files.path_of(h(1))
    os.truncate(path, path.stat().st_size + delta)
    with pytest.raises(BadBlockFile, match="size"):
        files.read(h(1), len(PAYLOAD))


def test_read_refuses_symlinked_file(files, tmp_path):
    files.write(h(1), memoryview(PAYLOAD))
    path = files.path_of(h(1))
    outside = tmp_path / "outside.kv"
    outside.write_bytes(path.read_bytes())  # a perfectly valid file, outside the root
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(OSError):
        files.read(h(1), len(PAYLOAD))
    files.unlink(h(1))  # removes the link, not its target
    assert outside.is_file() and not path.is_symlink()


def test_read_refuses_symlinked_directory(files, tmp_path):
    files.write(h(1), memoryview(PAYLOAD))
    leaf = files.path_of(h(1)).parent
    outside = tmp_path / "elsewhere"
    leaf.rename(outside)
    leaf.symlink_to(outside)
    with pytest.raises(OSError):
        files.read(h(1), len(PAYLOAD))
    with pytest.raises(OSError):
        files.write(h(1), memoryview(PAYLOAD))


def test_scan_finds_good_files_and_cleans_up(files):
    for i in range(3):
        files.write(h(i), memoryview(PAYLOAD))
    file_bytes = HEADER_SIZE + len(PAYLOAD)
    os.truncate(files.path_of(h(2)), 10)  # wrong size: removed
    leaf = files.path_of(h(0)).parent
    stale = leaf / "x.kv.1.2.tmp"
    stale.write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    fresh = leaf / "y.kv.1.3.tmp"  # may be another engine's write in progress: kept
    fresh.write_bytes(b"partial")
    link = files.path_of(h(5))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(files.path_of(h(1)))  # never indexed
    found = {bh for bh, _ in files.scan(file_bytes)}
    assert found == {h(0), h(1)}
    assert not files.path_of(h(2)).exists() and not stale.exists() and fresh.exists()


def test_unlink_of_missing_file_is_quiet(files):
    files.unlink(h(42))

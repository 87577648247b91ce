"""Block files of the disk tier: header checks, keyed MACs (forged files refused),
reads that refuse symlinks (file or directory), FIFOs without blocking, and damaged
or truncated files, atomic writes that clean up residue at a block's path, and the
startup scan."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
from lmkit_plugins.offload.disk_files import (
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    MAC_COVERS,
    BadBlockFile,
    BlockDirectory,
    encode_header,
    verify,
)

FP = hashlib.blake2b(b"fingerprint", digest_size=32).digest()
KEY = hashlib.blake2b(b"deployment key", digest_size=32).digest()
PAYLOAD = bytes(range(256)) * 16


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


@pytest.fixture
def files(tmp_path):
    d = BlockDirectory(tmp_path / "root", FP, KEY)
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
    (1, 1, "format version"),
    (3, b"\x01" * 32, "another model"),
    (4, b"\x02" * 32, "another block"),
    (5, 4097, "payload length"),
    (6, b"\x03" * 32, "MAC mismatch"),
    (7, b"\x04" * 8, "another key"),
])
def test_verify_rejects_each_header_field(field, value, reason):
    good = encode_header(KEY, FP, h(1), memoryview(PAYLOAD)) + PAYLOAD
    verify(memoryview(good), KEY, FP, h(1), len(PAYLOAD))
    fields = list(HEADER.unpack_from(good))
    fields[field] = value
    bad = HEADER.pack(*fields) + PAYLOAD
    with pytest.raises(BadBlockFile, match=reason):
        verify(memoryview(bad), KEY, FP, h(1), len(PAYLOAD))


def forge(path, payload: bytes) -> None:
    """Replace ``path``'s payload and fix its header up as a forger without the key
    would: a valid layout, and an unkeyed BLAKE2b-256 of header and payload."""
    header = bytearray(path.read_bytes()[:HEADER_SIZE])
    header[MAC_COVERS:MAC_COVERS + 32] = hashlib.blake2b(
        bytes(header[:MAC_COVERS]) + payload, digest_size=32).digest()
    path.write_bytes(bytes(header) + payload)


def test_forged_file_is_refused(files):
    files.write(h(1), memoryview(PAYLOAD))
    forge(files.path_of(h(1)), bytes(len(PAYLOAD)))
    with pytest.raises(BadBlockFile, match="MAC mismatch"):
        files.read(h(1), len(PAYLOAD))


def test_file_written_with_another_key_is_refused(files, tmp_path):
    other = BlockDirectory(tmp_path / "root", FP, bytes(32))
    try:
        other.write(h(1), memoryview(PAYLOAD))
        assert other.read(h(1), len(PAYLOAD))[HEADER_SIZE:] == PAYLOAD
        with pytest.raises(BadBlockFile, match="another key"):
            files.read(h(1), len(PAYLOAD))
        path = files.path_of(h(1))
        assert HEADER.unpack_from(path.read_bytes())[1] == FORMAT_VERSION
        # a forger copying this deployment's key id into the header still fails the MAC
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE - 8:HEADER_SIZE] = files.key_id
        path.write_bytes(bytes(data))
        with pytest.raises(BadBlockFile, match="MAC mismatch"):
            files.read(h(1), len(PAYLOAD))
    finally:
        other.close()


def test_scan_skips_files_of_another_key_and_removes_old_ones(files, tmp_path):
    files.write(h(1), memoryview(PAYLOAD))
    other = BlockDirectory(tmp_path / "root", FP, bytes(32))  # another process's key
    try:
        other.write(h(2), memoryview(PAYLOAD))  # maybe a running engine's: left alone
        other.write(h(3), memoryview(PAYLOAD))  # unused for hours: an earlier process's
    finally:
        other.close()
    old = time.time() - 7200
    os.utime(files.path_of(h(3)), (old, old))
    found = {bh for bh, _ in files.scan(HEADER_SIZE + len(PAYLOAD))}
    assert found == {h(1)}
    assert files.path_of(h(2)).is_file() and not files.path_of(h(3)).exists()


def test_read_rejects_flipped_payload_bit(files):
    files.write(h(1), memoryview(PAYLOAD))
    path = files.path_of(h(1))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(BadBlockFile, match="MAC mismatch"):
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


def test_read_refuses_symlinked_directory_and_write_replaces_it(files, tmp_path):
    files.write(h(1), memoryview(PAYLOAD))
    leaf = files.path_of(h(1)).parent
    outside = tmp_path / "elsewhere"
    leaf.rename(outside)
    leaf.symlink_to(outside)
    before = sorted((p.name, p.read_bytes()) for p in outside.iterdir())
    with pytest.raises(OSError):
        files.read(h(1), len(PAYLOAD))
    files.write(h(1), memoryview(PAYLOAD))  # the link is residue: replaced by a directory
    assert leaf.is_dir() and not leaf.is_symlink()
    assert bytes(files.read(h(1), len(PAYLOAD))[HEADER_SIZE:]) == PAYLOAD
    assert sorted((p.name, p.read_bytes()) for p in outside.iterdir()) == before


def test_write_replaces_directory_at_block_path(files):
    path = files.path_of(h(1))
    (path / "sub").mkdir(parents=True)
    (path / "sub" / "junk").write_bytes(b"x")
    files.write(h(1), memoryview(PAYLOAD))
    assert path.is_file()
    assert bytes(files.read(h(1), len(PAYLOAD))[HEADER_SIZE:]) == PAYLOAD


def test_write_replaces_symlink_at_block_path_without_following_it(files, tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"do not touch")
    path = files.path_of(h(1))
    path.parent.mkdir(parents=True)
    path.symlink_to(target)
    files.write(h(1), memoryview(PAYLOAD))
    assert path.is_file() and not path.is_symlink()
    assert target.read_bytes() == b"do not touch"
    assert bytes(files.read(h(1), len(PAYLOAD))[HEADER_SIZE:]) == PAYLOAD


def test_write_replaces_file_where_a_directory_belongs(files, tmp_path):
    mid = files.path_of(h(1)).parent.parent
    mid.write_bytes(b"junk")
    files.write(h(1), memoryview(PAYLOAD))
    assert mid.is_dir()
    assert bytes(files.read(h(1), len(PAYLOAD))[HEADER_SIZE:]) == PAYLOAD


def test_unlink_removes_directory_residue(files, tmp_path):
    path = files.path_of(h(1))
    (path / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    (path / "sub" / "link").symlink_to(outside)  # rmtree must not follow it
    files.unlink(h(1))
    assert not path.exists() and (outside / "keep").read_bytes() == b"k"


def run_bounded(fn, timeout_s: float = 10.0):
    """``fn()`` in a daemon thread; fails the test if it has not returned in time."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"blocked for over {timeout_s} s"
    return result


@pytest.mark.parametrize("where", ["file", "directory"])
def test_fifo_at_block_path_is_refused_without_blocking(files, where):
    files.write(h(1), memoryview(PAYLOAD))
    path = files.path_of(h(1))
    if where == "file":
        path.unlink()
        os.mkfifo(path)
    else:  # the leaf directory itself
        for p in path.parent.iterdir():
            p.unlink()
        path.parent.rmdir()
        os.mkfifo(path.parent)
    result = run_bounded(lambda: files.read(h(1), len(PAYLOAD)))
    error = result.get("error")
    assert isinstance(error, BadBlockFile if where == "file" else OSError), result
    if where == "file":
        assert "not a regular file" in str(error)
    files.unlink(h(1))
    files.write(h(1), memoryview(PAYLOAD))  # the FIFO is residue: replaced
    assert bytes(files.read(h(1), len(PAYLOAD))[HEADER_SIZE:]) == PAYLOAD


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

"""Block files of the ``disk`` tier: their format, and opening them safely.

Layout: ``<root>/<model+layout id>/<h[0:2]>/<h[2:4]>/<block hash hex>.kv``, where the
id is the first 32 hex digits of the fingerprint (:func:`lmkit.api.offload.kv_cache_fingerprint`).
A file is a 128-byte header, then the payload (one host block, ``[layers, parts, E]``)::

    magic "LMKVBLK\\0" | format version u32 | header size u32 | fingerprint 32 B |
    block hash 32 B | payload length u64 | MAC 32 B | key id 8 B

The MAC is keyed BLAKE2b-256 over the header's first 88 bytes and the payload, with a
key that is not stored in the folder (:mod:`lmkit_plugins.offload.disk_key`): whoever
can write the folder but lacks the key cannot make a file that verifies. The key id (a
one-way hash of the key) lets the startup scan drop files written with another key
(e.g. an earlier process's random key) without reading their payloads.

Files are written to a temporary name, fsynced, then renamed over the final name, so
a reader sees a whole file or none. Every directory below the root and every file is
opened relative to its parent's descriptor with ``O_NOFOLLOW`` (and ``O_NONBLOCK``, so
that a FIFO or device never blocks the open): a symlink anywhere inside the root fails
the open instead of leading outside. A read succeeds only when the file is a regular
file of exactly the expected size whose header names this format, this fingerprint
and this block hash, and whose MAC verifies. A write finding a directory, symlink or
other non-directory in the way of its path removes it (a link itself, never its
target) instead of failing every later write there.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import shutil
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"LMKVBLK\x00"
FORMAT_VERSION = 2  # 2: the checksum became a keyed MAC
HEADER = struct.Struct("<8sII32s32sQ32s8s")
HEADER_SIZE = HEADER.size  # 128
MAC_COVERS = struct.calcsize("<8sII32s32sQ")  # 88: the header bytes before the MAC
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600.0  # temporary files older than this are leftovers of a crash
# files of another key unused for this long are an earlier process's, not a running one's
STALE_OTHER_KEY_S = 3600.0

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
# a FIFO opened for reading without O_NONBLOCK waits for a writer: forever
_READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC


class BadBlockFile(Exception):
    """A block file that must not be used (the message says why)."""


class OtherKeyFile(BadBlockFile):
    """A block file whose header names another key."""


def block_mac(key: bytes, covered: memoryview | bytes, payload: memoryview | bytes) -> bytes:
    """Keyed BLAKE2b-256 of the header's first :data:`MAC_COVERS` bytes (``covered``)
    and ``payload``."""
    mac = hashlib.blake2b(key=key, digest_size=32)
    mac.update(covered)
    mac.update(payload)
    return mac.digest()


def key_id(key: bytes) -> bytes:
    """The 8-byte id of MAC key ``key`` written in headers (reveals nothing of the key)."""
    return hashlib.blake2b(key, digest_size=8, person=b"lmkit-kv-key-id").digest()


def encode_header(key: bytes, fingerprint: bytes, block_hash: bytes, payload: memoryview
                  ) -> bytes:
    """The header of a file holding ``payload`` for ``block_hash``, MAC'd with ``key``."""
    header = bytearray(HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, fingerprint,
                                   block_hash, payload.nbytes, bytes(32), key_id(key)))
    header[MAC_COVERS:MAC_COVERS + 32] = block_mac(key, header[:MAC_COVERS], payload)
    return bytes(header)


def verify(data: memoryview, key: bytes, fingerprint: bytes, block_hash: bytes,
           payload_bytes: int) -> None:
    """Raise :class:`BadBlockFile` unless ``data`` (a whole file) is this block's,
    written with ``key``."""
    if data.nbytes != HEADER_SIZE + payload_bytes:
        raise BadBlockFile(f"size {data.nbytes}, expected {HEADER_SIZE + payload_bytes}")
    digest = check_header(data[:HEADER_SIZE], key_id(key), fingerprint, block_hash,
                          payload_bytes)
    if not hmac.compare_digest(block_mac(key, data[:MAC_COVERS], data[HEADER_SIZE:]), digest):
        raise BadBlockFile("MAC mismatch: forged, damaged, or written with another key")


def check_header(header: memoryview | bytes, kid: bytes, fingerprint: bytes,
                 block_hash: bytes, payload_bytes: int) -> bytes:
    """The MAC of ``header`` if its fields name this format, key id, fingerprint, block
    and payload length; raises :class:`BadBlockFile` otherwise."""
    magic, version, header_size, fp, h, length, digest, file_kid = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise BadBlockFile("not an lmkit KV block file (bad magic)")
    if version != FORMAT_VERSION or header_size != HEADER_SIZE:
        raise BadBlockFile(f"format version {version}, expected {FORMAT_VERSION}")
    if fp != fingerprint:
        raise BadBlockFile("written for another model or KV layout")
    if h != block_hash:
        raise BadBlockFile("holds another block")
    if length != payload_bytes:
        raise BadBlockFile(f"payload length {length}, expected {payload_bytes}")
    if file_kid != kid:
        raise OtherKeyFile("written with another key (offload.options.key_file or "
                           "LMKIT_OFFLOAD_KEY differ, or none was set)")
    return digest


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


class BlockDirectory:
    """The block files of one fingerprint under ``root``, authenticated with ``key``
    (32 bytes, see :mod:`lmkit_plugins.offload.disk_key`).

    Safe to use from several threads (each call opens its own descriptors).
    """

    def __init__(self, root: Path, fingerprint: bytes, key: bytes) -> None:
        if not (_O_NOFOLLOW and _O_DIRECTORY) or os.open not in os.supports_dir_fd:
            raise OSError("the disk offload tier needs O_NOFOLLOW and directory descriptors "
                          "(Linux, macOS)")
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.fingerprint = fingerprint
        self.key = key
        self.key_id = key_id(key)
        self.name = fingerprint.hex()[:32]
        root_fd = os.open(root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        try:
            self.dir_fd = self._subdir(root_fd, self.name, create=True)
        finally:
            os.close(root_fd)

    @staticmethod
    def _subdir(parent_fd: int, name: str, create: bool) -> int:
        """Open directory ``name`` (never through a symlink). With ``create``, make it,
        replacing a symlink or file found in its place (residue: the link is removed,
        its target untouched)."""
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                pass
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as e:
            if not create or e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
        os.unlink(name, dir_fd=parent_fd)  # not a directory (checked by the open above)
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)

    def _open_parent(self, block_hash: bytes, create: bool) -> int:
        """The descriptor of ``block_hash``'s directory (raises if it is a symlink)."""
        hexh = block_hash.hex()
        fd1 = self._subdir(self.dir_fd, hexh[:2], create)
        try:
            return self._subdir(fd1, hexh[2:4], create)
        finally:
            os.close(fd1)

    def path_of(self, block_hash: bytes) -> Path:
        """Where ``block_hash``'s file lives (for messages and tests)."""
        hexh = block_hash.hex()
        return self.root / self.name / hexh[:2] / hexh[2:4] / f"{hexh}{SUFFIX}"

    def write(self, block_hash: bytes, payload: memoryview) -> None:
        """Write ``payload`` as ``block_hash``'s file (temporary name, fsync, rename)."""
        header = encode_header(self.key, self.fingerprint, block_hash, payload)
        name = block_hash.hex() + SUFFIX
        tmp = f"{name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        parent = self._open_parent(block_hash, create=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                         0o600, dir_fd=parent)
            try:
                try:
                    _write_all(fd, header)
                    _write_all(fd, payload)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                _rename_over(tmp, name, parent)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=parent)
                except OSError:
                    pass
                raise
        finally:
            os.close(parent)

    def read(self, block_hash: bytes, payload_bytes: int) -> bytearray:
        """The verified file of ``block_hash`` (header included).

        Raises:
            BadBlockFile: damaged, truncated, foreign, forged, or not a regular file
                (a FIFO or device is refused without blocking).
            OSError: missing, or reached through a symlink.
        """
        parent = self._open_parent(block_hash, create=False)
        try:
            fd = os.open(block_hash.hex() + SUFFIX, _READ_FLAGS, dir_fd=parent)
        finally:
            os.close(parent)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadBlockFile("not a regular file")
            expected = HEADER_SIZE + payload_bytes
            if st.st_size != expected:
                raise BadBlockFile(f"size {st.st_size}, expected {expected}")
            data = bytearray(expected)
            view = memoryview(data)
            got = 0
            while got < expected:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise BadBlockFile(f"short read: {got} of {expected} bytes")
                got += n
            verify(view, self.key, self.fingerprint, block_hash, payload_bytes)
            os.utime(fd)  # recently used: kept longer after a restart
            return data
        finally:
            os.close(fd)

    def unlink(self, block_hash: bytes) -> None:
        """Remove whatever is at ``block_hash``'s path: its file, or residue in its place
        (a symlink is removed, not followed; a directory with its contents). Missing
        files are fine."""
        try:
            parent = self._open_parent(block_hash, create=False)
        except OSError:
            return
        try:
            _remove_entry(block_hash.hex() + SUFFIX, parent)
        except OSError:
            pass
        finally:
            os.close(parent)

    def scan(self, file_bytes: int) -> Iterator[tuple[bytes, int]]:
        """``(block hash, mtime_ns)`` of every well-formed file a previous run left
        with this key.

        Skips symlinks and other non-regular files; removes stale temporary files, files
        of the wrong size or whose header is not this format's or this block's, and
        files of another key unused for :data:`STALE_OTHER_KEY_S` (newer ones may be a
        running engine's, and are skipped). Payloads are not read: a load verifies the
        MAC."""
        now = time.time()
        for sub1 in _subdirs(self.dir_fd):
            fd1 = self._subdir(self.dir_fd, sub1, create=False)
            try:
                for sub2 in _subdirs(fd1):
                    fd2 = self._subdir(fd1, sub2, create=False)
                    try:
                        yield from self._scan_leaf(fd2, file_bytes, now)
                    finally:
                        os.close(fd2)
            finally:
                os.close(fd1)

    def _scan_leaf(self, fd: int, file_bytes: int, now: float) -> Iterator[tuple[bytes, int]]:
        with os.scandir(fd) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                if entry.name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        _unlink_quietly(entry.name, fd)
                    continue
                stem = entry.name.removesuffix(SUFFIX)
                if not entry.name.endswith(SUFFIX) or len(stem) != 64 or not _is_hex(stem):
                    continue
                block_hash = bytes.fromhex(stem)
                try:
                    if st.st_size != file_bytes:
                        raise BadBlockFile("wrong size")
                    self._check_file_header(entry.name, fd, block_hash, file_bytes - HEADER_SIZE)
                except OtherKeyFile:
                    if now - st.st_mtime > STALE_OTHER_KEY_S:
                        _unlink_quietly(entry.name, fd)
                    continue
                except (OSError, BadBlockFile):
                    _unlink_quietly(entry.name, fd)
                    continue
                yield block_hash, st.st_mtime_ns

    def _check_file_header(self, name: str, dir_fd: int, block_hash: bytes,
                           payload_bytes: int) -> None:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BadBlockFile("not a regular file")
            header = os.pread(fd, HEADER_SIZE, 0)
            if len(header) != HEADER_SIZE:
                raise BadBlockFile("short header")
            check_header(header, self.key_id, self.fingerprint, block_hash, payload_bytes)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the directory descriptor. Safe to call twice."""
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


def _subdirs(fd: int) -> list[str]:
    with os.scandir(fd) as entries:
        return [e.name for e in entries
                if len(e.name) == 2 and _is_hex(e.name) and e.is_dir(follow_symlinks=False)]


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


def _remove_entry(name: str, dir_fd: int) -> bool:
    """Remove ``name`` in ``dir_fd``: a directory with its contents (never following a
    symlink inside it), anything else with unlink. False if there was nothing."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        if not shutil.rmtree.avoids_symlink_attacks:  # (it is, where dir_fd works)
            raise IsADirectoryError(errno.EISDIR, "cannot remove a directory safely here", name)
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)
    return True


def _rename_over(tmp: str, name: str, dir_fd: int) -> None:
    """Rename ``tmp`` to ``name`` in ``dir_fd``; a directory in the way is residue,
    removed first (a symlink or file is replaced by the rename itself)."""
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            raise e from None
        if not stat.S_ISDIR(st.st_mode):
            raise
        _remove_entry(name, dir_fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass

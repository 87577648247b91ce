"""The key that authenticates the ``disk`` tier's block files.

Whoever can write the offload folder could otherwise plant block files that change
the engine's outputs, so every file carries a keyed BLAKE2b MAC
(:func:`lmkit_plugins.offload.disk_files.block_mac`), and the key is never stored in
the folder. It comes from, in order:

1. ``offload.options.key_file``: a regular file readable by its owner only (mode
   0600 or 0400), outside the offload folder;
2. the ``LMKIT_OFFLOAD_KEY`` environment variable;
3. else a random key made once per process: files an earlier process wrote cannot
   verify, so they are never used (the startup scan skips them, by the key id in their
   header, and removes those unused for an hour).

The secret (at least 16 bytes) is hashed into the 32-byte MAC key, so any text works.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lmkit.api import ConfigError

KEY_ENV = "LMKIT_OFFLOAD_KEY"
MIN_SECRET_BYTES = 16
_PERSON = b"lmkit-kv-mac-v1"  # domain separation of the derived key (at most 16 bytes)
_MAKE_KEY = "python -c 'import secrets; print(secrets.token_hex(32))'"


@dataclass(frozen=True)
class BlockKey:
    """The MAC key of block files, and where it came from (for the startup log)."""

    key: bytes = field(repr=False)  # 32 bytes; never printed
    source: str
    persistent: bool  # False: a per-process key, earlier processes' files are misses


def derive_key(secret: bytes) -> bytes:
    """The 32-byte MAC key of ``secret``."""
    return hashlib.blake2b(secret, digest_size=32, person=_PERSON).digest()


@functools.cache
def process_secret() -> bytes:
    """A random secret made once per process (the key when none is configured)."""
    return secrets.token_bytes(32)


def resolve_key(key_file: str | None, root: Path,
                env: Mapping[str, str] | None = None) -> BlockKey:
    """The block key of a tier whose folder is ``root`` (see the module docstring).

    Raises:
        ConfigError: the key file is missing, not a regular file, readable by others,
            inside ``root``, or too short; or ``LMKIT_OFFLOAD_KEY`` is too short.
    """
    env = os.environ if env is None else env
    if key_file:
        path = Path(key_file).expanduser()
        return BlockKey(derive_key(read_key_file(path, root)), f"key file {path}", True)
    if KEY_ENV in env:
        secret = env[KEY_ENV].strip().encode()
        check_secret(secret, f"environment variable {KEY_ENV}")
        return BlockKey(derive_key(secret), f"environment variable {KEY_ENV}", True)
    return BlockKey(derive_key(process_secret()), "a random per-process key", False)


def read_key_file(path: Path, root: Path) -> bytes:
    """The secret in ``path``, checked: a regular file, owner-only, outside ``root``."""
    where = f"offload.options.key_file {str(path)!r}"
    try:
        st = os.stat(path)  # (a symlink is fine: secret mounts are links)
    except OSError as e:
        raise ConfigError(f"{where} cannot be read ({e.strerror}); create it with "
                          f"`{_MAKE_KEY} > {path}; chmod 600 {path}`, or unset key_file") from e
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where} is not a regular file; point key_file at a file holding "
                          "the key")
    if st.st_mode & 0o077:
        raise ConfigError(f"{where} has mode {stat.S_IMODE(st.st_mode):04o}, so other users "
                          f"can read or change the key; run `chmod 600 {path}`")
    if path.resolve().is_relative_to(root.expanduser().resolve()):
        raise ConfigError(f"{where} lies inside the offload folder {str(root)!r}, so whoever "
                          "can write the blocks can read the key; move it elsewhere")
    secret = path.read_bytes().strip()
    check_secret(secret, where)
    return secret


def check_secret(secret: bytes, where: str) -> None:
    """Raise :class:`ConfigError` unless ``secret`` is long enough to be a key."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the offload key from {where} has {len(secret)} bytes; use at "
                          f"least {MIN_SECRET_BYTES} random bytes, e.g. `{_MAKE_KEY}`")

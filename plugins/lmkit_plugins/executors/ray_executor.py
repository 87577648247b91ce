"""The ``ray`` executor: the ``mp`` executor's ranks as Ray actors in a placement group,
for deployments over several hosts.

``start`` joins the Ray cluster named by ``RAY_ADDRESS`` (``ray start --head`` on one
host, ``ray start --address=HEAD:6379`` on the others), or starts a local one (shut
down again by :meth:`shutdown`). One bundle per rank (``{"GPU": 1}`` on CUDA, ``{"CPU":
1}`` on the CPU), packed onto as few hosts as possible; rank 0's host and a free port
on it are the ``torch.distributed`` rendezvous (NCCL on CUDA, gloo on the CPU).

Each command is encoded once with msgspec (the messages of
:mod:`~lmkit_plugins.executors.mp_messages`) and passed to every actor as ``bytes``;
actors answer with encoded replies. Health: the executor waits on the actor calls
:data:`POLL_S` at a time; an actor that died (its call raises ``RayActorError``) or
that reports a failure makes the call raise :class:`WorkerFailedError`, and every
actor is killed; so does a step with no answer within ``execute_timeout_s``
(:class:`~lmkit_plugins.executors.failure.WorkerOptions`: a hung actor). While the
engine is idle, :meth:`RayExecutor.check_health` polls a cheap liveness call per actor
without waiting, so an actor that dies between requests is reported within a check or
two (the engine checks about once a second).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from lmkit.api import (
    Executor,
    LMKitConfig,
    ModelFacts,
    ModelInfo,
    ModelRunnerOutput,
    PluginHost,
    ResolvedStack,
    SchedulerOutput,
    across_ranks,
    runner_output_from_wire,
    scheduler_output_to_wire,
)

from lmkit_plugins.executors.failure import WorkerFailedError, execute_timeout
from lmkit_plugins.executors.mp import worker_facts
from lmkit_plugins.executors.mp_messages import (
    CloseOffload,
    Execute,
    Executed,
    Failed,
    InitKVCache,
    OffloadLookup,
    OffloadStats,
    Started,
    Stop,
    executor_decoder,
)

POLL_S = 0.1
DEATH_GRACE_S = 0.5  # after a rank fails, how long to look for a peer whose death caused it
STOP_TIMEOUT_S = 5.0


class RayExecutor(Executor):
    """``parallel.tensor_parallel_size`` Ray actors, one per rank.

    Args: as every executor (see :class:`~lmkit.api.Executor`); ``options``: a
    :class:`~lmkit_plugins.executors.failure.WorkerOptions` (``None``: the defaults).
    Like the ``mp`` executor's workers, each actor uses ``facts`` and resolves the stack
    by name.
    """

    def __init__(self, config: LMKitConfig, stack: ResolvedStack, *, options: Any = None,
                 host: PluginHost | None = None, facts: ModelFacts | None = None) -> None:
        self.config = config
        self.stack = stack
        self.options = options
        self.host = host
        self.facts = facts
        self.world_size = config.parallel.tensor_parallel_size
        self.actors: list[Any] = []
        self._placement: Any = None
        self._owns_ray = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = executor_decoder()
        self._seq = 0
        self._failed: str | None = None
        self._pings: dict[int, Any] = {}  # rank -> its liveness call in flight (check_health)
        self.execute_timeout_s = execute_timeout(options)

    def start(self) -> ModelInfo:
        """Join or start Ray, place one actor per rank, load every shard; rank 0's facts
        with the smallest KV budget over the ranks."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from lmkit_plugins.executors.ray_worker import RayRank

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
            self._owns_ray = address is None
        on_gpu = self.stack.device == "cuda"
        bundle = {"GPU": 1.0} if on_gpu else {"CPU": 1.0}
        self._placement = placement_group([bundle] * self.world_size, strategy="PACK")
        ray.get(self._placement.ready())
        actor_cls = ray.remote(num_cpus=0 if on_gpu else 1, num_gpus=1 if on_gpu else 0)(RayRank)
        # (Ray sets OMP_NUM_THREADS to an actor's num_cpus: one thread per CPU rank)
        self.actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self._placement, placement_group_bundle_index=rank)).remote()
            for rank in range(self.world_size)]
        ip, port = self._wait([self.actors[0].address.remote()], decode=False)[0]
        facts = worker_facts(self.config, self.host, self.facts)
        handshakes = [{"rank": rank, "world_size": self.world_size,
                       "init_method": f"tcp://{ip}:{port}",
                       "config": self.config.model_dump(mode="json"),
                       "stack": self.stack.names(), "facts": facts,
                       "cuda_index": 0}  # Ray gives each actor one visible GPU
                      for rank in range(self.world_size)]
        started: list[Started] = self._wait(
            [a.load.remote(h) for a, h in zip(self.actors, handshakes, strict=True)])
        return across_ranks([s.info for s in started])

    # ------------------------------------------------------------------ calls

    def _call(self, make: Any, timeout_s: float | None = None) -> list[Any]:
        """Send ``make(seq)`` to every actor; their replies in rank order (all within
        ``timeout_s`` seconds)."""
        if self._failed is not None:
            raise WorkerFailedError(self._failed)
        if not self.actors:
            raise RuntimeError("RayExecutor.start() must be called first")
        self._seq += 1
        frame = self._encoder.encode(make(self._seq))
        return self._wait([a.call.remote(frame) for a in self.actors], timeout_s=timeout_s)

    def _wait(self, refs: list[Any], decode: bool = True,
              timeout_s: float | None = None) -> list[Any]:
        """The results of ``refs`` (one per rank, in order), raising as soon as one
        actor died or reported a failure, or when they are not all in after
        ``timeout_s`` seconds."""
        import ray
        from ray.exceptions import RayError

        results: dict[int, Any] = {}
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            if deadline is not None and time.monotonic() >= deadline:
                hung = ", ".join(str(index[ref]) for ref in pending)
                self._fail(f"worker rank(s) {hung} (Ray actors) did not answer within "
                           f"{timeout_s:g}s (executor.options.execute_timeout_s): hung (a "
                           "stuck device or collective, a deadlock); raise the timeout if "
                           "steps legitimately take longer")
            ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in ready:
                rank = index[ref]
                try:
                    value = ray.get(ref)
                except RayError as e:
                    first = (str(e).strip().splitlines() or [""])[0]
                    self._fail(f"worker rank {rank} (Ray actor) died: {type(e).__name__}: {first}")
                if decode and value is not None:
                    value = self._decoder.decode(value)
                    if isinstance(value, Failed):
                        failed = f"worker rank {value.rank} failed: {value.error}"
                        died = self._died(pending, index)  # a peer's death causes it
                        self._fail(f"{died} (then {failed})" if died else failed)
                results[rank] = value
        return [results[r] for r in range(len(refs))]

    def _died(self, pending: list[Any], index: dict[Any, int]) -> str | None:
        """Which of the ``pending`` calls' actors died, waiting up to
        :data:`DEATH_GRACE_S` for Ray to notice; ``None`` when none did."""
        import ray
        from ray.exceptions import RayActorError

        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S) \
            if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                return f"worker rank {index[ref]} (Ray actor) died: {type(e).__name__}"
        return None

    def _fail(self, reason: str) -> None:
        self._failed = (f"{reason}; the {self.world_size}-rank model cannot go on (the "
                        "other ranks were stopped).")
        self._kill_all()
        raise WorkerFailedError(self._failed)

    # ------------------------------------------------------------------ Executor

    def check_health(self) -> None:
        """Raise :class:`WorkerFailedError` when an actor died since the last step (the
        other actors are killed), or the executor failed before; nothing before
        :meth:`start` or after :meth:`shutdown`.

        Never waits: each actor has at most one cheap call (``pid``) in flight, polled
        with ``ray.wait(timeout=0)``; a call that came back is replaced by a fresh one,
        and the first that fails (Ray fails the calls of a dead actor) names its rank.
        A call sent before the actor died still succeeds, so a death shows within two
        checks of Ray noticing it (a killed actor: about a second)."""
        if self._failed is not None:
            raise WorkerFailedError(self._failed)
        if not self.actors:
            return
        import ray
        from ray.exceptions import RayError

        pings = self._pings
        if pings:
            ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
            done = set(ready)
            for rank in sorted(pings):
                ref = pings[rank]
                if ref not in done:
                    continue  # still in flight (a busy or slow actor): not asked twice
                try:
                    ray.get(ref)
                except RayError as e:
                    first = (str(e).strip().splitlines() or [""])[0]
                    self._fail(f"worker rank {rank} (Ray actor) died while the engine was "
                               f"idle: {type(e).__name__}: {first}")
                del pings[rank]
        for rank, actor in enumerate(self.actors):
            if rank not in pings:
                pings[rank] = actor.pid.remote()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks on every rank."""
        self._call(lambda s: InitKVCache(s, num_blocks))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output."""
        wire = scheduler_output_to_wire(scheduler_output)
        reply = self._call(lambda s: Execute(s, wire), self.execute_timeout_s)[0]
        assert isinstance(reply, Executed), reply
        return runner_output_from_wire(reply.output)

    def offload_lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """The smallest ``(held, resident)`` over ranks."""
        hashes = list(block_hashes)
        answers = self._call(lambda s: OffloadLookup(s, hashes), self.execute_timeout_s)
        return min(a.held for a in answers), min(a.resident for a in answers)

    def offload_stats(self) -> dict[str, int]:
        """Every rank's offload counters, summed."""
        total: dict[str, int] = {}
        for answer in self._call(OffloadStats, self.execute_timeout_s):
            for k, v in answer.stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def close_offload(self) -> None:
        """Close the tier on every rank; nothing once shut down or failed."""
        if self.actors and self._failed is None:
            self._call(CloseOffload)

    def shutdown(self) -> None:
        """Stop and kill the actors, remove the placement group, and stop a Ray this
        executor started. Safe to call twice, and after a failure."""
        if self.actors and self._failed is None:
            import ray

            frame = self._encoder.encode(Stop(self._seq + 1))
            try:
                ray.get([a.call.remote(frame) for a in self.actors], timeout=STOP_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        self._kill_all()

    def _kill_all(self) -> None:
        self._pings = {}
        if not (self.actors or self._placement is not None):
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._placement is not None:
            remove_placement_group(self._placement)
            self._placement = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

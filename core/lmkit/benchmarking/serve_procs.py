"""``lmkit bench serve --client-procs N``: one run's requests sent from N processes.

One Python process reading server-sent events with httpx tops out at roughly ten
thousand events a second; a server streaming faster than that (hundreds of streams of
a small model) is then measured at the client's speed, and its streams look bursty
because the client reads them late. Each process here gets a
:class:`~lmkit.benchmarking.serve.Share` of the run (:func:`~lmkit.benchmarking.serve.split_run`),
builds its own HTTP client, waits at a barrier for the others, and sends its requests
on the common schedule; the parent merges their results
(:func:`~lmkit.benchmarking.serve.merge_shares`). The processes are spawned, not
forked, and time themselves on the host's monotonic clock, so their starts and ends
compare (one host).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
from collections.abc import Sequence
from typing import Any

from lmkit.benchmarking.serve import Share, ShareResult, http_client, run_share
from lmkit.errors import LMKitError

START_TIMEOUT_S = 120.0  # for every client process to import and reach the barrier


def _client_main(index: int, base_url: str, model: str, share: Share, api_key: str | None,
                 timeout_s: float, barrier: Any, out: Any) -> None:
    """A client process: build the HTTP client, meet the others, run the share, report
    ``(index, ShareResult | error text)`` on ``out``."""

    async def main() -> ShareResult:
        async with http_client(timeout_s) as client:
            await asyncio.to_thread(barrier.wait, START_TIMEOUT_S)
            return await run_share(client, base_url, model, share, api_key)

    try:
        out.put((index, asyncio.run(main())))
    except BaseException as e:  # the parent reports it; nothing else would
        out.put((index, f"{type(e).__name__}: {e}"))


def run_in_processes(base_url: str, model: str, shares: Sequence[Share],
                     api_key: str | None, timeout_s: float) -> list[ShareResult]:
    """Run each share in its own spawned process; their results in ``shares``' order.

    Raises :class:`~lmkit.errors.LMKitError` naming the client process that failed or
    died, after stopping the others.
    """
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(shares))
    out = ctx.Queue()
    procs = [ctx.Process(target=_client_main, name=f"lmkit-bench-client-{i}", daemon=True,
                         args=(i, base_url, model, share, api_key, timeout_s, barrier, out))
             for i, share in enumerate(shares)]
    for p in procs:
        p.start()
    done: dict[int, ShareResult] = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + timeout_s * max(
            len(s.prompts) for s in shares)
        dead: list[int] = []
        while len(done) < len(shares):
            try:  # after a death is seen, one more look: its report may be in flight
                index, result = out.get(timeout=5.0 if dead else 1.0)
            except queue.Empty:
                if dead:
                    raise LMKitError(f"benchmark client process {dead[0]} exited with status "
                                     f"{procs[dead[0]].exitcode} before reporting") from None
                dead = [i for i, p in enumerate(procs) if i not in done and not p.is_alive()]
                if time.monotonic() > deadline:
                    raise LMKitError("benchmark client processes did not finish in time") \
                        from None
                continue
            dead = []
            if isinstance(result, str):
                raise LMKitError(f"benchmark client process {index} failed: {result}")
            done[index] = result
    finally:
        for p in procs:
            if p.is_alive() and len(done) < len(shares):
                p.terminate()
            p.join(timeout=10)
    return [done[i] for i in range(len(shares))]

"""A step timeline of the engine core, for profiling (``LMKIT_STEP_TRACE=FILE``).

With the variable set (``{pid}`` in it becomes the process id; a second engine of the
same process writes to ``FILE.2``, a third to ``FILE.3``), the engine core appends one
JSON line per step to ``FILE``:

* ``t``: the step's start, seconds since the trace opened;
* ``gap_ms``: from the end of the previous step's model output to this step's start
  (outputs sent to the frontend, input drained, other phases' work after the output);
* ``schedule_ms``: the scheduler and the phases that fill the plan;
* ``execute_ms``: the executor's step and the scheduler taking its tokens (on a GPU
  this includes waiting for the device, except where a step runs ahead);
* ``reqs``, ``tokens``: requests and tokens scheduled; ``prefill_tokens``: tokens of
  requests scheduled more than one token (prompts, chunks, drafts); ``decode_reqs``:
  requests scheduled exactly one token; ``verify_tokens``: tokens of requests that verify
  drafts (each one plus its drafts); ``finished``: requests that finished in it.

A gap after a step that left requests running (``reqs > finished``) is host time the
engine spent between steps; after one that finished everything, it includes idling.

``python bench/step_trace.py FILE`` summarizes a trace by step kind. Tracing costs
two clock reads and one buffered write per step.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import IO, TYPE_CHECKING

from lmkit.engine.phases import StepPhase

if TYPE_CHECKING:
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler_output import SchedulerOutput

ENV = "LMKIT_STEP_TRACE"

_traces_opened: dict[str, int] = {}  # path -> engines of this process tracing to it


class StepTracePhase(StepPhase):
    """Writes each step's timing and shape as one JSON line to a file."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] | None = open(path, "a", buffering=1 << 16)  # noqa: SIM115
        atexit.register(self.shutdown)  # an engine never shut down still leaves its steps
        self._opened = time.perf_counter()
        self._start = self._scheduled = self._prev_end = 0.0

    @classmethod
    def from_env(cls) -> StepTracePhase | None:
        """A trace phase writing to ``$LMKIT_STEP_TRACE`` (``{pid}`` in it replaced by
        the engine process's id, and ``.N`` appended for the ``N``-th engine of one
        process, so that several engines write apart), or ``None`` when it is unset."""
        path = os.environ.get(ENV)
        if not path:
            return None
        path = path.replace("{pid}", str(os.getpid()))
        n = _traces_opened[path] = _traces_opened.get(path, 0) + 1
        return cls(path if n == 1 else f"{path}.{n}")

    def before_schedule(self) -> None:
        self._start = time.perf_counter()

    def after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        self._scheduled = time.perf_counter()

    def after_model_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           outputs: list[EngineCoreOutput]) -> None:
        end = time.perf_counter()
        if self._file is None:
            return
        counts = scheduler_output.num_scheduled_tokens.values()
        decode_reqs = sum(1 for n in counts if n == 1)
        spec = scheduler_output.scheduled_spec_decode_tokens
        tokens = scheduler_output.total_num_scheduled_tokens
        record = {
            "t": round(self._start - self._opened, 6),
            "gap_ms": round((self._start - self._prev_end) * 1e3, 3) if self._prev_end else None,
            "schedule_ms": round((self._scheduled - self._start) * 1e3, 3),
            "execute_ms": round((end - self._scheduled) * 1e3, 3),
            "reqs": len(scheduler_output.num_scheduled_tokens),
            "tokens": tokens,
            "prefill_tokens": tokens - decode_reqs,
            "decode_reqs": decode_reqs,
            "verify_tokens": sum(1 + len(d) for d in spec.values() if d),
            "finished": sum(1 for o in outputs if o.finish_reason is not None),
        }
        self._file.write(json.dumps(record) + "\n")
        self._prev_end = end

    def shutdown(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            atexit.unregister(self.shutdown)

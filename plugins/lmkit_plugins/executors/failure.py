"""What the built-in executors share about failing: the error a dead, failed or hung
worker raises, and the options that bound how long a step may take.

A step that fails leaves the model runner's state (its persistent batch, the KV cache
written so far, a collective half done) undefined, so every executor treats it as
fatal: the call raises :class:`WorkerFailedError` and so does every later call. The
engine-core process then reports the failure and exits (``/health`` turns 503, requests
in flight get an error, ``lmkit serve`` starts a new engine); ``LLM.generate`` raises
it.
"""

from __future__ import annotations

from lmkit.api import LMKitError
from pydantic import BaseModel, ConfigDict, Field

# as vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: a step that takes this long is stuck
DEFAULT_EXECUTE_TIMEOUT_S = 300.0


class WorkerFailedError(LMKitError):
    """A worker died, raised inside a step, or did not answer in time; the executor
    cannot go on."""

    exit_code = 1


class WorkerOptions(BaseModel):
    """Options of the executors whose ranks run in other processes (``mp``, ``ray``),
    set as ``executor.options`` (e.g. ``--set executor.options.execute_timeout_s=600``)."""

    model_config = ConfigDict(extra="forbid")

    execute_timeout_s: float | None = Field(
        DEFAULT_EXECUTE_TIMEOUT_S, gt=0, description="How long one step (and an offload "
        "query) may wait for the workers' answer before a rank counts as hung (a stuck "
        "device or collective, a deadlock): the call then fails with WorkerFailedError "
        "and the ranks are stopped, so the engine reports itself dead instead of hanging. "
        "Raise it for steps that legitimately take longer; null waits forever.")


def execute_timeout(options: object) -> float | None:
    """The step timeout of ``options`` (a :class:`WorkerOptions`, or ``None`` when the
    executor was built without options: the default)."""
    if isinstance(options, WorkerOptions):
        return options.execute_timeout_s
    return DEFAULT_EXECUTE_TIMEOUT_S

"""Piecewise CUDA graphs for the steps the decode graphs do not take: mixed
prefill+decode steps and prefill chunks of up to a few thousand tokens.

A mixed step of a small model is host-bound: hundreds of short kernels launched one by
one from Python (the GPU waits for the host). The decode graphs
(:mod:`lmkit.worker.cuda_graphs`) cannot take such a step: its attention plan depends on
how the tokens split into requests, which changes every step. So this module captures
the forward *between* attention calls, per padded token count ``N``: graph 0 runs from
the embedding to the first layer's attention inputs, graph ``i`` from layer ``i - 1``'s
attention output to layer ``i``'s attention inputs, the last graph to the final norm.
At replay the graphs run in turn and each attention call runs eagerly in between, with
the step's own plan, reading the graph's ``q``/``k``/``v`` buffers and writing its output
where the next graph reads it (vLLM splits its compiled graph at the same place).

How the split is made without changing any model: while a size is captured, the model's
forward gets a stand-in for its attention backend (:class:`_AttentionBreak`). Each
``run`` (or ``run_mla``) call ends the graph being captured, records the call and
begins the next graph, returning a fixed buffer of the call's documented output shape
(the backend itself is never called while capturing, so any backend works, with no
plan); ``kv_write_slots`` returns the runner's fixed slot buffer (a model that stores
K/V in its RoPE kernel does so inside the graphs). The graphs copy each call's q/k/v
into buffers shared by every layer and size, and every call's output goes to one shared
buffer, so a captured size holds the activations of one forward. Padding rows ``n..N`` of a step of ``n`` tokens read token 0 at
position 0 and write no cache slot (``-1``); only rows ``0..n`` of each attention call
run, and only rows ``0..n`` of the output are returned.

Models whose layers reach their attention other than through ``ForwardContext.attn``
(several KV cache groups) are not captured, nor models under tensor parallelism (not yet
run on several GPUs). ``executor.piecewise_max_tokens`` sets the
largest step taken (``0``: off); ``executor.enforce_eager`` turns these graphs off with
the decode graphs. Without graphs (``use_graphs=False``, any device) the same padded,
fixed-buffer forward runs eagerly, which is how the CPU tests check the padding.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmkit.api.model import ForwardContext
from lmkit.platform import switched_off
from lmkit.worker.graph_stream import capture_stream

if TYPE_CHECKING:
    from lmkit.config.schema import LMKitConfig
    from lmkit.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

#: attention calls that break a graph, and which of their positional arguments are
#: token-major (sliced to the step's tokens at replay); everything else passes as is
_TOKEN_ARGS = {"run": (1, 2, 3), "run_mla": (1, 2, 3, 4)}


def piecewise_sizes(max_tokens: int, smallest: int = 16) -> list[int]:
    """The padded token counts to capture, ascending, ending at ``max_tokens``.

    16, 32, 64, 128, then a quarter of the way between powers of two (160, 192, 224,
    256, 320, ...): padding adds at most a quarter to a step of more than 128 tokens.
    """
    if max_tokens < 1:
        return []
    sizes, size = [], smallest
    while size < max_tokens:
        sizes.append(size)
        step = max(size // 4, 1) if size >= 128 else size
        size += step
    return [*sizes, max_tokens]


class PiecewiseUnsupportedError(RuntimeError):
    """The model used its attention backend in a way a graph cannot be split around."""


@dataclass
class _Call:
    """One attention call between two graphs: the method, its arguments (the token-major
    ones the runner's fixed buffers, which the graph before it fills) and the fixed
    buffer the graph after it reads the output from."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: torch.Tensor

    def run(self, attn: Any, n: int) -> None:
        """Run the call for the step's first ``n`` tokens; rows ``0..n`` of :attr:`out`."""
        token_args = _TOKEN_ARGS[self.method]
        args = [a[:n] if i in token_args else a for i, a in enumerate(self.args)]
        self.out[:n].copy_(getattr(attn, self.method)(*args, **self.kwargs))


class _AttentionBreak:
    """Stands in for a model's attention backend while a piecewise forward runs.

    ``mode`` ``"capture"``: every attention call ends the graph being captured and
    begins the next (see the module docstring); ``"eager"``: the call runs on the
    step's first ``n`` tokens and its output is padded back to ``N`` rows (the
    graph-free path); ``"warm"``: the call is skipped (its output buffer stands in) and
    the fixed buffers a capture copies the calls' arguments into are made (the warm-up
    before a capture compiles the other kernels; no allocation may happen outside the
    graphs' pool while one is captured).
    """

    def __init__(self, runner: PiecewiseGraphRunner, size: int, n: int, mode: str) -> None:
        self._runner, self._size, self._n, self._mode = runner, size, n, mode
        self._attn = runner.attn
        self.calls: list[_Call] = []

    def kv_write_slots(self) -> torch.Tensor:
        """The fixed slot buffer of this size (padding rows ``-1``)."""
        return self._runner.slots(self._size)

    def run(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._call("run", args, kwargs)

    def run_mla(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._call("run_mla", args, kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._attn, name)
        if callable(value):
            raise PiecewiseUnsupportedError(
                f"the model calls its attention backend's {name}() inside the forward; "
                "piecewise CUDA graphs split only around run() and run_mla()")
        return value

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> torch.Tensor:
        runner, size = self._runner, self._size
        token_args = _TOKEN_ARGS[method]
        if self._mode == "eager":  # the step's first n tokens, output padded to size rows
            n = self._n
            sliced = [a[:n] if i in token_args else a for i, a in enumerate(args)]
            out = getattr(self._attn, method)(*sliced, **kwargs)
            padded = out.new_zeros((size, *out.shape[1:]))
            padded[:n] = out
            return padded
        # warm-up and capture never call the backend (no plan is needed, whatever the
        # backend): the output is the fixed buffer of the call's documented shape
        out_buf = runner.buffer((method, "out"), self._output_like(method, args))[:size]
        if self._mode == "warm":  # makes the fixed buffers a capture copies into
            for i in token_args:
                runner.buffer((method, i), args[i])
            return out_buf
        # the graph copies the token-major arguments into fixed buffers shared by every
        # layer and size (the attention call reads them there before the next graph
        # overwrites them), so no layer's q/k/v stays allocated after the capture
        fixed = list(args)
        for i in token_args:
            buf = runner.buffer((method, i), args[i])[:size]
            buf.copy_(args[i])
            fixed[i] = buf
        runner.end_graph()
        self.calls.append(_Call(method, tuple(fixed), kwargs, out_buf))
        runner.begin_graph()
        return out_buf

    def _output_like(self, method: str, args: tuple[Any, ...]) -> torch.Tensor:
        """A tensor of one row of the call's output shape and dtype (``run``: ``[n,
        num_heads, head_size of v]``; ``run_mla``: ``[n, num_heads, v_head_dim]``), the
        shapes :class:`~lmkit.api.AttentionBackend` and its MLA kind document."""
        q = args[1]
        width = args[3].shape[-1] if method == "run" else self._attn.v_head_dim
        return q.new_empty((1, q.shape[1], width))


@dataclass
class _Captured:
    """The graphs of one size, the attention calls between them, and the outputs."""

    graphs: list[torch.cuda.CUDAGraph]
    calls: list[_Call]
    hidden: torch.Tensor
    aux: list[torch.Tensor]


class PiecewiseGraphRunner:
    """Captured forwards of one model split at its attention calls, one set per padded
    token count (:func:`piecewise_sizes`).

    Args:
        model: the runner's model (``model(input_ids, positions, ctx) -> hidden``,
            ``model.attn`` its one attention backend).
        kv_caches: the runner's KV caches (fixed for the graphs' lifetime).
        device: where the model runs.
        max_tokens: the largest step (in tokens) to capture.
        use_graphs: capture and replay graphs (CUDA only); ``False`` runs the same
            padded forward eagerly (any device).
        aux_layers: the target layers whose inputs a draft head reads (EAGLE-3); their
            inputs are extra outputs of the graphs.
    """

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], device: torch.device,
                 max_tokens: int, use_graphs: bool = True,
                 aux_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.attn = model.attn
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.aux_layers = tuple(aux_layers)
        self.sizes = piecewise_sizes(max_tokens)
        self.max_tokens = self.sizes[-1] if self.sizes else 0
        n = self.max_tokens
        # input ids | positions | cache slots of every size, at fixed addresses: size N
        # reads [0:N], [N:2N], [2N:3N]
        self._packed = torch.zeros(3 * n, dtype=torch.int64, device=self.device)
        self._captured: dict[int, _Captured] = {}
        # attention arguments and outputs at fixed addresses, ``[max_tokens, ...]``
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._pool: Any = None
        self._graph: torch.cuda.CUDAGraph | None = None  # the graph being captured
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self.capture_seconds = 0.0
        self.num_replays = 0

    # ------------------------------------------------------------------ buffers

    def slots(self, size: int) -> torch.Tensor:
        """The cache slot buffer of ``size`` (what a model writing K/V itself reads)."""
        return self._packed[2 * size:3 * size]

    def buffer(self, key: tuple[Any, ...], like: torch.Tensor) -> torch.Tensor:
        """The fixed buffer ``[max_tokens, *like.shape[1:]]`` of ``like``'s dtype for
        ``key`` (an attention argument or output; one per shape and dtype)."""
        key = (*key, tuple(like.shape[1:]), like.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.zeros((self.max_tokens, *like.shape[1:]), dtype=like.dtype,
                              device=like.device)
            self._buffers[key] = buf
        return buf

    def _stage(self, size: int, dev: StepInputs, n: int) -> None:
        """The step's ids, positions and slots into the buffers of ``size`` (device
        copies, in stream order)."""
        p = self._packed
        p[:n].copy_(dev.input_ids[:n])
        p[size:size + n].copy_(dev.positions[:n])
        p[2 * size:2 * size + n].copy_(dev.slot_mapping[:n])
        if n < size:  # padding rows: token 0 at position 0, no slot (earlier steps of
            # other sizes left other values there)
            p[n:size].zero_()
            p[size + n:2 * size].zero_()
            p[2 * size + n:3 * size].fill_(-1)

    def _stage_padding_only(self, size: int) -> None:
        self._packed[:2 * size].zero_()
        self._packed[2 * size:3 * size].fill_(-1)

    # ------------------------------------------------------------------ capture

    def end_graph(self) -> None:
        """End the graph being captured (an attention call follows)."""
        assert self._graph is not None
        self._graph.capture_end()
        self._graphs.append(self._graph)
        self._graph = None

    def begin_graph(self) -> None:
        """Begin capturing the next graph of this size, in the shared memory pool."""
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self._pool)

    def capture(self) -> None:
        """Capture every size, largest first (smaller ones reuse its memory pool).

        Raises :class:`PiecewiseUnsupportedError` (from :meth:`warm_up`, before any
        capture) when the model uses its backend in a way the graphs cannot be split
        around, or its forward fails beside the stand-in backend."""
        if not self.use_graphs or not self.sizes:
            return
        start = time.perf_counter()
        torch.cuda.empty_cache()  # the pool may take blocks the allocator kept cached
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self._pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self.warm_up(size)
                torch.cuda.synchronize(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._graphs = []
                    self.begin_graph()
                    hidden, aux, calls = self._run_model(size, size, "capture")
                    self.end_graph()
                torch.cuda.current_stream(self.device).wait_stream(stream)
                self._captured[size] = _Captured(self._graphs, calls, hidden, aux)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_seconds = time.perf_counter() - start
        pieces = len(next(iter(self._captured.values())).graphs)
        logger.info("captured piecewise CUDA graphs for steps of %d..%d tokens (%d sizes, "
                    "%d pieces each) in %.1f s, %.0f MiB", self.sizes[0], self.max_tokens,
                    len(self.sizes), pieces, self.capture_seconds, used / 2**20)

    def warm_up(self, size: int) -> None:
        """Run the padded forward of ``size`` once without the backend (compiles the
        kernels a capture records, makes the fixed buffers). Any error the model raises
        there -- before anything is captured -- becomes
        :class:`PiecewiseUnsupportedError`: that model's mixed steps stay eager."""
        self._stage_padding_only(size)
        try:
            self._run_model(size, size, "warm")
        except PiecewiseUnsupportedError:
            raise
        except Exception as exc:
            raise PiecewiseUnsupportedError(
                f"the model's forward failed beside the stand-in attention backend "
                f"({type(exc).__name__}: {exc})") from exc

    def _run_model(self, size: int, n: int, mode: str
                   ) -> tuple[torch.Tensor, list[torch.Tensor], list[_Call]]:
        """The padded forward of ``size`` rows through the stand-in backend."""
        p = self._packed
        stand_in = _AttentionBreak(self, size, n, mode)
        ctx = ForwardContext(stand_in, self.kv_caches, self.aux_layers)  # type: ignore[arg-type]
        hidden = self.model(p[:size], p[size:2 * size], ctx)
        return hidden, ctx.aux_hidden_states, stand_in.calls

    # ------------------------------------------------------------------ replay

    def can_run(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens fits the largest captured size."""
        return 0 < num_tokens <= self.max_tokens

    def padded_size(self, num_tokens: int) -> int:
        """The smallest captured size holding ``num_tokens``."""
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def run(self, dev: StepInputs, num_tokens: int,
            aux: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Run a planned step (the backend's :meth:`plan` done with the step's metadata)
        of ``num_tokens`` tokens whose device inputs are ``dev``; returns hidden
        ``[num_tokens, hidden]``, a view valid until the next run. With ``aux``, the
        draft head's target-layer inputs are appended to it (views too)."""
        n = num_tokens
        size = self.padded_size(n)
        self._stage(size, dev, n)
        self.num_replays += 1
        if self.use_graphs:
            cap = self._captured[size]
            attn = self.attn
            cap.graphs[0].replay()  # then each attention call and the graph after it
            for call, graph in zip(cap.calls, cap.graphs[1:], strict=True):
                call.run(attn, n)
                graph.replay()
            hidden, taps = cap.hidden, cap.aux
        else:
            hidden, taps, _ = self._run_model(size, n, "eager")
        if aux is not None:
            aux.extend(t[:n] for t in taps)
        return hidden[:n]


def maybe_capture_piecewise(config: LMKitConfig, model: Any, kv_caches: list[torch.Tensor],
                            device: torch.device, num_kv_groups: int,
                            aux_layers: tuple[int, ...] = (), tp_size: int = 1
                            ) -> PiecewiseGraphRunner | None:
    """Capture piecewise graphs of ``model`` when they apply, else ``None``.

    They apply on CUDA, unless ``executor.enforce_eager`` is set or
    ``executor.piecewise_max_tokens`` is 0 (or the environment sets
    ``LMKIT_PIECEWISE_GRAPHS=0``), for a model with one KV cache group on one rank
    (``tp_size`` 1: under tensor parallelism mixed steps stay eager for now). The
    largest size is ``min(piecewise_max_tokens, scheduler.max_num_batched_tokens)``.
    A model that uses its backend in a way the graphs cannot be split around runs its
    mixed steps eagerly (logged).
    """
    limit = min(config.executor.piecewise_max_tokens,
                config.scheduler.max_num_batched_tokens)
    if switched_off("LMKIT_PIECEWISE_GRAPHS"):  # an A/B switch for benchmarks
        limit = 0
    if device.type != "cuda" or config.executor.enforce_eager or limit < 1:
        return None
    if tp_size > 1:  # not yet run on several GPUs: collectives between pieces unchecked
        logger.info("piecewise CUDA graphs are not used under tensor parallelism yet: "
                    "mixed steps run eagerly")
        return None
    if num_kv_groups != 1:
        logger.info("piecewise CUDA graphs need one KV cache group (this model has %d): "
                    "mixed steps run eagerly", num_kv_groups)
        return None
    runner = PiecewiseGraphRunner(model, kv_caches, device, limit, aux_layers=aux_layers)
    try:
        runner.capture()
    except PiecewiseUnsupportedError as exc:
        logger.warning("no piecewise CUDA graphs: %s; mixed steps run eagerly", exc)
        return None
    return runner

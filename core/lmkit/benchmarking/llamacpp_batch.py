"""llama.cpp through llama-cpp-python's low-level API: many sequences in one context.

The high-level ``Llama`` object runs one sequence; the throughput peer of ``lmkit bench
throughput --peer llamacpp`` and the perplexity side of ``bench/cpu_quant_quality.py``
need several sequences per ``llama_decode`` call (as llama.cpp's own ``llama-batched``
does) and every position's logits. :class:`LlamaCppContext` gives both.

``LMKIT_LLAMACPP_EXTRA_BUFTS=0`` turns off llama.cpp's extra CPU weight buffers (the
AMX / repacked layouts): the prebuilt llama-cpp-python CPU library crashes in their
multi-row matmul on some CPUs (AMX hosts); decode of one row is not affected.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lmkit.benchmarking.workload import Workload
from lmkit.errors import ConfigError


def extra_bufts() -> bool:
    """Whether llama.cpp may use its extra CPU weight buffers
    (``LMKIT_LLAMACPP_EXTRA_BUFTS``, default on)."""
    return os.environ.get("LMKIT_LLAMACPP_EXTRA_BUFTS", "1") != "0"


def _lib() -> Any:
    try:
        import llama_cpp
        from llama_cpp._logger import set_verbose
    except ImportError as e:
        raise ConfigError("the llamacpp peer needs llama-cpp-python: pip install "
                          "llama-cpp-python (CMAKE_ARGS=-DGGML_NATIVE=ON builds it for "
                          "this CPU).") from e
    set_verbose(False)  # llama.cpp's load log: errors only
    return llama_cpp


class LlamaCppContext:
    """One GGUF model and one llama.cpp context holding ``n_seq`` sequences of at most
    ``seq_len`` tokens each, fed through ``llama_decode`` batches of up to ``n_batch``
    tokens."""

    def __init__(self, gguf: Path, n_seq: int, seq_len: int, threads: int,
                 n_batch: int = 512) -> None:
        c = self.c = _lib()
        c.llama_backend_init()
        mp = c.llama_model_default_params()
        mp.use_extra_bufts = extra_bufts()
        self.model = c.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise ConfigError(f"llama.cpp could not load {gguf}")
        cp = c.llama_context_default_params()
        cp.n_seq_max = n_seq
        cp.n_ctx = n_seq * (-(-max(seq_len, 32) // 256) * 256)
        ubatch = int(os.environ.get("LMKIT_LLAMACPP_UBATCH", "0")) or n_batch
        cp.n_batch, cp.n_ubatch = n_batch, min(ubatch, n_batch)
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = c.llama_init_from_model(self.model, cp)
        if not self.ctx:
            c.llama_model_free(self.model)
            raise ConfigError(f"llama.cpp could not make a context for {gguf} "
                              f"({n_seq} sequences x {seq_len} tokens)")
        self.n_batch = n_batch
        self.n_vocab = c.llama_vocab_n_tokens(c.llama_model_get_vocab(self.model))
        self.batch = c.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        """Forget every sequence's KV cache."""
        self.c.llama_memory_clear(self.c.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[Any]:
        """Run ``(token, position, sequence, want_logits)`` items (at most ``n_batch``)
        in one ``llama_decode``; the logits (numpy float32 views, valid until the next
        call) of the items that asked for them, in order."""
        import numpy as np

        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, want
        b.n_tokens = len(items)
        rc = self.c.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc} on {len(items)} tokens")
        return [np.ctypeslib.as_array(self.c.llama_get_logits_ith(self.ctx, i),
                                      shape=(self.n_vocab,))
                for i, item in enumerate(items) if item[3]]

    def close(self) -> None:
        """Free the batch, context and model."""
        self.c.llama_batch_free(self.batch)
        self.c.llama_free(self.ctx)
        self.c.llama_model_free(self.model)


def prompt_logprobs(gguf: Path, tokens: list[int], threads: int) -> list[float]:
    """Teacher forcing: log-probability of ``tokens[i]`` given ``tokens[:i]`` for
    ``i >= 1`` (as lmkit's ``prompt_logprobs`` reports them), computed in float64."""
    import numpy as np

    lc = LlamaCppContext(gguf, 1, len(tokens) + 1, threads)
    try:
        out: list[float] = []
        for s in range(0, len(tokens), lc.n_batch):
            chunk = [(t, s + i, 0, True) for i, t in enumerate(tokens[s:s + lc.n_batch])]
            for i, logits in enumerate(lc.decode(chunk)):
                nxt = s + i + 1
                if nxt < len(tokens):
                    x = logits.astype(np.float64)
                    m = x.max()
                    out.append(float(x[tokens[nxt]] - m - np.log(np.exp(x - m).sum())))
        return out
    finally:
        lc.close()


def greedy(lc: LlamaCppContext, prompts: list[list[int]], wants: list[int]
           ) -> list[list[int]]:
    """Greedy continuations (EOS ignored) of every prompt at once, sequence ``s`` in
    slot ``s``: prompts prefilled in batches of up to ``n_batch`` tokens, then one token
    per live sequence per ``llama_decode``."""
    lc.clear()
    out: list[list[int]] = []
    flat = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
    for start in range(0, len(flat), lc.n_batch):  # one output per prompt, in order
        out += [[int(row.argmax())] for row in lc.decode(flat[start:start + lc.n_batch])]
    while True:
        live = [s for s, toks in enumerate(out) if len(toks) < wants[s]]
        if not live:
            return out
        for start in range(0, len(live), lc.n_batch):
            step = live[start:start + lc.n_batch]
            items = [(out[s][-1], len(prompts[s]) + len(out[s]) - 1, s, True) for s in step]
            for row, s in zip(lc.decode(items), step, strict=True):
                out[s].append(int(row.argmax()))


def llamacpp_throughput(gguf: Path, workload: Workload, threads: int) -> dict[str, Any]:
    """Every request at once in one llama.cpp context (see :func:`greedy`), as
    :func:`lmkit.benchmarking.sides.lmkit_throughput` runs lmkit."""
    prompts, wants = workload.prompts, workload.output_lens
    longest = max(len(p) + n for p, n in zip(prompts, wants, strict=True))
    lc = LlamaCppContext(gguf, len(prompts), longest + 1, threads)
    try:
        greedy(lc, [prompts[0][:32]] * 2, [4, 4])  # warm-up
        t0 = time.perf_counter()
        produced = sum(map(len, greedy(lc, prompts, wants)))
        return {"elapsed_s": time.perf_counter() - t0, "output_tokens": produced,
                "n_threads": threads, "extra_bufts": extra_bufts()}
    finally:
        lc.close()

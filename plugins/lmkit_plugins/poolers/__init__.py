"""Built-in poolers (the ``pooler`` kind), registered by the built-in models plugin
(:mod:`lmkit_plugins.models`): ``last``, ``mean``, ``cls``, ``all`` and ``classify``."""

from lmkit.api import Spec

BUILTIN = "lmkit_plugins.poolers.builtin"


def pooler_specs() -> list[Spec]:
    """The built-in poolers' specs."""
    return [
        Spec(name="last", target=f"{BUILTIN}:LastPooler",
             description="The last prompt token's hidden state (decoder embedders, "
                         "e.g. Qwen3-Embedding)."),
        Spec(name="mean", target=f"{BUILTIN}:MeanPooler",
             description="The mean of the prompt's hidden states (sentence-transformers)."),
        Spec(name="cls", target=f"{BUILTIN}:CLSPooler",
             description="The first token's hidden state ([CLS] of BERT-style encoders)."),
        Spec(name="all", target=f"{BUILTIN}:AllPooler",
             description="Every prompt token's hidden state (per-token / multi-vector)."),
        Spec(name="classify", target=f"{BUILTIN}:ClassifyPooler",
             description="Class scores from the model's classification head (models "
                         "that declare ModelPooling.classifier_pooler): softmax, sigmoid "
                         "per label or raw values, by the config's problem_type."),
    ]

"""Built-in model sources: aliases, pypi:, GGUF files, local HF directories, the HF cache."""

from lmkit.api import Spec, hookimpl

LMKIT_PLUGIN_API = ">=1.0,<2"


@hookimpl
def register_model_sources(register):
    register(Spec(name="alias", target="lmkit_plugins.sources.alias:AliasSource", priority=100,
                  description="Built-in model aliases (smollm2-135m-instruct)."))
    register(Spec(name="pypi", target="lmkit_plugins.sources.pypi:PyPISource", priority=90,
                  description="pypi:PACKAGE[==VERSION][#PATH] - a model shipped in a PyPI wheel."))
    register(Spec(name="gguf", target="lmkit_plugins.sources.gguf:GGUFSource", priority=80,
                  requires=("gguf",),
                  description="A path ending in .gguf, converted once to cached safetensors."))
    register(Spec(name="hf-dir", target="lmkit_plugins.sources.hf_dir:HFDirSource", priority=70,
                  description="An existing local directory with config.json + *.safetensors."))
    register(Spec(name="hf-hub", target="lmkit_plugins.sources.hf_hub:HFHubSource", priority=10,
                  description="org/name[@revision] from the local HF hub cache (never downloads)."))

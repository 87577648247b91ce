"""The configuration options every config-taking command shares, and the helpers that
turn them into a validated :class:`LMKitConfig` and a loaded :class:`PluginHost`.

A command declares ``opts: ConfigOptions`` and is decorated with :func:`config_options`::

    @app.command()
    @config_options
    def generate(prompt: str, opts: ConfigOptions) -> None:
        config, _ = build_config(opts)
        host = build_host(config)
        ...
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from lmkit.config.loader import load_config
from lmkit.config.schema import LMKitConfig
from lmkit.config.sources import parse_text_value
from lmkit.errors import ConfigError
from lmkit.plugin_host.manager import PluginHost

PANEL = "Configuration"


@dataclass(frozen=True)
class Flag:
    """One shared option: its parameter name, flags, the config path it sets, its type,
    for on/off flags the value it sets when given, and a short spelling of the flag
    (``--attn`` for ``--attention``: the operator's ``lmkit serve --attn flashinfer
    --spec eagle``), listed in ``--help`` after the long one, which wins when both are
    given.

    A flag that selects an extension point is named like it everywhere else: the config
    section, the ``LLM(...)`` keyword and the kind in ``lmkit plugins list``
    (``--speculative``, ``speculative:``, ``LLM(speculative=...)``).
    """

    name: str
    decls: tuple[str, ...]
    path: str | None
    type: Any
    help: str
    sets: Any = None
    short: str | None = None

    @property
    def short_name(self) -> str:
        """The parameter that receives the short spelling's value."""
        return f"{self.name}__short"


FLAGS: tuple[Flag, ...] = (
    Flag("config", ("--config", "-c"), None, Path | None,
         "YAML or TOML config file (values there are overridden by LMKIT_* variables and flags)."),
    Flag("plugin", ("--plugin", "-p"), "plugins", list[str] | None,
         "Load a plugin by entry-point or module name; 'no:NAME' blocks one. Repeatable."),
    Flag("model", ("--model",), "model.model", str | None, "Model alias, local path, GGUF file or hub id."),
    Flag("attention", ("--attention",), "attention.backend", str | None,
         "Attention backend, or 'auto'.", short="--attn"),
    Flag("scheduler", ("--scheduler",), "scheduler.backend", str | None, "Scheduler, or 'auto'."),
    Flag("executor", ("--executor",), "executor.backend", str | None, "Executor, or 'auto'."),
    Flag("tensor_parallel_size", ("--tp",), "parallel.tensor_parallel_size", int | None,
         "Split the model over N devices (tensor parallel)."),
    Flag("data_parallel_size", ("--dp",), "parallel.data_parallel_size", int | None,
         "Engine processes to spread requests over (data parallel)."),
    Flag("device", ("--device",), "executor.device", str | None, "auto, cpu or cuda."),
    Flag("dtype", ("--dtype",), "model.dtype", str | None, "auto, float32, bfloat16 or float16."),
    Flag("load_format", ("--load-format",), "model.load_format", str | None,
         "auto (the checkpoint's weights) or dummy (random weights from config.json alone)."),
    Flag("speculative", ("--speculative",), "speculative.backend", str | None,
         "Speculative-decoding proposer, 'auto' or 'none'.", short="--spec"),
    Flag("num_speculative_tokens", ("--num-speculative-tokens",),
         "speculative.num_speculative_tokens", int | None, "Draft tokens per step.",
         short="--spec-tokens"),
    Flag("speculative_model", ("--speculative-model",), "speculative.model", str | None,
         "Draft head directory of a model-based proposer (eagle).", short="--spec-model"),
    Flag("speculative_tree", ("--speculative-tree",), "speculative.tree", str | None,
         "Draft a token tree with the head: rank paths as JSON, e.g. '[[0],[1],[0,0]]'.",
         short="--spec-tree"),
    Flag("speculative_adaptive", ("--speculative-adaptive",), "speculative.adaptive", bool,
         "Speculate only while drafts measure faster than plain decoding (probes both).",
         sets=True, short="--spec-adaptive"),
    Flag("structured_output", ("--structured-output",), "structured_output.backend", str | None,
         "Structured-output (constrained decoding) backend, 'auto' or 'none'."),
    Flag("offload", ("--offload",), "offload.backend", str | None, "KV offload tier (cpu, disk, cpu+disk), 'auto' or 'none'."),
    Flag("quantization", ("--quantization",), "quantization.backend", str | None,
         "Quantized-weight method (gguf: GGUF blocks on the CPU), 'auto' or 'none' (dense)."),
    Flag("sampling_kernels", ("--sampling-kernels",), "sampling_kernels.backend", str | None,
         "Kernels the sampler draws with (torch; triton on CUDA), 'auto' or 'none' (torch)."),
    Flag("max_num_seqs", ("--max-num-seqs",), "scheduler.max_num_seqs", int | None,
         "Most requests running at once."),
    Flag("max_num_batched_tokens", ("--max-num-batched-tokens",), "scheduler.max_num_batched_tokens",
         int | None, "Token budget of one engine step."),
    Flag("block_size", ("--block-size",), "cache.block_size", int | None, "Tokens per KV-cache block."),
    Flag("kv_cache_dtype", ("--kv-cache-dtype",), "cache.kv_cache_dtype", str | None,
         "KV cache storage: 'auto' (the model's dtype) or 'fp8' (float8 e4m3, half of bf16)."),
    Flag("no_prefix_caching", ("--no-prefix-caching",), "cache.enable_prefix_caching", bool,
         "Turn prefix caching off.", sets=False),
    Flag("enforce_eager", ("--enforce-eager",), "executor.enforce_eager", bool,
         "Never capture CUDA graphs.", sets=True),
    Flag("set", ("--set",), None, list[str] | None,
         "Any setting as KEY=VALUE with a dotted key, e.g. --set scheduler.options.quantum=4. "
         "Repeatable; applied after the other flags."),
)


@dataclass(frozen=True)
class ConfigOptions:
    """The shared options as given on the command line (``None``: not given), and the
    flag spelling used where it was a short one (``{"attention": "--attn"}``), so that
    messages name the flag the user typed."""

    values: Mapping[str, Any]
    spelled: Mapping[str, str] = field(default_factory=dict)

    @property
    def config_file(self) -> Path | None:
        """The ``--config`` file, if any."""
        value = self.values.get("config")
        return Path(value) if value is not None else None

    def cli_settings(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The settings the flags make, by dotted path, and the flag that made each one.

        :raises ConfigError: a ``--set`` value that is not ``KEY=VALUE``.
        """
        settings: dict[str, Any] = {}
        flags: dict[str, str] = {}
        for flag in FLAGS:
            value = self.values.get(flag.name)
            if flag.path is None or value is None or value is False or value == []:
                continue
            settings[flag.path] = flag.sets if flag.sets is not None else value
            flags[flag.path] = self.spelled.get(flag.name, flag.decls[0])
        for item in self.values.get("set") or []:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(
                    f"--set expects KEY=VALUE with a dotted key, e.g. "
                    f"--set scheduler.max_num_seqs=8; got {item!r}."
                )
            settings[key] = parse_text_value(key, raw)
            flags[key] = f"--set {item}"
        return settings, flags


def config_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give a typer command the shared options; it receives them as ``opts``.

    The wrapped function must have a parameter named ``opts``; the options appear in
    ``--help`` under a "Configuration" panel.
    """
    hints = typing.get_type_hints(fn, include_extras=True)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in inspect.signature(fn).parameters.values() if p.name != "opts"]
    shared = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=False if f.type is bool else None,
            annotation=Annotated[f.type, typer.Option(*f.decls, help=f.help, rich_help_panel=PANEL)],
        )
        for f in FLAGS
    ]
    short = [
        inspect.Parameter(
            f.short_name, inspect.Parameter.KEYWORD_ONLY, default=None,
            annotation=Annotated[f.type, typer.Option(
                f.short, help=f"Short for {f.decls[0]}.", rich_help_panel=PANEL)],
        )
        for f in FLAGS if f.short is not None
    ]
    params = own + shared + short

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        values = {f.name: kwargs.pop(f.name) for f in FLAGS}
        spelled = {}
        for f in FLAGS:
            given = kwargs.pop(f.short_name) if f.short is not None else None
            if given is not None and values[f.name] is None:
                values[f.name] = given
                spelled[f.name] = f.short or ""
        return fn(*args, opts=ConfigOptions(values, spelled), **kwargs)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def build_config(opts: ConfigOptions, env: Mapping[str, str] | None = None
                 ) -> tuple[LMKitConfig, dict[str, str]]:
    """The effective config for ``opts`` (file, then ``env`` or ``os.environ``, then flags),
    and the layer that set each value (see :func:`lmkit.config.load_config`)."""
    settings, flags = opts.cli_settings()
    return load_config(opts.config_file, settings, env, cli_flags=flags)


def build_host(config: LMKitConfig, env: Mapping[str, str] | None = None) -> PluginHost:
    """The plugin host for ``config``: built-ins, entry points, then ``config.plugins``
    (``-p`` flags and the file's ``plugins:`` list). A named plugin that fails raises
    :class:`lmkit.errors.PluginLoadError`."""
    return PluginHost.load(plugins=config.plugins, env=env)

"""``lmkit bench throughput|latency``: lmkit beside a peer engine on one workload."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lmkit.cli.options import ConfigOptions, build_config, config_options

bench_app = typer.Typer(help="Benchmarks, run side by side with a peer engine.",
                        no_args_is_help=True)
WORKLOAD = "Workload"


WORKLOADS = ("chat", "copy", "random", "file")


def _check_args(workload: str, num_prompts: int, dataset: Path | None, peer: str,
                out: Path | None) -> None:
    """Refuse bad workload flags before any model is fetched or run."""
    from lmkit.benchmarking.offline import PEERS
    from lmkit.errors import ConfigError

    if workload not in WORKLOADS:
        raise ConfigError(f"--workload {workload!r} is unknown; use one of: "
                          f"{', '.join(WORKLOADS)}.")
    if workload == "file" and dataset is None:
        raise ConfigError("--workload file needs --dataset PATH (a JSON lines file).")
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1, got {num_prompts}.")
    if peer not in PEERS:
        raise ConfigError(f"--peer {peer!r} is unknown; use one of: {', '.join(PEERS)}.")
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise ConfigError(f"--out {out}: give a file path in an existing folder (the report "
                          "is written there after the run).")


def _setup(opts: ConfigOptions, threads: int | None):
    from lmkit.benchmarking.offline import BenchSetup
    from lmkit.cli.generate import status
    from lmkit.cli.options import build_host
    from lmkit.loading.resolve import resolve_model
    from lmkit.plugin_host.resolve import resolve_device

    config, provenance = build_config(opts)
    host = build_host(config)
    status(f"resolving {config.model.model} ...")
    cache = Path(config.model.cache_dir) if config.model.cache_dir else None
    model_dir = resolve_model(config.model.model, host, cache, source=config.model.source,
                              weights=config.model.load_format != "dummy")
    device, dtype = resolve_device(config)
    # engine options: every setting not left at its default (the model is passed apart)
    options = {path: _get(config, path) for path, layer in provenance.items()
               if layer != "default" and path not in ("model.model", "plugins")}
    if config.plugins:
        options["plugins"] = list(config.plugins)
    return BenchSetup(config.model.model, str(model_dir), options, dtype, device, threads), host


def _get(config, path: str):
    node = config
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _workload(setup, kind: str, num_prompts: int, input_len: str, output_len: str, seed: int,
              dataset: Path | None):
    from lmkit.benchmarking.offline import make_workload
    from lmkit.benchmarking.workload import parse_length_range
    from lmkit.errors import ConfigError
    from lmkit.loading.tokenizer import load_tokenizer
    from lmkit.loading.weights import load_hf_config

    tokenizer = load_tokenizer(Path(setup.model_dir), setup.options.get("model.tokenizer"))
    vocab = load_hf_config(Path(setup.model_dir)).vocab_size
    try:
        return make_workload(kind, tokenizer, vocab, num_prompts, parse_length_range(input_len),
                             parse_length_range(output_len), seed, dataset)
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read workload file {dataset}: it is not UTF-8 text ({e})") from e


def _finish(report, out: Path | None) -> None:
    from lmkit.benchmarking.offline import format_report, save_report
    from lmkit.cli.render import print_text

    print_text(format_report(report))
    if out is not None:
        save_report(report, out)


Workload = Annotated[str, typer.Option(help="chat (built-in prompts), copy (repeat a passage), random "
                                       "(token ids) or file.",
                                       rich_help_panel=WORKLOAD)]
NumPrompts = Annotated[int, typer.Option(help="Requests in the workload.", rich_help_panel=WORKLOAD)]
InputLen = Annotated[str, typer.Option(help="Prompt length N or LOW:HIGH (random workload).",
                                       rich_help_panel=WORKLOAD)]
OutputLen = Annotated[str, typer.Option(help="Output length N or LOW:HIGH (EOS ignored).",
                                        rich_help_panel=WORKLOAD)]
Seed = Annotated[int, typer.Option(help="Workload seed.", rich_help_panel=WORKLOAD)]
Dataset = Annotated[Path | None, typer.Option(help="JSON lines file for --workload file.",
                                              rich_help_panel=WORKLOAD)]
Peer = Annotated[str, typer.Option(help="Peer engine run on the same workload: hf, llamacpp "
                                   "(the model's GGUF file) or none.")]
Threads = Annotated[int | None, typer.Option(help="torch CPU threads for both sides.")]
Out = Annotated[Path | None, typer.Option("--out", help="Write the JSON report here.")]
Rounds = Annotated[int, typer.Option(
    min=1, help="Run both sides this many times, alternating which goes first; report the "
                "median round's ratio (for machines whose speed drifts).")]


@bench_app.command("throughput")
@config_options
def throughput(opts: ConfigOptions, workload: Workload = "chat", num_prompts: NumPrompts = 32,
               input_len: InputLen = "128", output_len: OutputLen = "64", seed: Seed = 0,
               dataset: Dataset = None, peer: Peer = "hf", hf_batch_size: Annotated[
                   int | None, typer.Option(help="HF static batch size (default: all).")] = None,
               threads: Threads = None, rounds: Rounds = 1, out: Out = None) -> None:
    """Offline throughput: every request submitted at once (requests/s, tokens/s, memory)."""
    from lmkit.benchmarking import offline
    from lmkit.cli.generate import status

    _check_args(workload, num_prompts, dataset, peer, out)
    setup, _ = _setup(opts, threads)
    wl = _workload(setup, workload, num_prompts, input_len, output_len, seed, dataset)
    status(f"{wl.describe()}; running lmkit" + (f" then {peer}" if peer != "none" else ""))
    _finish(offline.throughput(setup, wl, peer, hf_batch_size, rounds), out)


@bench_app.command("latency")
@config_options
def latency(opts: ConfigOptions, workload: Workload = "chat", num_prompts: NumPrompts = 4,
            input_len: InputLen = "128", output_len: OutputLen = "64", seed: Seed = 0,
            dataset: Dataset = None, peer: Peer = "hf", threads: Threads = None,
            rounds: Rounds = 1, out: Out = None) -> None:
    """Single-stream decode: one request at a time (TTFT, time per output token, tokens/s)."""
    from lmkit.benchmarking import offline
    from lmkit.cli.generate import status

    _check_args(workload, num_prompts, dataset, peer, out)
    setup, _ = _setup(opts, threads)
    wl = _workload(setup, workload, num_prompts, input_len, output_len, seed, dataset)
    status(f"{wl.describe()}; running lmkit" + (f" then {peer}" if peer != "none" else ""))
    _finish(offline.latency(setup, wl, peer, rounds), out)


def register(app: typer.Typer) -> None:
    from lmkit.cli.bench_serve import register as register_serve

    register_serve(bench_app)
    app.add_typer(bench_app, name="bench")

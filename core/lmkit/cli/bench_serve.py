"""``lmkit bench serve``: benchmark a running lmkit (or any OpenAI-compatible) server.

Attached to the ``bench`` group by :func:`register`. The workload's prompts are token
ids; for the ``chat`` and ``file`` workloads the tokenizer comes from the server's model
directory (``GET /v1/lmkit/stack``), which must be readable from this machine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from lmkit.errors import ConfigError

PANEL = "Workload"


def _server_dirs(url: str, api_key: str | None) -> tuple[Path, Path] | None:
    """The served model's directory and its tokenizer's (``GET /v1/lmkit/stack``), when
    this machine can read them."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url}/v1/lmkit/stack", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach the server at {url}: {e}; start one with "
                          "`lmkit serve` or pass --url") from e
    if resp.status_code != 200:
        return None
    body = resp.json()
    path = Path(body.get("model_dir", ""))
    if not (path / "config.json").is_file():
        return None
    return path, Path(body.get("tokenizer_dir") or path)


def _workload(url: str, api_key: str | None, kind: str, num_prompts: int, input_len: str,
              output_len: str, seed: int, dataset: Path | None) -> Any:
    from lmkit.benchmarking.offline import make_workload
    from lmkit.benchmarking.workload import parse_length_range

    dirs = _server_dirs(url, api_key)
    tokenizer, vocab = None, 32000
    if dirs is not None:
        from lmkit.loading.tokenizer import load_tokenizer
        from lmkit.loading.weights import load_hf_config

        model_dir, tokenizer_dir = dirs
        tokenizer = load_tokenizer(model_dir, tokenizer_dir)
        vocab = int(load_hf_config(model_dir).vocab_size)
    elif kind != "random":
        raise ConfigError(f"the {kind} workload needs the server's tokenizer, but its model "
                          "directory is not readable here; use --workload random")
    try:
        return make_workload(kind, tokenizer, vocab, num_prompts, parse_length_range(input_len),
                             parse_length_range(output_len), seed, dataset)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def bench_serve(
    url: Annotated[str, typer.Option(help="Server base URL.")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Bearer key (default: LMKIT_API_KEY).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name (default: the server's).")] = None,
    workload: Annotated[str, typer.Option(help="random (token ids), chat (built-in prompts) "
                                          "or file.", rich_help_panel=PANEL)] = "random",
    num_prompts: Annotated[int, typer.Option(help="Requests per run.",
                                             rich_help_panel=PANEL)] = 64,
    input_len: Annotated[str, typer.Option(help="Prompt length N or LOW:HIGH (random).",
                                           rich_help_panel=PANEL)] = "128",
    output_len: Annotated[str, typer.Option(help="Output length N or LOW:HIGH (EOS ignored).",
                                            rich_help_panel=PANEL)] = "64",
    seed: Annotated[int, typer.Option(help="Workload and arrival seed.",
                                      rich_help_panel=PANEL)] = 0,
    dataset: Annotated[Path | None, typer.Option(help="JSON lines file for --workload file.",
                                                 rich_help_panel=PANEL)] = None,
    concurrency: Annotated[list[int] | None, typer.Option(
        "--concurrency", help="Closed-loop clients; repeat for a sweep.")] = None,
    request_rate: Annotated[list[float] | None, typer.Option(
        "--request-rate", help="Poisson arrival rate in requests/s ('inf': all at once); "
        "repeat for a sweep.")] = None,
    max_concurrency: Annotated[int | None, typer.Option(
        help="Cap on requests in flight for --request-rate runs.")] = None,
    client_procs: Annotated[int, typer.Option(
        "--client-procs", min=1, help="Send each run from this many processes (one Python "
        "process reads about 10k streamed tokens/s; the report flags a saturated "
        "client).")] = 1,
    out: Annotated[Path | None, typer.Option("--out", help="Write the JSON report here.")] = None,
) -> None:
    """Online serving benchmark: TTFT, TPOT, ITL (mean/p50/p99), throughput, errors."""
    from lmkit.benchmarking.serve import format_serve_report, run_serve_bench
    from lmkit.cli.render import print_text

    url = url.rstrip("/")
    api_key = api_key or os.environ.get("LMKIT_API_KEY")
    wl = _workload(url, api_key, workload, num_prompts, input_len, output_len, seed, dataset)
    print_text(f"{wl.describe()}; against {url}")
    report = run_serve_bench(url, wl, concurrency=concurrency or (), request_rates=request_rate
                             or (), max_concurrency=max_concurrency, api_key=api_key,
                             model=model, seed=seed, client_procs=client_procs)
    print_text(format_serve_report(report))
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")


def register(bench_app: typer.Typer) -> None:
    """Add ``serve`` to the ``lmkit bench`` group."""
    bench_app.command("serve")(bench_serve)

"""``lmkit serve [MODEL]``: the OpenAI-compatible server.

Takes the shared configuration options (``--config``, ``--attention``, ``--speculative``, ...) plus
the server's own (``--host``, ``--port``, ``--api-key-file``, ...); ``LMKIT_API_KEY`` is
read when no key is given. Checks the plugin stack as ``lmkit config check`` does (exit
2 when it cannot run), starts and warms up the engine, and only then binds the port and
prints the stack, the KV pool's size and the URL. SIGINT/SIGTERM drain requests in
flight and stop the engine.
"""

from __future__ import annotations

import math
import os
from typing import Annotated, Any

import typer

from lmkit.cli.options import ConfigOptions, build_config, build_host, config_options
from lmkit.errors import ConfigError

SERVER_PANEL = "Server"
# uvicorn's log levels (uvicorn.config.LOG_LEVELS)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# server setting -> the flag of lmkit serve that sets it
SERVER_FLAGS = {"host": "--host", "port": "--port", "api_key": "--api-key",
                "api_key_file": "--api-key-file", "served_model_name": "--served-model-name",
                "cors_origins": "--cors-origin", "max_queued_requests": "--max-queued-requests"}


def _check_run_options(log_level: str, shutdown_timeout: float) -> str:
    """The log level as uvicorn names it; refuse what uvicorn would fail on only after
    the model has loaded."""
    if log_level.lower() not in LOG_LEVELS:
        raise ConfigError(f"--log-level {log_level!r} is not a log level; use one of: "
                          f"{', '.join(LOG_LEVELS)}.")
    if not (math.isfinite(shutdown_timeout) and shutdown_timeout >= 0):
        raise ConfigError(f"--shutdown-timeout must be a finite number of seconds >= 0, "
                          f"got {shutdown_timeout}.")
    return log_level.lower()


def _with_server_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """``config`` with the server flags applied; an invalid one names its flag."""
    from pydantic import ValidationError

    from lmkit.config.errors import format_validation_error
    from lmkit.config.schema import LMKitConfig

    data = config.model_dump()
    data["server"].update(overrides)

    def origin(path: str) -> str | None:
        key = path.removeprefix("server.").split(".")[0]
        return f"command-line option {SERVER_FLAGS[key]}" if key in SERVER_FLAGS \
            and key in overrides else None

    try:
        return LMKitConfig.model_validate(data)
    except ValidationError as e:
        details = format_validation_error(e, model=LMKitConfig, origin=origin)
        raise ConfigError("invalid server option:\n  " + details.replace("\n", "\n  ")) from None


def _server_overrides(host: str | None, port: int | None, api_key: str | None,
                      api_key_file: str | None, served_model_name: str | None,
                      cors_origin: list[str] | None,
                      max_queued_requests: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if host is not None:
        out["host"] = host
    if port is not None:
        out["port"] = port
    if api_key is not None and api_key_file is not None:
        raise ConfigError("--api-key and --api-key-file are both given; give the key one way")
    if api_key is not None:  # a flag replaces a key set in the file or environment
        out.update(api_key=api_key, api_key_file=None)
    if api_key_file is not None:
        out.update(api_key=None, api_key_file=api_key_file)
    if served_model_name is not None:
        out["served_model_name"] = served_model_name
    if cors_origin:
        out["cors_origins"] = list(cors_origin)
    if max_queued_requests is not None:
        out["max_queued_requests"] = max_queued_requests
    return out


def _print_ready(llm: Any, url: str, api_key: bool) -> None:
    from lmkit.cli.render import print_table, print_text

    ready = llm.ready
    rows = []
    for kind, entry in ready.stack.get("stack", {}).items():
        if entry is None:
            rows.append((kind, "none", "-", "-"))
        else:
            rows.append((kind, entry["name"], entry["plugin"], entry.get("version") or "-"))
    print_table(f"lmkit serving {ready.model_dir} on {ready.stack.get('device')} "
                f"({ready.stack.get('dtype')}), context {ready.max_model_len}",
                ("kind", "backend", "plugin", "version"), rows)
    kv_bytes, num_blocks = ready.stats.get("kv_cache_bytes"), ready.stats.get("num_blocks")
    if kv_bytes is not None and num_blocks is not None:
        block_size = llm.config.cache.block_size
        each = f" per engine, {llm.num_engines} engines (data parallel)" \
            if llm.num_engines > 1 else ""
        fp8 = ", float8 e4m3" if llm.config.cache.fp8_kv_cache else ""
        print_text(f"KV cache: {kv_bytes / 2**30:.2f} GiB{fp8}, {int(num_blocks)} blocks of "
                   f"{block_size} tokens ({int(num_blocks) * block_size} tokens){each}")
    print_text(f"OpenAI-compatible API at {url}/v1"
               + ("  (API key required)" if api_key else ""), style="bold green")
    print_text(f"health {url}/health  metrics {url}/metrics  stack {url}/v1/lmkit/stack")


@config_options
def serve(
    model_arg: Annotated[str | None, typer.Argument(
        metavar="MODEL", help="Model alias, local path, GGUF file or hub id "
        "(default: the configured model, smollm2-135m-instruct).")] = None,
    *,
    opts: ConfigOptions,
    host: Annotated[str | None, typer.Option(
        "--host", help="Bind address (default 127.0.0.1: this machine only).",
        rich_help_panel=SERVER_PANEL)] = None,
    port: Annotated[int | None, typer.Option(
        "--port", help="Port (default 8000; 0 picks a free one).",
        rich_help_panel=SERVER_PANEL)] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="Require 'Authorization: Bearer KEY' on every route but /health. "
        "Other local users can read it in `ps`: prefer LMKIT_API_KEY or --api-key-file.",
        rich_help_panel=SERVER_PANEL)] = None,
    api_key_file: Annotated[str | None, typer.Option(
        "--api-key-file", help="Read the API key from the first line of this file (keep it "
        "mode 600).", rich_help_panel=SERVER_PANEL)] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The model name clients use (default: MODEL).",
        rich_help_panel=SERVER_PANEL)] = None,
    cors_origin: Annotated[list[str] | None, typer.Option(
        "--cors-origin", help="Allow browser requests from this origin. Repeatable; CORS is "
        "off by default.", rich_help_panel=SERVER_PANEL)] = None,
    max_queued_requests: Annotated[int | None, typer.Option(
        "--max-queued-requests", help="Requests allowed to wait beyond --max-num-seqs before "
        "the server answers 429.", rich_help_panel=SERVER_PANEL)] = None,
    shutdown_timeout: Annotated[float, typer.Option(
        "--shutdown-timeout", help="Seconds SIGTERM waits for requests in flight.",
        rich_help_panel=SERVER_PANEL)] = 30.0,
    log_level: Annotated[str, typer.Option(
        "--log-level", help="uvicorn log level.", rich_help_panel=SERVER_PANEL)] = "info",
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from lmkit.cli.render import stderr
    from lmkit.plugin_host.resolve import configure_and_resolve
    from lmkit.serve.auth import load_api_key
    from lmkit.serve.server import run_server

    log_level = _check_run_options(log_level, shutdown_timeout)
    if model_arg is not None:
        if opts.values.get("model") not in (None, model_arg):
            raise ConfigError(f"the model is given twice ({model_arg!r} and --model "
                              f"{opts.values['model']!r}); give it once.")
        opts = ConfigOptions({**opts.values, "model": model_arg})
    if api_key is not None:
        stderr().print("warning: --api-key on the command line is visible to other local "
                       "users (ps, /proc); set LMKIT_API_KEY or use --api-key-file instead",
                       style="yellow", soft_wrap=True)
    config, _ = build_config(opts)
    # what `lmkit config check` checks: a stack that cannot run fails here (exit 2),
    # before any model is fetched or port bound
    configure_and_resolve(config, build_host(config))
    overrides = _server_overrides(host, port, api_key, api_key_file, served_model_name,
                                  cors_origin, max_queued_requests)
    if not ("api_key" in overrides or config.server.api_key or config.server.api_key_file
            ) and os.environ.get("LMKIT_API_KEY"):
        overrides["api_key"] = os.environ["LMKIT_API_KEY"]
    if overrides:
        config = _with_server_overrides(config, overrides)
    has_key = load_api_key(config.server) is not None  # a bad key file fails here too
    run_server(config, log_level=log_level, shutdown_timeout=shutdown_timeout,
               on_ready=lambda llm, url: _print_ready(llm, url, has_key))


def register(app: typer.Typer) -> None:
    """Add ``lmkit serve`` to the root app."""
    app.command("serve")(serve)

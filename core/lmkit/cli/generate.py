"""``lmkit generate "PROMPT"``: one completion, streamed to stdout as it is generated."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from lmkit.cli.options import ConfigOptions, build_config, config_options
from lmkit.errors import ConfigError

SAMPLING = "Sampling"


def sampling_params(max_tokens: int, temperature: float, top_p: float, top_k: int,
                    seed: int | None, stop: list[str] | None,
                    json_schema: Path | None = None) -> Any:
    from lmkit import SamplingParams

    structured = None
    if json_schema is not None:
        try:
            structured = {"json": json.loads(Path(json_schema).read_text(encoding="utf-8"))}
        except (OSError, ValueError) as e:  # ValueError: not UTF-8 text, or not JSON
            raise ConfigError(f"--json-schema {json_schema}: cannot read a JSON schema ({e})") from e
        if not isinstance(structured["json"], (dict, bool)):
            raise ConfigError(f"--json-schema {json_schema}: a JSON schema is an object "
                              f"({{\"type\": ...}}), not a {type(structured['json']).__name__}")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed, stop=list(stop or []),
                          structured_outputs=structured)


def status(text: str) -> None:
    """A dim status line on stderr, so that stdout carries only generated text."""
    from rich.text import Text

    from lmkit.cli.render import stderr

    stderr().print(Text(text, style="dim"), soft_wrap=True)


def open_llm(opts: ConfigOptions, model: str | None) -> Any:
    """Build the config from the shared options and load the engine, with progress."""
    from lmkit.frontend.llm import LLM

    config, _ = build_config(opts)
    if model is not None:
        config = config.model_copy(update={"model": config.model.model_copy(update={"model": model})})
    status(f"loading {config.model.model} ...")
    return LLM(config=config, progress=True)


@config_options
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt ('-' reads standard input).")],
    opts: ConfigOptions,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.",
                                            rich_help_panel=SAMPLING)] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy.", rich_help_panel=SAMPLING)] = 0.7,
    top_p: Annotated[float, typer.Option(rich_help_panel=SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(rich_help_panel=SAMPLING)] = 0,
    seed: Annotated[int | None, typer.Option(rich_help_panel=SAMPLING)] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).",
                                                   rich_help_panel=SAMPLING)] = None,
    json_schema: Annotated[Path | None, typer.Option(
        help="Constrain the output to this JSON schema file.", rich_help_panel=SAMPLING)] = None,
    raw: Annotated[bool, typer.Option(
        "--raw", help="Send the prompt as-is instead of as a chat message.")] = False,
) -> None:
    """Generate one completion for PROMPT and stream it to stdout.

    The prompt is sent as a chat message through the model's chat template unless
    --raw is given or the model has no template.
    """
    if prompt == "-":
        prompt = sys.stdin.read()
    params = sampling_params(max_tokens, temperature, top_p, top_k, seed, stop, json_schema)
    llm = open_llm(opts, None)
    try:
        use_chat = not raw and getattr(llm.tokenizer, "chat_template", None)
        messages = [{"role": "user", "content": prompt}] if use_chat else None
        stream = llm.stream(None if use_chat else prompt, params, messages=messages)
        last = None
        for out in stream:
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            last = out
        sys.stdout.write("\n")
        if last is not None:
            c = last.outputs[0]
            status(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    finally:
        llm.shutdown()


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)

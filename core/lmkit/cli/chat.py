"""``lmkit chat``: an interactive conversation, answers streamed as they are generated."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lmkit.cli.generate import SAMPLING, open_llm, sampling_params
from lmkit.cli.options import ConfigOptions, config_options

HELP_TEXT = "Type a message and press Enter. /reset clears the conversation, /exit quits."


@config_options
def chat(
    opts: ConfigOptions,
    system: Annotated[str | None, typer.Option(help="A system prompt.")] = None,
    max_tokens: Annotated[int, typer.Option(rich_help_panel=SAMPLING)] = 512,
    temperature: Annotated[float, typer.Option(rich_help_panel=SAMPLING)] = 0.7,
    top_p: Annotated[float, typer.Option(rich_help_panel=SAMPLING)] = 0.95,
    seed: Annotated[int | None, typer.Option(rich_help_panel=SAMPLING)] = None,
) -> None:
    """Chat with the model in the terminal (reads lines from standard input)."""
    from lmkit.cli.render import print_text

    params = sampling_params(max_tokens, temperature, top_p, 0, seed, None)
    llm = open_llm(opts, None)
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print_text(HELP_TEXT, style="dim")
    try:
        while True:
            if interactive:
                sys.stdout.write("\n> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = history[:1] if system else []
                print_text("(conversation cleared)", style="dim")
                continue
            history.append({"role": "user", "content": text})
            answer = []
            for out in llm.stream(None, params, messages=history):
                delta = out.outputs[0].delta_text
                answer.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(answer)})
    except KeyboardInterrupt:
        sys.stdout.write("\n")
    finally:
        llm.shutdown()


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)

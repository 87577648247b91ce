"""``lmkit serve`` with speculative decoding, end to end over HTTP: the server starts with a
proposer (``--speculative eagle3 --speculative-model HEAD`` by default, any
``--attention``), the OpenAI client sends its requests unchanged -- each prompt greedy,
once whole and once streamed -- and ``/metrics`` must show the proposer at work: drafted
and accepted tokens, the mean accepted length and the acceptance rate of every draft
position. Prints a JSON report (``--out`` writes it); the exit status is 1 when a check
fails (an empty answer, a streamed answer unlike the whole one, no draft proposed, a
metric missing), so the same command is the serving check of a GPU session::

    python bench/serve_spec_check.py --model smol.gguf --speculative-model HEAD \\
        --attention flashinfer                # on a GPU; then --attention triton
    python bench/serve_spec_check.py --model smol.gguf --speculative-model HEAD \\
        --device cpu --dtype float32          # on the CPU

``--api completions`` sends the prompts as text to ``/v1/completions`` (a model without
a chat template); ``--server-arg`` passes more options to ``lmkit serve``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_peers import stop_server, wait_ready  # noqa: E402

#: the speculative metrics the check requires (``/metrics`` names, docs/speculative-decoding.md)
REQUIRED = ("lmkit_spec_decode_num_draft_tokens_total",
            "lmkit_spec_decode_num_accepted_tokens_total",
            "lmkit_spec_decode_mean_accepted_length")
PER_POSITION = "lmkit_spec_decode_acceptance_rate_per_position"


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """The ``lmkit serve`` command line of the check."""
    cmd = [sys.executable, "-m", "lmkit.cli.main", "serve", "--model", args.model,
           "--port", str(port), "--speculative", args.speculative,
           "--num-speculative-tokens", str(args.spec_tokens)]
    if args.speculative_model:
        cmd += ["--speculative-model", args.speculative_model]
    for flag in ("attention", "device", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    return cmd + list(args.server_arg)


def spec_metrics(text: str) -> dict[str, Any]:
    """The ``lmkit_spec_decode_*`` samples of a Prometheus exposition (parsed by
    ``prometheus_client``): name -> value, the per-position rate as ``{position: value}``
    (samples of several engines summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("lmkit_spec_decode_"):
                continue
            if sample.name == PER_POSITION:
                if "position" in sample.labels:
                    out.setdefault(PER_POSITION, {})[int(sample.labels["position"])] = sample.value
            else:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def failures(answers: list[dict[str, Any]], metrics: dict[str, Any], k: int) -> list[str]:
    """What the check finds wrong (empty: it passed)."""
    bad = [f"prompt {i}: empty answer" for i, a in enumerate(answers) if not a["whole"]]
    bad += [f"prompt {i}: the streamed answer differs from the whole one"
            for i, a in enumerate(answers) if a["whole"] != a["streamed"]]
    bad += [f"/metrics lacks {name}" for name in REQUIRED if name not in metrics]
    if metrics.get(REQUIRED[0], 0) <= 0:
        bad.append("no draft token was proposed")
    positions = metrics.get(PER_POSITION, {})
    bad += [f"/metrics lacks {PER_POSITION}{{position=\"{j}\"}}" for j in range(k)
            if j not in positions]
    if metrics.get(REQUIRED[2], 0) < 1:
        bad.append("the mean accepted length is below 1")
    return bad


def ask(client: Any, model: str, api: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy request whole and streamed: both texts and the whole one's usage."""
    if api == "chat":
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}],
                  max_tokens=max_tokens, temperature=0)
        whole = client.chat.completions.create(**kw)
        text = whole.choices[0].message.content or ""
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(**kw, stream=True) if c.choices)
    else:
        kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        whole = client.completions.create(**kw)
        text = whole.choices[0].text
        streamed = "".join(c.choices[0].text for c in
                           client.completions.create(**kw, stream=True) if c.choices)
    return {"prompt": prompt, "whole": text, "streamed": streamed,
            "completion_tokens": whole.usage.completion_tokens if whole.usage else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--speculative", default="eagle3")
    ap.add_argument("--speculative-model")
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--attention")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--api", choices=("chat", "completions"), default="chat")
    ap.add_argument("--prompts", type=int, default=4, help="built-in chat prompts sent")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the server to start")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more argument for lmkit serve (repeat it)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1 or args.spec_tokens < 1:
        ap.error("--prompts, --max-tokens and --spec-tokens must be at least 1")
    import httpx
    import openai
    from lmkit.api import CHAT_PROMPTS

    url = f"http://127.0.0.1:{args.port}"
    cmd = server_command(args, args.port)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        started = wait_ready(url, proc, args.timeout)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        t0 = time.perf_counter()
        answers = [ask(client, model, args.api, CHAT_PROMPTS[i % len(CHAT_PROMPTS)],
                       args.max_tokens) for i in range(args.prompts)]
        elapsed = time.perf_counter() - t0
        metrics = spec_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    finally:
        stop_server(proc)
    bad = failures(answers, metrics, args.spec_tokens)
    report = {"command": cmd, "startup_s": started, "requests_s": elapsed, "model": model,
              "answers": answers, "metrics": metrics, "failures": bad}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    print("serve check: " + ("passed" if not bad else "FAILED: " + "; ".join(bad)),
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

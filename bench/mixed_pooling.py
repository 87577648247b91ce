"""Generation latency beside a stream of embedding requests, against generation alone::

    OMP_NUM_THREADS=2 python bench/mixed_pooling.py --streams 4 --tokens 64 --out mixed.json
    python bench/mixed_pooling.py --device cuda --model bench:qwen3-0.6b \\
        --embed-model minilm --streams 16 --tokens 128 --out mixed_h100.json

Each run generates ``--streams`` greedy completions of ``--tokens`` tokens and times
every engine step while generating (the inter-token latency of every stream). Two kinds
of embedding stream:

* ``--embed-model same`` (the default): the generation engine embeds too (its model
  pooling its last token): ``--embed-per-step`` requests are queued before every engine
  step, so pooling prompts share the steps with the decodes.
* ``--embed-model MODEL``: a second engine in its own process on the same device embeds
  batches of ``--embed-batch`` texts back to back while the mixed run generates (two
  servers sharing one GPU or one CPU). ``minilm`` is all-minilm-l6-v2 when it is in
  lmkit's cache, else a random BERT of its shape (``random-minilm``: 6 layers, 384
  wide, 12 heads, a word-level tokenizer over the benchmark's words, so texts are as
  many tokens as MiniLM makes of them); ``random-bert-tiny`` is a 2-layer, 64-wide one
  for checking the plumbing.

``--model bench:NAME`` writes a random model of a real shape from
``bench/gpu_bench_models.py`` (``qwen3-0.6b``, ``llama-3.1-8b``, ``tiny-qwen3``, ...)
into ``--workdir`` (no hub access). Reported per run: the median and p90 step time,
end-to-end seconds and the embeddings finished (texts/s); alone and mixed runs alternate
(``--rounds``), so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from embeddings import WORDS, make_texts  # noqa: E402

# random BERTs: name -> (hidden, layers, heads, intermediate)
BERT_SHAPES = {"random-minilm": (384, 6, 12, 1536), "random-bert-tiny": (64, 2, 4, 128)}


def write_random_bert(name: str, directory: Path) -> Path:
    """A random ``BertModel`` of shape ``name`` (:data:`BERT_SHAPES`) with a word-level
    tokenizer (BERT's WordPiece over the benchmark's words, lower-cased), in
    ``directory``; reused when already written."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory = Path(directory) / name
    if (directory / "config.json").is_file():
        return directory
    hidden, layers, heads, inter = BERT_SHAPES[name]
    directory.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *sorted(set(WORDS))]
    vocab += [f"[unused{i}]" for i in range(30522 - len(vocab))]  # MiniLM's vocabulary size
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(str(directory / "vocab.txt")).save_pretrained(directory)
    config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=inter,
                        max_position_embeddings=512)
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(directory)
    return directory


def resolve_embed_model(name: str, workdir: Path) -> str:
    """The model reference the embedding engine loads (see the module docstring)."""
    if name in BERT_SHAPES:
        return str(write_random_bert(name, workdir))
    if name != "minilm":
        return name
    from lmkit.errors import ModelNotFoundError
    from lmkit.loading.cache import default_cache_dir
    from lmkit.loading.resolve import resolve_model
    from lmkit.plugin_host.manager import PluginHost

    try:
        return str(resolve_model("all-minilm-l6-v2", PluginHost.load(),
                                 cache_dir=default_cache_dir(), source="alias", progress=False))
    except ModelNotFoundError as exc:
        print(f"all-minilm-l6-v2 is not available here ({exc}); using random-minilm",
              file=sys.stderr)
        return str(write_random_bert("random-minilm", workdir))


def resolve_model_ref(name: str, workdir: Path) -> str:
    """``bench:NAME``: a random model of a real shape written into ``workdir``."""
    if not name.startswith("bench:"):
        return name
    from gpu_bench_models import write_model

    bench_name = name.removeprefix("bench:")
    return str(write_model(bench_name, Path(workdir) / bench_name))


def embedder(model: str, options: dict, texts: list[str], batch: int, threads: int,
             ready, go, stop, done) -> None:
    """The second engine's process: embed batches while ``go`` is set, until ``stop``;
    ``done`` (a shared counter) counts the texts embedded."""
    torch.set_num_threads(threads)
    from lmkit import LLM

    with LLM(model, progress=False, **options) as llm:
        llm.embed(texts[:batch])  # warm-up
        ready.set()
        i = 0
        while not stop.is_set():
            if not go.wait(timeout=0.05):
                continue
            llm.embed([texts[(i + j) % len(texts)] for j in range(batch)])
            i += batch
            with done.get_lock():
                done.value += batch


def run(llm, prompts, tokens: int, embed_per_step: int, texts: list[str],
        stream: dict | None = None) -> dict:
    """One generation run; ``stream``: the embedding process's events, set during it."""
    from lmkit import SamplingParams
    from lmkit.api import PoolingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    rids = [llm._submit(p, None, params) for p in prompts]
    pending = set(rids)
    steps: list[float] = []
    next_text = 0
    if stream is not None:
        before = stream["done"].value
        stream["go"].set()
        go_at = time.perf_counter()
        time.sleep(0.2)  # the stream is running when generation starts
    start = time.perf_counter()
    while pending:
        for _ in range(embed_per_step):
            llm.pooling.submit(f"e{time.monotonic_ns()}-{next_text}",
                               texts[next_text % len(texts)], PoolingParams())
            next_text += 1
        t = time.perf_counter()
        for out in llm._step():
            if out.finished:
                pending.discard(out.request_id)
        steps.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    embed_seconds = elapsed
    if stream is not None:
        next_text = stream["done"].value - before  # batches finished while go was set
        stream["go"].clear()
        embed_seconds = time.perf_counter() - go_at
    while llm.pooling.pending:  # let the last embeddings finish (not timed)
        llm._step()
    llm.pooling.results.clear()
    steps.sort()
    return {"median_step_ms": 1000 * statistics.median(steps),
            "p90_step_ms": 1000 * steps[int(0.9 * (len(steps) - 1))],
            "seconds": elapsed, "embeddings": next_text, "embed_seconds": embed_seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="generation model: an lmkit reference or bench:NAME")
    parser.add_argument("--embed-model", default="same",
                        help="same | minilm | random-minilm | random-bert-tiny | a reference")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--embed-per-step", type=int, default=2,
                        help="with --embed-model same: requests queued before every step")
    parser.add_argument("--embed-batch", type=int, default=64,
                        help="with a separate --embed-model: texts per LLM.embed call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--workdir", default="/tmp/lmkit-mixed-pooling",
                        help="where bench:NAME and random BERT models are written")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lmkit import LLM

    workdir = Path(args.workdir)
    separate = args.embed_model != "same"
    gen_options = {"device": args.device, "max_num_seqs": max(64, args.streams)}
    if separate:  # two engines share the device: leave the embedder room
        gen_options["gpu_memory_utilization"] = 0.5
    llm = LLM(resolve_model_ref(args.model, workdir), progress=False, **gen_options)
    texts = make_texts(256)
    stream = None
    if separate:
        ctx = mp.get_context("spawn")
        stream = {"ready": ctx.Event(), "go": ctx.Event(), "stop": ctx.Event(),
                  "done": ctx.Value("l", 0)}
        options = {"device": args.device, "gpu_memory_utilization": 0.85,
                   "max_num_seqs": args.embed_batch,
                   "max_num_batched_tokens": max(8192, 64 * args.embed_batch)}
        proc = ctx.Process(target=embedder, args=(
            resolve_embed_model(args.embed_model, workdir), options, texts, args.embed_batch,
            args.threads, stream["ready"], stream["go"], stream["stop"], stream["done"]))
        proc.start()
        while not stream["ready"].wait(timeout=1.0):
            if not proc.is_alive():
                raise RuntimeError(f"the embedding process exited ({proc.exitcode}) "
                                   "before it was ready; its error is above")
    prompts = [f"Write a short story about {w}." for w in ("a fox", "the sea", "a robot",
                                                              "a city", "rain", "a clock")]
    prompts = (prompts * args.streams)[:args.streams]
    embed_per_step = 0 if separate else args.embed_per_step
    run(llm, prompts, 8, embed_per_step, texts, stream)  # warm-up
    runs: dict[str, list[dict]] = {"alone": [], "mixed": []}
    try:
        for _ in range(args.rounds):
            runs["alone"].append(run(llm, prompts, args.tokens, 0, texts))
            runs["mixed"].append(run(llm, prompts, args.tokens, embed_per_step, texts,
                                     stream))
    finally:
        if stream is not None:
            stream["stop"].set()
            proc.join(timeout=60)
        llm.shutdown()
    summary = {k: {"median_step_ms": statistics.median(r["median_step_ms"] for r in v),
                   "p90_step_ms": statistics.median(r["p90_step_ms"] for r in v),
                   "embeddings_per_s": statistics.median(
                       r["embeddings"] / r["embed_seconds"] for r in v)}
               for k, v in runs.items()}
    device = (torch.cuda.get_device_name() if llm.engine.config.executor.device == "cuda"
              else "cpu")
    result = {"model": args.model, "embed_model": args.embed_model, "device": device,
              "streams": args.streams, "tokens": args.tokens,
              "embed_per_step": embed_per_step, "embed_batch": args.embed_batch,
              "threads": args.threads, "runs": runs, "summary": summary}
    print(json.dumps({"device": device, "summary": summary}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

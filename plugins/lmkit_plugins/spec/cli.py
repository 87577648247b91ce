"""``lmkit spec``: commands about speculative decoding (``train-eagle``, ``write-prompts``,
``fit-tree``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any


def register(app: Any) -> None:
    """Add the ``spec`` command group to the root app."""
    import typer

    spec = typer.Typer(help="Speculative decoding: make draft heads.", no_args_is_help=True)
    spec.command("train-eagle")(train_eagle)
    spec.command("write-prompts")(write_prompts)
    spec.command("fit-tree")(fit_tree)
    app.add_typer(spec, name="spec")


def train_eagle(
    model: Annotated[str, _arg("Target model: alias, local directory or hub id.")],
    out: Annotated[Path, _opt("--out", "Directory of the head (created; resumed when it "
                              "holds a run).")],
    max_steps: Annotated[int, _opt("--max-steps", "Optimizer steps in all.")] = 1000,
    device: Annotated[str, _opt("--device", "cpu or cuda (default: cuda when present).")] = "",
    prompts: Annotated[Path | None, _opt("--prompts", "JSONL prompt set, one {\"prompt\": "
                                         "...} per line (default: lmkit bench's chat prompts).")
                       ] = None,
    self_prompts: Annotated[int, _opt("--self-prompts", "Also train on N prompts the model "
                                      "writes itself (see write-prompts; kept in "
                                      "OUT/self_prompts.jsonl). Without --prompts, only "
                                      "on those.")] = 0,
    max_new_tokens: Annotated[int, _opt("--max-new-tokens", "Answer length per prompt.")] = 128,
    draft_vocab_size: Annotated[int, _opt("--draft-vocab-size", "Draft vocabulary size.")] = 32000,
    batch_size: Annotated[int, _opt("--batch-size", "Sequences per step.")] = 4,
    lr: Annotated[float, _opt("--lr", "AdamW learning rate.")] = 3e-4,
    lr_schedule: Annotated[str, _opt("--lr-schedule", "constant, or cosine: decayed to 0 at "
                                     "--max-steps.")] = "constant",
    warmup_steps: Annotated[int, _opt("--warmup-steps", "Steps of linear learning-rate "
                                      "warm-up.")] = 0,
    eval_prompts: Annotated[str | None, _opt("--eval-prompts", "Also measure draft accuracy "
                                             "at each checkpoint on the target's answers to "
                                             "this JSONL prompt set, or 'bench' (lmkit bench's "
                                             "chat prompts).")] = None,
    save_every: Annotated[int, _opt("--save-every", "Checkpoint every N steps.")] = 100,
    seed: Annotated[int, _opt("--seed", "Seed of the sequence sampling.")] = 0,
    feature_cache: Annotated[str, _opt("--feature-cache", "Where the target's features are "
                                       "cached, computed once: memory (up to "
                                       "--feature-cache-gb, else disk), disk (OUT/features, "
                                       "reused on resume) or off (the target runs every "
                                       "step).")] = "memory",
    feature_cache_gb: Annotated[float, _opt("--feature-cache-gb", "The most GiB of features "
                                            "kept in memory.")] = 8.0,
    feature_batch: Annotated[int, _opt("--feature-batch", "Sequences per forward of the "
                                       "target when computing features.")] = 16,
    holdout: Annotated[int | None, _opt("--holdout", "Sequences kept out of training to "
                                        "measure the head's draft accuracy at each "
                                        "checkpoint (default: 5% of a set of 100 or more, "
                                        "at most 100; 0: none).")] = None,
) -> None:
    """Train an EAGLE-3 head for MODEL from its own generations (self-distillation);
    use it with --speculative eagle3 --speculative-model OUT."""
    from lmkit.api import ConfigError

    from lmkit_plugins.spec.eagle_eval import report_line
    from lmkit_plugins.spec.eagle_features import CACHE_MODES
    from lmkit_plugins.spec.train_eagle import LR_SCHEDULES, train

    device = _device(device)
    for name, value in (("--max-steps", max_steps), ("--batch-size", batch_size),
                        ("--save-every", save_every), ("--max-new-tokens", max_new_tokens),
                        ("--draft-vocab-size", draft_vocab_size),
                        ("--feature-batch", feature_batch)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1 (got {value})")
    if self_prompts < 0:
        raise ConfigError(f"--self-prompts must be 0 or more (got {self_prompts})")
    if warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be 0 or more (got {warmup_steps})")
    if lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"--lr-schedule {lr_schedule!r}: use one of "
                          f"{', '.join(LR_SCHEDULES)}")
    if feature_cache not in CACHE_MODES:
        raise ConfigError(f"--feature-cache {feature_cache!r}: use one of "
                          f"{', '.join(CACHE_MODES)}")
    if not feature_cache_gb >= 0:  # nan too
        raise ConfigError(f"--feature-cache-gb must be 0 or more (got {feature_cache_gb})")
    if not 0 < lr < float("inf"):
        raise ConfigError(f"--lr must be a number above 0 (got {lr})")
    try:
        result = train(model, out, max_steps=max_steps, device=device, prompts=prompts,
                       max_new_tokens=max_new_tokens, draft_vocab_size=draft_vocab_size,
                       lr=lr, batch_size=batch_size, save_every=save_every, seed=seed,
                       feature_cache=feature_cache, feature_cache_gb=feature_cache_gb,
                       feature_batch=feature_batch, holdout=holdout,
                       lr_schedule=lr_schedule, warmup_steps=warmup_steps,
                       eval_prompts=eval_prompts, self_prompts=self_prompts)
    except (ValueError, OSError) as e:
        raise ConfigError(f"lmkit spec train-eagle: {e}") from e
    resumed = result["resumed_from"]
    # a run resumed at --max-steps trains nothing: no loss to show
    loss = f"loss {result['loss']:.4f}" if result["losses"] else "no step left to run"
    print(f"wrote {out} (step {result['step']}, {loss}"
          + (f", resumed from step {resumed}" if resumed is not None else "")
          + f", feature cache: {result['feature_cache']})")
    ev = result["eval"] or {}
    reports = [("held-out draft accuracy", ev)] if "accuracy" in ev else []
    if "eval_prompts" in ev:
        reports.append((f"draft accuracy on {ev['eval_prompts']['source']}", ev["eval_prompts"]))
    for what, report in reports:
        print(f"{what} ({report['sequences']} sequences): {report_line(report)}")


def write_prompts(
    model: Annotated[str, _arg("Chat model: alias, local directory or hub id.")],
    out: Annotated[Path, _opt("--out", "JSONL file to write, one {\"prompt\": ...} per line.")],
    count: Annotated[int, _opt("--count", "Prompts to write.")] = 1000,
    device: Annotated[str, _opt("--device", "cpu or cuda (default: cuda when present).")] = "",
    seed: Annotated[int, _opt("--seed", "Seed of the sampling (request i uses seed "
                              "* 1000003 + i).")] = 0,
    temperature: Annotated[float, _opt("--temperature", "Sampling temperature.")] = 1.0,
    top_p: Annotated[float, _opt("--top-p", "Nucleus sampling mass.")] = 1.0,
    max_tokens: Annotated[int, _opt("--max-tokens", "Longest prompt in tokens; longer "
                                    "ones are dropped.")] = 128,
    min_chars: Annotated[int, _opt("--min-chars", "Shortest prompt kept, in "
                                   "characters.")] = 12,
) -> None:
    """Write a chat prompt set sampled from MODEL itself (for train-eagle --prompts): the
    model continues its chat template's opening of a user turn; prompts it ended itself,
    new and not among lmkit bench's chat prompts, are kept."""
    from lmkit.api import ConfigError

    from lmkit_plugins.spec.self_prompts import write_jsonl
    from lmkit_plugins.spec.self_prompts import write_prompts as sample_prompts

    device = _device(device)
    for name, value in (("--count", count), ("--max-tokens", max_tokens)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1 (got {value})")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"--top-p must be in (0, 1] (got {top_p})")
    if not 0 < temperature < float("inf"):  # nan too
        raise ConfigError(f"--temperature must be above 0 and finite (got {temperature}): "
                          "greedy sampling writes one prompt")
    try:
        prompts = sample_prompts(model, count, device=device, seed=seed,
                                 temperature=temperature, top_p=top_p,
                                 max_tokens=max_tokens, min_chars=min_chars)
        write_jsonl(prompts, out)
    except (ValueError, OSError) as e:
        raise ConfigError(f"lmkit spec write-prompts: {e}") from e
    print(f"wrote {out} ({len(prompts)} prompts)")


def fit_tree(
    model: Annotated[str, _arg("Target model: alias, local directory or hub id.")],
    speculative_model: Annotated[Path, _opt("--speculative-model", "The EAGLE-3 head's "
                                            "directory (as train-eagle writes it).")],
    nodes: Annotated[int, _opt("--nodes", "Draft tokens in the tree (1 to 63).")] = 16,
    prompts: Annotated[str, _opt("--prompts", "JSONL prompt set like the traffic to serve, "
                                 "or 'bench' (lmkit bench's chat prompts).")] = "bench",
    count: Annotated[int, _opt("--count", "Prompts answered (at most).")] = 80,
    max_new_tokens: Annotated[int, _opt("--max-new-tokens", "Answer length per prompt.")] = 128,
    max_rank: Annotated[int, _opt("--max-rank", "Drafts a node may rank among its "
                                  "parent's children.")] = 8,
    depth: Annotated[int, _opt("--depth", "Deepest draft considered.")] = 6,
    device: Annotated[str, _opt("--device", "cpu or cuda (default: cuda when present).")] = "",
    seed: Annotated[int, _opt("--seed", "Seed of the halves the score is measured on.")] = 0,
    out: Annotated[Path | None, _opt("--out", "Also write the tree (JSON) to this file "
                                     "(--spec-tree takes the file).")] = None,
) -> None:
    """Fit a draft tree (speculative.tree) to an EAGLE-3 head: the NODES rank paths that
    accept the most of MODEL's own greedy answers to the prompts. Prints the tree as
    JSON for --spec-tree, and on stderr the tokens per step it accepts on half of the
    answers when fit on the other half, beside a chain as deep."""
    import json
    import sys

    from lmkit.api import ConfigError

    from lmkit_plugins.spec.train_eagle import load_prompts
    from lmkit_plugins.spec.tree_fit import check_head_dir
    from lmkit_plugins.spec.tree_fit import fit_tree as fit

    device = _device(device)
    for name, value, low, high in (("--nodes", nodes, 1, 63), ("--count", count, 1, None),
                                   ("--max-new-tokens", max_new_tokens, 1, None),
                                   ("--max-rank", max_rank, 1, None), ("--depth", depth, 1, 63)):
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
            raise ConfigError(f"{name} must be {bound} (got {value})")
    try:
        check_head_dir(speculative_model)
        texts = load_prompts(None if prompts == "bench" else Path(prompts))[:count]
        if not texts:
            raise ValueError(f"--prompts {prompts}: no prompts")
        result = fit(model, speculative_model, texts, nodes, max_new_tokens=max_new_tokens,
                     depth=depth, max_rank=max_rank, device=device, seed=seed)
        if not result["tree"]:
            raise ValueError("no answer position the head could draft; give more --prompts")
        if out is not None:
            out.write_text(json.dumps(result["tree"]) + "\n")
    except (ValueError, OSError) as e:
        raise ConfigError(f"lmkit spec fit-tree: {e}") from e
    print(json.dumps(result["tree"]))
    print(f"tree of {len(result['tree'])} nodes (depth {result['depth']}): "
          f"{result['held_tokens_per_step']:.3f} tokens per step on held-out answers, a "
          f"chain of {result['depth']} {result['chain']:.3f} ({result['answers']} answers, "
          f"{result['rows']} positions)", file=sys.stderr)


def _device(device: str) -> str:
    """``--device``: cpu or cuda, cuda by default when one is visible."""
    import torch
    from lmkit.api import ConfigError

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    return device


def _arg(help: str) -> Any:
    import typer

    return typer.Argument(help=help, show_default=False)


def _opt(flag: str, help: str) -> Any:
    import typer

    return typer.Option(flag, help=help)

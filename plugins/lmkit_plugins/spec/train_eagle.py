"""``lmkit spec train-eagle MODEL --out DIR``: train an EAGLE-3 head for ``MODEL`` by
self-distillation, in the checkpoint layout ``--speculative eagle3`` loads.

1. **Data**: the target generates greedy answers to a prompt set (the chat prompts of
   ``lmkit bench``, built in, or a JSONL file of ``{"prompt": ...}`` lines, and/or
   ``--self-prompts N`` prompts the target writes itself, kept in
   ``DIR/self_prompts.jsonl``: :mod:`lmkit_plugins.spec.self_prompts`) with lmkit
   itself; the token sequences are kept in ``DIR/train_data.pt``.
2. **Features**: the target (transformers) runs over the training sequences, several
   per forward (``--feature-batch``), giving the inputs of the three tapped layers
   (``[2, L // 2, L - 3]``) and its final hidden states (its logits over the draft
   vocabulary follow from them). By default it runs once, before training, into a
   feature cache (:mod:`lmkit_plugins.spec.eagle_features`): in memory up to
   ``--feature-cache-gb``, else memory-mapped files under ``DIR/features`` (reused
   when the run resumes; ``--feature-cache disk`` always writes them); training steps
   read the cache. ``--feature-cache off`` runs the target over each step's sequences
   instead (the same losses: the cache holds exactly what that forward returns).
3. **Objective**: at every answer position ``p`` the head, given the token at ``p + 1``
   and the fused features at ``p``, is trained to the target's distribution of the
   token at ``p + 2`` (cross-entropy against the target's probabilities restricted to
   the draft vocabulary: its ``draft_vocab_size`` most frequent tokens in the data; the
   prompt is context only, since serving never drafts inside it), and so are
   ``ttt_steps - 1`` unrolled draft steps that read the head's own outputs as drafting
   does (EAGLE-3's training-time test, weighted ``0.8 ** step``; the tokens are the
   data's, not the drafts).
   AdamW at ``--lr``, constant or (``--lr-schedule cosine``) decayed to zero at
   ``--max-steps``, after ``--warmup-steps`` of linear warm-up.
4. **Checkpoints**: every ``--save-every`` steps and at the end, ``DIR/config.json`` and
   ``DIR/model.safetensors`` (the head) and ``DIR/train_state.pt`` (optimizer, step,
   random state). Running the command again on the same ``DIR`` resumes from there.
5. **Held-out accuracy**: ``--holdout`` sequences (by default 5% of a set of 100 or
   more) never train; at every checkpoint the head's draft accuracy on them per draft
   step and the tokens per speculative step it implies are printed and written to
   ``DIR/eval.json`` (:mod:`lmkit_plugins.spec.eagle_eval`), over the answers only and
   against the answers' own tokens (tokens outside the draft vocabulary are misses).
   ``--eval-prompts FILE`` (or ``bench``: the chat prompts of ``lmkit bench``) adds the
   same measure on the target's answers to another prompt set -- the traffic the head
   will serve -- reported beside it (``eval_prompts`` in ``eval.json``).
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmkit_plugins.models.llama import LlamaDims
from lmkit_plugins.spec import train_checks as checks
from lmkit_plugins.spec.eagle_batches import StepBatch, StepBatcher
from lmkit_plugins.spec.eagle_eval import accuracy_report, holdout_split, report_line
from lmkit_plugins.spec.eagle_features import (
    CACHE_MODES,
    FeatureCache,
    TargetFeatures,
    cache_bytes,
)
from lmkit_plugins.spec.eagle_trainable import TrainableEagle3, padded_distill_loss
from lmkit_plugins.spec.self_prompts import bulk_llm_options, own_prompts, read_jsonl

__all__ = ["TrainableEagle3", "train"]

CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
               "vocab_size", "head_dim", "rope_theta", "rope_scaling", "rope_parameters")


def default_taps(num_layers: int) -> list[int]:
    """The tapped target layers EAGLE-3 uses (vLLM's ``[2, L // 2, L - 3]``), clipped to
    the layers of a small model."""
    return [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]


def load_prompts(path: Path | None) -> list[str]:
    """The prompt set: ``path`` (JSONL, one ``{"prompt": ...}`` or string per line), else
    the chat prompts of ``lmkit bench``."""
    if path is None:
        from lmkit.api import CHAT_PROMPTS

        return list(CHAT_PROMPTS)
    return read_jsonl(Path(path))


def generate_data(model: str, prompts: list[str], max_new_tokens: int, device: str
                  ) -> tuple[Path, list[list[int]], list[int]]:
    """The target's greedy answers to ``prompts`` (prompt and answer token ids), with
    lmkit; also returns the model's local directory and each prompt's length in tokens
    (the answer follows it)."""
    from lmkit import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    with LLM(model, **bulk_llm_options(device)) as llm:
        model_dir = Path(llm.engine.model_dir)
        chat = getattr(llm.tokenizer, "chat_template", None)
        outs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if chat
                else llm.generate(prompts, params))
    return (model_dir, [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs],
            [len(o.prompt_token_ids) for o in outs])


def head_config(hf_config: Any, taps: list[int], draft_vocab_size: int) -> dict[str, Any]:
    """The head's ``config.json``: the target's shapes, one layer, the taps."""
    target = hf_config.to_dict()
    config = {k: target[k] for k in CONFIG_KEYS if target.get(k) is not None}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  tie_word_embeddings=False, draft_vocab_size=draft_vocab_size,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": taps})
    return config


def draft_vocabulary(sequences: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``sequences`` (then the lowest unused ids),
    sorted."""
    counts = Counter(t for s in sequences for t in s)
    ids = [t for t, _ in counts.most_common(size)]
    ids += [t for t in range(vocab_size) if t not in counts][:size - len(ids)]
    return torch.tensor(sorted(ids), dtype=torch.int64)


LR_SCHEDULES = ("constant", "cosine")


def learning_rate(lr: float, step: int, max_steps: int, schedule: str, warmup: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): a linear warm-up over the
    first ``warmup`` steps, then ``lr`` (``constant``) or a cosine decay to zero at
    ``max_steps`` (``cosine``; a resumed run with a larger ``--max-steps`` decays over
    the new total from where it stands)."""
    scale = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    if schedule == "cosine":
        scale *= 0.5 * (1.0 + math.cos(math.pi * min(step, max_steps) / max(max_steps, 1)))
    return lr * scale


def answer_rows(data: dict[str, Any], progress: bool) -> tuple[list[list[int]], list[int]]:
    """The training sequences of ``data`` and, per sequence, its first row that trains:
    row ``p`` predicts token ``p + 2``, and serving drafts from the first answer token
    on (the target samples that one), so answers train from row ``prompt length - 1``;
    the prompt rows are context only. Sequences with fewer than two answer tokens have
    no such row and are dropped. Data written before prompt lengths were kept trains on
    every row (as it did then), with a note."""
    lens = data.get("prompt_lens")
    if lens is None:
        if progress:
            print("lmkit: this training data has no prompt lengths (written by an older "
                  "lmkit): every position trains, prompts included; delete "
                  "train_data.pt to regenerate it", file=sys.stderr)
        pairs = [(s, 0) for s in data["sequences"] if len(s) >= 3]
    else:
        pairs = [(s, n - 1) for s, n in zip(data["sequences"], lens, strict=True)
                 if len(s) >= max(n + 2, 3)]
    if not pairs:
        raise ValueError("the prompt set gave no answer of 2 tokens or more (the target "
                         "ended every answer at once; raise --max-new-tokens or use other "
                         "prompts)")
    return [s for s, _ in pairs], [f for _, f in pairs]


def train(model: str, out: Path, *, max_steps: int, device: str, prompts: Path | None = None,
          max_new_tokens: int = 128, draft_vocab_size: int = 32000, lr: float = 3e-4,
          batch_size: int = 4, save_every: int = 100, taps: list[int] | None = None,
          seed: int = 0, ttt_steps: int = 3, progress: bool = True,
          feature_cache: str = "memory", feature_cache_gb: float = 8.0,
          feature_batch: int = 16, holdout: int | None = None,
          lr_schedule: str = "constant", warmup_steps: int = 0,
          eval_prompts: str | Path | None = None, self_prompts: int = 0) -> dict[str, Any]:
    """Train (or resume training) an EAGLE-3 head for ``model`` into ``out``; returns
    ``{"step", "loss", "resumed_from", "losses", "feature_cache", "eval"}`` (``losses``:
    this run's per-step losses; ``feature_cache``: ``memory``, ``disk`` or ``off``;
    ``eval``: the last held-out evaluation, ``None`` without held-out sequences). See the
    module docstring."""
    from lmkit.api import load_hf_config
    from safetensors.torch import save_file

    if feature_cache not in CACHE_MODES:
        raise ValueError(f"feature cache {feature_cache!r}: use one of {', '.join(CACHE_MODES)}")
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"learning-rate schedule {lr_schedule!r}: use one of "
                         f"{', '.join(LR_SCHEDULES)}")
    checks.make_out(out)
    data_path, state_path = out / "train_data.pt", out / "train_state.pt"
    eval_source = None if eval_prompts is None else str(eval_prompts)
    data = checks.load_run_file(data_path, "delete it to generate the answers again")
    source = checks.prompt_source(prompts, self_prompts)
    if data is not None:
        checks.check_data(data, out, model, source)
    need_eval = eval_source is not None and (data is None or (data.get("eval") or {}).get(
        "source") != eval_source)
    answered = data is None or need_eval
    if answered:  # the target answers the prompts (one engine for both)
        train_prompts: list[str] = []
        extra = (checks.nonempty(load_eval_prompts(eval_source), f"--eval-prompts {eval_source!r}")
                 if need_eval else [])
        if data is None:  # --self-prompts alone trains on those only
            if prompts is not None or not self_prompts:
                train_prompts = checks.nonempty(load_prompts(prompts), f"--prompts {prompts}")
            train_prompts += own_prompts(model, out, self_prompts, device, seed, progress)
            checks.nonempty(train_prompts, "--self-prompts (the model wrote none it could keep)")
        model_dir, generated, lens = generate_data(model, train_prompts + extra,
                                                   max_new_tokens, device)
        n = len(train_prompts)
        if data is None:
            data = {"model": model, "model_dir": str(model_dir), "sequences": generated[:n],
                    "prompt_lens": lens[:n], "source": source}
        if need_eval:
            data["eval"] = {"source": eval_source, "sequences": generated[n:],
                            "prompt_lens": lens[n:]}
    sequences, firsts = answer_rows(data, progress)  # checked before the data is kept
    try:
        eval_set = (answer_rows(data["eval"], False) if eval_source is not None
                    else ([], []))
    except ValueError as e:
        raise ValueError(f"--eval-prompts {eval_source!r}: {e}") from e
    if answered:
        torch.save(data, data_path)
    model_dir = Path(data["model_dir"])
    train_ids, held_ids = holdout_split(len(sequences), holdout, seed)
    hf_config = load_hf_config(model_dir)
    dims = LlamaDims.from_hf(hf_config)
    taps = taps or default_taps(dims.num_layers)
    state = checks.load_run_file(state_path, "delete it to start training over")
    if state is not None:
        checks.check_state(state, out, max_steps=max_steps, taps=taps,
                           draft_vocab_size=draft_vocab_size, vocab_size=dims.vocab_size)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    target = TargetFeatures(model_dir, taps, device, dtype)
    if feature_cache == "memory" and cache_bytes(sequences, len(taps), dims.hidden_size,
                                                 dtype) > feature_cache_gb * 2**30:
        feature_cache = "disk"  # larger than allowed in memory: memory-mapped files
    cache = None if feature_cache == "off" else FeatureCache.build(
        target, sequences, feature_batch, out / "features" if feature_cache == "disk" else None,
        {"model": model, "taps": taps}, progress)
    ids = (state["draft_ids"] if state is not None else
           draft_vocabulary(sequences, min(draft_vocab_size, dims.vocab_size), dims.vocab_size))
    with torch.random.fork_rng(devices=[]):  # the head's initial weights: from the seed
        torch.manual_seed(seed)
        head = TrainableEagle3(hf_config, len(taps), len(ids))
    draft_rows = target.lm_head_rows(ids)
    if state is None:
        with torch.no_grad():
            head.lm_head.weight.copy_(draft_rows)
    head.to(device)
    draft_rows = draft_rows.to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr)
    step, resumed_from = 0, None
    generator = torch.Generator().manual_seed(seed)
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step = resumed_from = state["step"]
        generator.set_state(state["generator"])

    def save() -> None:
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in head.state_dict().items()
                   if not k.startswith("rotary.")}
        tensors["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(dims.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(head_config(hf_config, taps, len(ids)),
                                                    indent=1))
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": step, "generator": generator.get_state(), "draft_ids": ids,
                    "taps": taps},
                   state_path)

    batcher = StepBatcher(target, draft_rows, device)

    def step_inputs(picks: list[int]) -> StepBatch:
        seqs = [sequences[i] for i in picks]
        features = [cache.get(i) for i in picks] if cache is not None else target(seqs)
        return batcher(seqs, features, [firsts[i] for i in picks])

    to_draft = torch.full((dims.vocab_size,), -1, dtype=torch.int64)
    to_draft[ids] = torch.arange(len(ids))

    def example(seq: list[int], first: int, features: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[Any, ...]:
        # a batch of one; truth: the sequence's own next-next tokens (the target's greedy
        # answer), as draft ids
        b = batcher([seq], [features], [first])
        return (b.embeds[0], b.taps[0], b.want[0], first,
                to_draft[torch.tensor(seq[2:])].to(device))

    def held_out(i: int) -> tuple[Any, ...]:
        s = sequences[i]
        return example(s, firsts[i], cache.get(i) if cache is not None else target([s])[0])

    def eval_example(seq: list[int], first: int) -> tuple[Any, ...]:
        return example(seq, first, target([seq])[0])  # a small set: no cache

    last_eval: dict[str, Any] | None = None

    def evaluate() -> None:
        nonlocal last_eval
        if not held_ids and not eval_set[0]:
            return
        head.eval()
        last_eval = {"step": step}
        if held_ids:
            last_eval.update(accuracy_report(head, [lambda i=i: held_out(i) for i in held_ids],
                                             ttt_steps))
            _print_accuracy(progress, f"held-out draft accuracy at step {step}", last_eval)
        if eval_set[0]:
            report = accuracy_report(head, [lambda s=s, f=f: eval_example(s, f)
                                            for s, f in zip(*eval_set, strict=True)], ttt_steps)
            last_eval["eval_prompts"] = {"source": eval_source, **report}
            _print_accuracy(progress, f"draft accuracy on {eval_source} at step {step}", report)
        head.train()
        (out / "eval.json").write_text(json.dumps(last_eval, indent=1))

    pending: list[torch.Tensor] = []  # this run's step losses, read back in groups
    bar = _progress(progress, max_steps, step)
    while step < max_steps:
        picks = [train_ids[j] for j in
                 torch.randint(len(train_ids), (batch_size,), generator=generator).tolist()]
        optimizer.zero_grad()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(lr, step, max_steps, lr_schedule, warmup_steps)
        b = step_inputs(picks)
        loss = padded_distill_loss(head, b.embeds, b.taps, b.want, b.lengths, b.starts,
                                   ttt_steps, batch_size)
        loss.backward()
        optimizer.step()
        step += 1
        pending.append(loss.detach())  # not read here: the host runs ahead of the device
        bar(step, lambda: float(pending[-1]))
        if step % save_every == 0 or step == max_steps:
            save()
            evaluate()
    if resumed_from == max_steps or (step == 0 and max_steps == 0):
        save()
        evaluate()
    losses = torch.stack(pending).tolist() if pending else []
    loss_value = losses[-1] if losses else float("nan")
    return {"step": step, "loss": loss_value, "resumed_from": resumed_from, "losses": losses,
            "feature_cache": feature_cache, "eval": last_eval}


def load_eval_prompts(source: str) -> list[str]:
    """``--eval-prompts``: ``bench`` (the chat prompts of ``lmkit bench``) or a JSONL file
    like ``--prompts``."""
    if source == "bench":
        return load_prompts(None)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"--eval-prompts {source!r}: not a file; give a JSONL prompt file "
                         "or 'bench' (the chat prompts of lmkit bench)")
    return load_prompts(path)


def _print_accuracy(progress: bool, what: str, report: dict[str, Any]) -> None:
    if progress:
        print(f"lmkit: {what} ({report['sequences']} sequences): {report_line(report)}",
              file=sys.stderr)


def _progress(enabled: bool, total: int, start: int) -> Any:
    """Training progress on stderr (``update(step, loss)``, ``loss`` a callable read only
    when shown, since reading it waits for the device): a rich bar on a terminal (the
    loss refreshed every 20 steps), else one line per tenth of the steps (``lmkit:
    training EAGLE-3 head: step 80 of 800 (10%), loss 5.8213, 14 s``), so logs show it
    too; a no-op when disabled."""
    if not enabled:
        return lambda step, loss: None
    import sys
    import time

    if not sys.stderr.isatty():
        began, every = time.monotonic(), max(1, total // 10)

        def line(step: int, loss: Callable[[], float]) -> None:
            if step % every == 0 or step >= total:
                print(f"lmkit: training EAGLE-3 head: step {step} of {total} "
                      f"({100 * step // max(total, 1)}%), loss {loss():.4f}, "
                      f"{time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
        return line
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("training EAGLE-3 head"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]}"), console=Console(stderr=True),
                   transient=False)
    task = bar.add_task("train", total=total, completed=start, loss="-")
    bar.start()

    def update(step: int, loss: Callable[[], float]) -> None:
        if step % 20 == 0 or step >= total:
            bar.update(task, completed=step, loss=f"{loss():.4f}")
        else:
            bar.update(task, completed=step)
        if step >= total:
            bar.stop()
    return update

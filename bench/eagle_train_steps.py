"""Time ``lmkit spec train-eagle``'s optimizer steps of a git revision against the working
tree's, on one training set: a random-weight target of SmolLM2-135M's shape (576 hidden,
9/3 heads, 49,152 tokens; ``--layers`` of them) answers ``--prompts`` (512) prompts once, its features
go to a disk cache, and each round runs both sides (each in its own process, the
revision's ``lmkit_plugins`` from an archive of its ``plugins/``, alternating order)
resuming ``--steps`` more steps of ``--batch-size`` (32) sequences from the same data
(answers of up to ``--max-new-tokens``, 128). A side's time per
step is its call's time less the time of a call that runs no step (loading the target,
the cache and the checkpoint, saving); medians over ``--rounds``::

    python bench/eagle_train_steps.py --rev HEAD~1 --device cuda --steps 600 --rounds 3

Both sides train on the same sequences in the same order from the same seed, so their
losses are printed side by side as a check that the change kept the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from before_after import before_after, env_first_on_path, revision_tree  # noqa: E402

OPTIONS = dict(max_new_tokens=128, draft_vocab_size=8192, batch_size=32, lr=1e-3,
               save_every=10**6, holdout=0, feature_batch=64, feature_cache="disk")


def side(model: str, out: str, device: str, steps: int, options: dict) -> None:
    """One side's timing (run in its own process): a call with no step left, then one
    of ``steps`` more, with train-eagle's ``options``; prints seconds per step and the
    new losses as JSON."""
    from lmkit_plugins.spec.train_eagle import train

    done = json.loads((Path(out) / "steps.json").read_text())["steps"]
    kw = dict(device=device, prompts=Path(out).parent / "prompts.jsonl", progress=False,
              **options)
    start = time.perf_counter()
    train(model, Path(out), max_steps=done, **kw)
    load = time.perf_counter() - start
    start = time.perf_counter()
    result = train(model, Path(out), max_steps=done + steps, **kw)
    run = time.perf_counter() - start
    (Path(out) / "steps.json").write_text(json.dumps({"steps": done + steps}))
    print(json.dumps({"per_step": (run - load) / steps, "losses": result["losses"]}))


def prepare(work: Path, layers: int, device: str, prompts: int, options: dict) -> str:
    """The target, ``prompts`` prompts and one step (data and feature cache) in
    ``work/before``, copied to ``work/after``; returns the target's directory."""
    from lmkit.testing.tiny_model import make_tiny_model
    from lmkit_plugins.spec.train_eagle import train

    model = make_tiny_model(work / "target", vocab_size=49152, num_layers=layers,
                            hidden_size=576, num_heads=9, num_kv_heads=3,
                            max_position_embeddings=2048)
    (work / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"Question {i}: tell me about item {i * 7919 % 1000}."}) + "\n"
        for i in range(prompts)))
    train(str(model), work / "before", max_steps=1, device=device,
          prompts=work / "prompts.jsonl", progress=True, **options)
    (work / "before" / "train_state.pt").unlink()  # both sides start from step 0
    shutil.copytree(work / "before", work / "after")
    for name in ("before", "after"):
        (work / name / "steps.json").write_text(json.dumps({"steps": 0}))
    return str(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="the 'before' git revision")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=600, help="steps per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30, help="the target's layers")
    ap.add_argument("--prompts", type=int, default=512, help="training prompts")
    ap.add_argument("--batch-size", type=int, default=OPTIONS["batch_size"],
                    help="sequences per step")
    ap.add_argument("--max-new-tokens", type=int, default=OPTIONS["max_new_tokens"],
                    help="the target's answers' length limit")
    args = ap.parse_args()
    options = {**OPTIONS, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens}
    losses: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "rev").mkdir()
        plugins = revision_tree(args.rev, "plugins", work / "rev")
        model = prepare(work, args.layers, args.device, args.prompts, options)

        def run(name: str) -> float:
            env = env_first_on_path(plugins if name == "before" else None)
            code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                    f"import eagle_train_steps as b; b.side({model!r}, "
                    f"{str(work / name)!r}, {args.device!r}, {args.steps}, {options!r})")
            out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                 capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            losses[name] += result["losses"]
            return float(result["per_step"])

        before_after(f"train-eagle steps of {args.batch_size} ({args.device})", run, args.rounds)
    pairs = list(zip(losses["before"], losses["after"], strict=True))
    print(f"losses, before / after: step 1 {pairs[0][0]:.4f} / {pairs[0][1]:.4f}, step "
          f"{len(pairs)} {pairs[-1][0]:.4f} / {pairs[-1][1]:.4f}; largest difference "
          f"{max(abs(a - b) for a, b in pairs):.4f}")


if __name__ == "__main__":
    main()

"""What ``lmkit spec train-eagle`` checks before it runs the target: that the files of a
run in ``--out`` are readable, and that a resumed run asks for what the run there was
made with (refused with the reason otherwise, never silently mixed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_run_file(path: Path, remedy: str) -> Any:
    """``torch.load(path)``, or ``None`` when there is no such file.

    :raises ValueError: the file cannot be read (truncated, not a torch file), with
        ``remedy``.
    """
    if not path.is_file():
        return None
    try:
        return torch.load(path)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        reason = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:120]
        raise ValueError(f"{path} is unreadable, truncated or not a train-eagle file "
                         f"({type(e).__name__}: {reason}); {remedy}") from e


def make_out(out: Path) -> None:
    """Create ``--out`` (a directory).

    :raises ValueError: ``out`` is something other than a directory.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: not a directory; give the head's directory (created "
                         "when missing)")
    out.mkdir(parents=True, exist_ok=True)


def prompt_source(prompts: Path | None, self_prompts: int) -> dict[str, Any]:
    """What a run's training prompts came from (kept in ``train_data.pt``): the prompt
    file (its path, shown in messages, and its content's SHA-256, compared, so that a
    moved or copied file still resumes) and the number of self-written prompts."""
    import hashlib

    digest = None if prompts is None or not Path(prompts).is_file() else \
        hashlib.sha256(Path(prompts).read_bytes()).hexdigest()
    return {"prompts": None if prompts is None else str(Path(prompts).resolve()),
            "prompts_sha256": digest, "self_prompts": self_prompts}


def _same_source(kept: dict[str, Any], source: dict[str, Any]) -> bool:
    """The same prompts: the same file content (by path where no digest was kept) and
    the same number of self-written prompts."""
    if kept.get("self_prompts") != source.get("self_prompts"):
        return False
    if "prompts_sha256" in kept:
        return bool(kept["prompts_sha256"] == source.get("prompts_sha256"))
    return bool(kept.get("prompts") == source.get("prompts"))


def nonempty(prompts: list[str], what: str) -> list[str]:
    """``prompts``, refused when empty (before the target runs).

    :raises ValueError: no prompt.
    """
    if not prompts:
        raise ValueError(f"{what}: no prompt to answer; give at least one")
    return prompts


def check_data(data: Any, out: Path, model: str, source: dict[str, Any]) -> None:
    """Refuse resuming a run in ``out`` made for another model, or whose answers were
    generated from other prompts than ``source`` asks for (data written before the
    source was kept is not checked).

    :raises ValueError: the data is not a run's, or is another model's or prompts'.
    """
    if not isinstance(data, dict) or "sequences" not in data:
        raise ValueError(f"{out / 'train_data.pt'} is not train-eagle data; delete it to "
                         "generate the answers again")
    if data.get("model") != model:
        raise ValueError(f"{out} holds a training run for model {data.get('model')!r}, "
                         f"not {model!r}; use another --out directory")
    kept = data.get("source")
    if kept is not None and not _same_source(kept, source):
        raise ValueError(
            f"{out} holds answers to {_describe(kept)}, not to {_describe(source)}; pass the "
            f"same prompts to resume, or use another --out directory (or delete "
            f"{out / 'train_data.pt'} and {out / 'train_state.pt'} to start over)")


def _describe(source: dict[str, Any]) -> str:
    parts = [f"--prompts {source['prompts']}"] if source.get("prompts") else []
    if source.get("self_prompts"):
        parts.append(f"--self-prompts {source['self_prompts']}")
    return " and ".join(parts) or "lmkit bench's chat prompts"


def check_state(state: Any, out: Path, *, max_steps: int, draft_vocab_size: int,
                vocab_size: int, taps: list[int]) -> None:
    """Refuse resuming the training state of ``out`` with a ``--max-steps`` below the
    step it reached, another draft vocabulary size or other tapped layers.

    :raises ValueError: the state is malformed, or does not fit the run asked for.
    """
    need = ("head", "optimizer", "step", "generator", "draft_ids")
    if not isinstance(state, dict) or any(k not in state for k in need):
        raise ValueError(f"{out / 'train_state.pt'} is not a train-eagle state (expected "
                         f"{', '.join(need)}); delete it to start training over")
    step, have = int(state["step"]), len(state["draft_ids"])
    if max_steps < step:
        raise ValueError(f"--max-steps {max_steps} is below step {step} that the run in {out} "
                         f"already reached; give --max-steps {step} or more to resume")
    if have != min(draft_vocab_size, vocab_size):
        raise ValueError(f"--draft-vocab-size {draft_vocab_size}: the run in {out} trains a "
                         f"draft vocabulary of {have} ids; pass --draft-vocab-size {have} to "
                         "resume, or use another --out directory")
    if state.get("taps") is not None and list(state["taps"]) != list(taps):
        raise ValueError(f"taps {list(taps)}: the run in {out} taps target layers "
                         f"{list(state['taps'])}; resume with those")

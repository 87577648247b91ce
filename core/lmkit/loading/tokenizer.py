"""Loading a model directory's tokenizer (local files only)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lmkit.errors import ModelLoadError

if TYPE_CHECKING:
    import transformers

# Any one of these makes a directory loadable by AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "tokenizer_config.json")


def check_tokenizer_setting(tokenizer: str | Path | None) -> Path | None:
    """The directory the ``model.tokenizer`` setting names (``None``: unset, the model's
    own tokenizer), checked before anything loads.

    Raises:
        ModelLoadError: it is not a directory, or holds none of :data:`TOKENIZER_FILES`.
    """
    if tokenizer is None:
        return None
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model.tokenizer {str(tokenizer)!r} is not a directory; point it at a local "
            f"directory holding the tokenizer's files ({', '.join(TOKENIZER_FILES)}), or "
            "leave it unset to use the model's own tokenizer.")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"model.tokenizer {str(tokenizer)!r} holds no tokenizer: none of "
            f"{', '.join(TOKENIZER_FILES)} is there (tokenizer.save_pretrained(DIR) writes "
            "them).")
    return path


def tokenizer_files(model_dir: Path, tokenizer: str | Path | None = None
                    ) -> tuple[Path, list[str]]:
    """The directory the tokenizer loads from (``tokenizer``, the ``model.tokenizer``
    setting, else ``model_dir``) and which of :data:`TOKENIZER_FILES` it holds: a check
    that reads no file, so that a model without a tokenizer is refused before its
    weights load.

    Raises:
        ModelLoadError: the directory does not exist or holds none of the files.
    """
    override = check_tokenizer_setting(tokenizer)
    model_dir = override if override is not None else Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"tokenizer directory {model_dir} does not exist.")
    present = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not present:
        raise ModelLoadError(
            f"{model_dir} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there. "
            "Save the tokenizer next to the model (tokenizer.save_pretrained(DIR)) or point "
            "the model's `tokenizer` setting at a directory that has one."
        )
    return model_dir, present


def load_tokenizer(model_dir: Path, tokenizer: str | Path | None = None
                   ) -> transformers.PreTrainedTokenizerBase:
    """The model's tokenizer, via ``AutoTokenizer`` with local files only: the one in
    ``tokenizer`` (the ``model.tokenizer`` setting) when given, else the one saved in
    ``model_dir``.

    Raises:
        ModelLoadError: the directory has no tokenizer files, or transformers cannot
            build a tokenizer from them; the message names the directory and the files
            it looked for.
    """
    model_dir, present = tokenizer_files(model_dir, tokenizer)

    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(
            f"cannot load the tokenizer in {model_dir} (files: {', '.join(present)}): "
            f"{type(e).__name__}: {e}"
        ) from e


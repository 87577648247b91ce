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


def load_tokenizer(model_dir: Path) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer saved in ``model_dir``, via ``AutoTokenizer`` with local files only.

    Raises:
        ModelLoadError: the directory has no tokenizer files, or transformers cannot
            build a tokenizer from them; the message names the directory and the files
            it looked for.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"tokenizer directory {model_dir} does not exist.")
    present = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not present:
        raise ModelLoadError(
            f"{model_dir} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there. "
            "Save the tokenizer next to the model (tokenizer.save_pretrained(DIR)) or point "
            "the model's `tokenizer` setting at a directory that has one."
        )

    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(
            f"cannot load the tokenizer in {model_dir} (files: {', '.join(present)}): "
            f"{type(e).__name__}: {e}"
        ) from e


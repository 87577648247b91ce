"""Reading model directories: safetensors weights, config.json and the tokenizer, and the
errors for corrupt, truncated and missing files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lmkit.errors import ModelLoadError
from lmkit.loading.tokenizer import load_tokenizer
from lmkit.loading.weights import check_weight_files, iterate_weights, load_hf_config
from safetensors.torch import save_file


def make_tiny_llama_dir(path: Path, tie: bool = True) -> torch.nn.Module:
    """A random 1-layer Llama saved with save_pretrained (safetensors) into ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(path))
    return model


def save_tiny_tokenizer(path: Path) -> None:
    """A word-level tokenizer (fast, no network) saved into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny")
    model = make_tiny_llama_dir(path)
    save_tiny_tokenizer(path)
    return path, model


def test_iterate_weights_yields_every_saved_tensor(tiny_dir):
    path, model = tiny_dir
    got = dict(iterate_weights(path))
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(got) == set(expected)  # tied lm_head is not stored
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)


def test_iterate_weights_reads_files_in_name_order(tmp_path):
    save_file({"z": torch.zeros(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"a": torch.ones(3), "b": torch.arange(4.0)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    names = [n for n, _ in iterate_weights(tmp_path)]
    assert names[-1] == "z" and sorted(names[:2]) == ["a", "b"]


def _copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_file_names_the_file(tiny_dir, tmp_path):
    path = _copy_dir(tiny_dir[0], tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*(truncated|incomplete)"):
        list(iterate_weights(path))
    with pytest.raises(ModelLoadError, match=str(weights)):
        check_weight_files(path)


@pytest.mark.parametrize("content", [b"\xff" * 64, b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{bad json"])
def test_garbage_file_names_the_file(tiny_dir, tmp_path, content):
    path = _copy_dir(tiny_dir[0], tmp_path / "m")
    (path / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelLoadError) as info:
        list(iterate_weights(path))
    assert str(path / "model.safetensors") in str(info.value)
    assert "corrupt" in str(info.value)


def test_no_weights_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"no weights in .*\*\.safetensors"):
        list(iterate_weights(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        list(iterate_weights(tmp_path))


def test_load_hf_config(tiny_dir):
    config = load_hf_config(tiny_dir[0])
    assert config.model_type == "llama"
    assert config.hidden_size == 16 and config.num_key_value_heads == 1
    assert config.tie_word_embeddings is True
    assert config.architectures == ["LlamaForCausalLM"]


def test_config_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"cannot parse .*config\.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ModelLoadError, match="no-such-arch"):
        load_hf_config(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(tmp_path / "missing")


def test_load_tokenizer(tiny_dir, tmp_path):
    tok = load_tokenizer(tiny_dir[0])
    assert tok("hello world").input_ids == [3, 4]
    assert tok.eos_token == "</s>"
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match=r"cannot load the tokenizer .*tokenizer\.json"):
        load_tokenizer(tmp_path)

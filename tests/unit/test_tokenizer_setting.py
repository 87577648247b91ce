"""The ``model.tokenizer`` setting (``LLM(tokenizer=DIR)``, ``--set model.tokenizer=DIR``):
a tokenizer directory used instead of the model's own -- by the frontend, for the
EOS tokens and for structured output -- checked before the model loads."""

from __future__ import annotations

import json
import shutil

import pytest
from lmkit import LLM, SamplingParams
from lmkit.errors import ModelLoadError
from lmkit.loading.model_facts import eos_token_ids_of
from lmkit.loading.tokenizer import TOKENIZER_FILES, check_tokenizer_setting, load_tokenizer
from lmkit.loading.weights import load_hf_config
from lmkit.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    """``(model_dir, tokenizer_dir)``: a tiny model whose tokenizer files were moved to a
    directory of their own."""
    root = tmp_path_factory.mktemp("split")
    model = make_tiny_model(root / "model")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    for path in list(model.iterdir()):
        if path.name in TOKENIZER_FILES or path.name == "special_tokens_map.json":
            shutil.move(str(path), tokenizer / path.name)
    return model, tokenizer


def test_the_setting_is_checked(tmp_path):
    assert check_tokenizer_setting(None) is None
    with pytest.raises(ModelLoadError, match=r"model.tokenizer '/no/such/dir' is not a "
                                             r"directory; point it at a local directory"):
        check_tokenizer_setting("/no/such/dir")
    with pytest.raises(ModelLoadError, match=r"holds no tokenizer: none of tokenizer.json"):
        check_tokenizer_setting(tmp_path)


def test_load_tokenizer_takes_the_setting_over_the_model_dir(split_model):
    model, tokenizer = split_model
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_tokenizer(model)
    assert load_tokenizer(model, str(tokenizer)).convert_tokens_to_ids("<|endoftext|>") == 256


def test_the_setting_gives_the_primary_eos_token(split_model, tmp_path):
    model, tokenizer = split_model
    config = load_hf_config(model)
    other = tmp_path / "other"
    shutil.copytree(tokenizer, other)
    tc = json.loads((other / "tokenizer_config.json").read_text())
    tc["eos_token"] = "a"  # byte token 97 under the byte tokenizer's alphabet
    (other / "tokenizer_config.json").write_text(json.dumps(tc))
    assert eos_token_ids_of(model, config, tokenizer)[0] == 256
    assert eos_token_ids_of(model, config, other)[0] == 97


def test_an_engine_serves_with_the_setting(split_model):
    model, tokenizer = split_model
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(model), tokenizer=str(tokenizer), device="cpu", dtype="float32",
              max_num_seqs=2)
    try:
        out = llm.generate(["hello"], params)[0]
        assert len(out.outputs[0].token_ids) == 6
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
        # structured output builds its grammar from the same tokenizer
        constrained = SamplingParams(temperature=0.0, max_tokens=8,
                                     structured_outputs={"choice": ["yes", "no"]})
        assert llm.generate(["hello"], constrained)[0].outputs[0].text in ("yes", "no")
    finally:
        llm.shutdown()


def test_a_bad_setting_is_refused_before_the_model_loads(split_model, monkeypatch):
    model, _ = split_model
    from lmkit.engine import core

    def never(*args, **kwargs):
        raise AssertionError("the engine was built before the tokenizer setting was checked")

    monkeypatch.setattr(core.EngineCore, "__init__", never)
    with pytest.raises(ModelLoadError, match="model.tokenizer '/no/such/dir' is not a directory"):
        LLM(str(model), tokenizer="/no/such/dir", device="cpu")

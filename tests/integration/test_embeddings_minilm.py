"""The real all-MiniLM-L6-v2 (BertModel, bidirectional attention, mean pooling) through
the engine: embeddings equal sentence-transformers' (or, without that package,
transformers' mean pooling + normalize, which is what it computes)."""

from __future__ import annotations

import pytest
import torch
from lmkit import LLM
from lmkit.api import PoolingParams
from lmkit.errors import InvalidRequestError
from lmkit.platform import cpu_has_bf16_matmul

pytestmark = pytest.mark.slow  # loads two copies of the model (~10 s on 2 cores)

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "What is the weather like in Berlin today?",
    "Embeddings map text to vectors in a space where similar meanings are close.",
    "I love programming in Python!",
    "Das ist ein deutscher Satz mit Umlauten: äöü.",
    "Short.",
    "Numbers like 3.14159 and 2.71828 are irrational.",
    "The mitochondria is the powerhouse of the cell.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "A very long sentence " + "that keeps going and going " * 12 + "until it ends.",
]


def reference_embeddings(model_dir, texts):
    """sentence-transformers' encode (mean pooling + normalize), or the same maths in
    transformers when that package is not installed."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        SentenceTransformer = None
    if SentenceTransformer is not None:
        model = SentenceTransformer(str(model_dir), device="cpu")
        return torch.from_numpy(model.encode(texts, batch_size=8, normalize_embeddings=True))
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"][..., None].float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(mean, dim=-1)


@pytest.fixture(scope="module")
def reference(minilm_dir):
    return reference_embeddings(minilm_dir, SENTENCES).float()


@pytest.fixture(scope="module")
def llm(minilm_dir):
    # float32: the reference is sentence-transformers' float32 (auto may mean bfloat16)
    engine = LLM(str(minilm_dir), progress=False, dtype="float32")
    yield engine
    engine.shutdown()


def test_minilm_matches_sentence_transformers(llm, reference):
    ours = torch.tensor([o.embedding for o in llm.embed(SENTENCES)])
    assert ours.shape == reference.shape == (len(SENTENCES), 384)
    cos = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert float(cos.min()) >= 0.9999, cos
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_minilm_defaults_to_its_sentence_transformers_pooler(llm):
    assert llm.engine.facts.pooling.default_pooler == "cls"  # what BertModel declares
    mean = llm.embed(["A man is eating food."], PoolingParams(pooling_type="mean"))
    default = llm.embed(["A man is eating food."])  # 1_Pooling/config.json says mean
    assert default[0].embedding == mean[0].embedding
    cls = llm.embed(["A man is eating food."], PoolingParams(pooling_type="cls"))
    assert cls[0].embedding != mean[0].embedding


def test_dimensions_truncate_then_normalize(llm):
    full = torch.tensor(llm.embed(["Paris is the capital of France."], normalize=False)[0].data)
    short = torch.tensor(llm.embed(["Paris is the capital of France."], dimensions=64)[0].data)
    assert short.shape == (64,)
    assert torch.allclose(short, torch.nn.functional.normalize(full[:64], dim=0), atol=1e-6)


def test_encoder_refuses_generation_and_unknown_poolers(llm):
    with pytest.raises(InvalidRequestError, match="cannot generate text"):
        llm.generate("hello")
    with pytest.raises(InvalidRequestError, match="unknown pooler 'maen'.*Did you mean 'mean'"):
        llm.embed("hello", PoolingParams(pooling_type="maen"))
    with pytest.raises(InvalidRequestError, match="no classification head"):
        llm.classify("hello")
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stack.get("attention").name in ("cpu", "torch")
    assert llm.engine.config.scheduler.enable_chunked_prefill is False


def test_score_is_the_cosine_and_maxsim_for_token_vectors(llm):
    emb = torch.tensor([o.embedding for o in llm.embed(SENTENCES[:3])])
    scores = llm.score(SENTENCES[0], SENTENCES[:3])
    assert scores == pytest.approx((emb @ emb[0]).tolist(), abs=1e-5)
    maxsim = llm.score(SENTENCES[0], [SENTENCES[0], SENTENCES[3]],
                       PoolingParams(pooling_type="all"))
    num_tokens = len(llm.tokenizer.encode(SENTENCES[0]))
    assert maxsim[0] == pytest.approx(num_tokens, abs=1e-4)  # every token finds itself
    assert maxsim[1] < maxsim[0]


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_minilm_default_and_bfloat16_match_sentence_transformers(minilm_dir, reference, dtype):
    """The must-show holds for the default configuration too: ``auto`` is bfloat16 for an
    encoder on a CPU with hardware bf16 matmuls (AMX / AVX512-BF16), and every text stays
    at cosine >= 0.9999 to sentence-transformers float32, batched or alone."""
    with LLM(str(minilm_dir), progress=False, dtype=dtype) as engine:
        assert engine.engine.stack.dtype == (
            "float32" if dtype == "auto" and not cpu_has_bf16_matmul() else "bfloat16")
        batched = torch.tensor([o.embedding for o in engine.embed(SENTENCES)])
        alone = torch.tensor([engine.embed([s])[0].embedding for s in SENTENCES[::3]])
    cos = torch.nn.functional.cosine_similarity(batched, reference, dim=-1)
    assert float(cos.min()) >= 0.9999, cos
    cos_alone = torch.nn.functional.cosine_similarity(alone, reference[::3], dim=-1)
    assert float(cos_alone.min()) >= 0.9999, cos_alone

"""bench/mla_decode.py on CPU: its torch implementation of absorbed MLA decode equals the
float32 reference, its command line refuses what it does not know, and without CUDA it
exits with status 2 and says why (the timing itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import mla_decode  # noqa: E402
from lmkit_kernels.mla_attention import absorb_query  # noqa: E402
from lmkit_kernels.mla_batch import make_mla_batch  # noqa: E402
from lmkit_kernels.mla_ref import mla_latent_attention_ref, split_kv_b  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_latent_decode_matches_the_reference(dtype):
    heads, nope = 4, 32
    contexts = [0, 5, 16, 33, 70]  # seq_len 1 .. 71, uneven block counts
    batch = make_mla_batch([(c, 1) for c in contexts], num_heads=heads, kv_lora_rank=64,
                           qk_nope_head_dim=nope, qk_rope_head_dim=16, v_head_dim=24,
                           block_size=16, dtype=dtype, seed=7)
    lay = batch.layout
    w_uk, _ = split_kv_b(batch.w_kv_b, heads, nope)
    q_lat = absorb_query(batch.q_nope, w_uk).transpose(0, 1)
    ref = mla_latent_attention_ref(q_lat, batch.q_pe, batch.kv_cache, lay.query_start_loc,
                                   lay.seq_lens, lay.block_tables, batch.scale)
    out = mla_decode.torch_latent_decode(q_lat, batch.q_pe, batch.kv_cache, lay.block_tables,
                                         lay.seq_lens, lay.max_seq_len, batch.scale)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_command_line_refuses_unknown_models_and_backends(capsys):
    with pytest.raises(SystemExit):
        mla_decode.parse_args(["--models", "v4"])
    assert "unknown model v4; choose from v2-lite, v2, v3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mla_decode.parse_args(["--backends", "mla_triton,flashmla"])
    assert "unknown backend flashmla" in capsys.readouterr().err
    args = mla_decode.parse_args(["--batch-sizes", "1,256", "--contexts", "8192"])
    assert (args.batch_sizes, args.contexts, args.models) == ([1, 256], [8192],
                                                              ["v2-lite", "v3"])


def test_without_cuda_it_exits_2_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mla_decode.main(["--json", "-"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err

"""The ``gguf`` quantization method's file checks and tensor mapping, on small GGUF files
written with the ``gguf`` package's writer: bad files (truncated, wrong block sizes,
unknown or unsupported types, another architecture) are refused with a clear error by
``check`` (which runs before the model is built); good ones map to HF names with the
query/key rows put back in HF order."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
from lmkit.api import ModelLoadError, QuantizedTensor  # noqa: E402
from lmkit.api.model_facts import ModelFacts  # noqa: E402
from lmkit.plugin_host.spec import Needs  # noqa: E402
from lmkit_kernels.cpu.qgemv import (  # noqa: E402
    QTYPES,
    qgemv_isa,
    qgemv_unavailable_reason,
    random_blocks,
    reference_dequantize,
)
from lmkit_plugins.quantization.gguf_file import (  # noqa: E402
    forward_order,
    hf_name,
    iterate_tensors,
    open_checked,
    unpermute_rows,
)

Q = gguf.GGMLQuantizationType


def _facts(model_dir: Path) -> ModelFacts:
    """What the method reads of a model: its directory and head counts (2 query, 1 KV)."""
    return ModelFacts(model_dir=model_dir, architecture="LlamaForCausalLM", vocab_size=10,
                      num_layers=1, head_size=16, max_model_len=64, native_max_model_len=64,
                      eos_token_ids=(), attention_needs=Needs(), num_attention_heads=2, num_key_value_heads=1,
                      weight_format="gguf")


def _write(path: Path, tensors: list[tuple[str, np.ndarray, Q | None]], arch: str = "llama"
           ) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _q4_1(rows: int, k: int, seed: int = 0) -> np.ndarray:
    return random_blocks(QTYPES["Q4_1"], rows, k, torch.Generator().manual_seed(seed)).numpy()


def _good(path: Path) -> Path:
    return _write(path, [
        ("blk.0.attn_q.weight", _q4_1(8, 64), Q.Q4_1),
        ("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32), None),
        ("token_embd.weight", random_blocks(QTYPES["Q8_0"], 10, 64,
                                            torch.Generator().manual_seed(1)).numpy(), Q.Q8_0),
    ])


def test_a_good_file_maps_to_hf_names_with_qk_rows_unpermuted(tmp_path):
    path = _good(tmp_path / "model.gguf")
    out = dict(iterate_tensors(open_checked(path), num_heads=2, num_kv_heads=1))
    assert sorted(out) == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                           "model.layers.0.self_attn.q_proj.weight"]
    q = out["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedTensor) and q.qtype == "Q4_1" and q.shape == (8, 64)
    raw = torch.from_numpy(_q4_1(8, 64))
    assert torch.equal(q.data, raw[unpermute_rows(8, 2)])
    assert out["model.layers.0.input_layernorm.weight"].dtype == torch.float32


def test_unpermute_undoes_llama_cpp_permutation():
    # llama.cpp's convert: w.reshape(heads, 2, rows // heads // 2, ...).swapaxes(1, 2)
    hf = torch.arange(12)
    gguf_order = hf.reshape(2, 2, 3).transpose(1, 2).reshape(-1)
    assert torch.equal(gguf_order[unpermute_rows(12, 2)], hf)


def test_names():
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("rope_freqs.weight") is None


def test_tensors_come_in_the_order_a_decode_step_reads_them(tmp_path):
    # the file's order (llama.cpp writes token_embd first and a layer's ffn before its
    # attention) is not the step's; the packed weights land in the order they are yielded
    path = _write(tmp_path / "model.gguf", [
        ("token_embd.weight", random_blocks(QTYPES["Q8_0"], 10, 64,
                                            torch.Generator().manual_seed(1)).numpy(), Q.Q8_0),
        ("blk.1.attn_q.weight", _q4_1(8, 64), Q.Q4_1),
        ("blk.0.ffn_down.weight", _q4_1(64, 64, 2), Q.Q4_1),
        ("blk.0.attn_output.weight", _q4_1(64, 64, 3), Q.Q4_1),
        ("output_norm.weight", np.ones(64, dtype=np.float32), None),
        ("blk.0.attn_q.weight", _q4_1(8, 64, 4), Q.Q4_1),
    ])
    names = [name for name, _ in iterate_tensors(open_checked(path), num_heads=2,
                                                  num_kv_heads=1)]
    assert names == ["model.layers.0.self_attn.q_proj.weight",
                     "model.layers.0.self_attn.o_proj.weight",
                     "model.layers.0.mlp.down_proj.weight",
                     "model.layers.1.self_attn.q_proj.weight",
                     "model.norm.weight", "model.embed_tokens.weight"]
    assert forward_order("blk.2.new_thing.weight") > forward_order("blk.2.ffn_down.weight")
    assert forward_order("blk.2.new_thing.weight") < forward_order("blk.10.attn_norm.weight")


def test_truncated_file_is_refused(tmp_path):
    path = _good(tmp_path / "model.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match=r"cannot run .*(truncated|does not parse)"):
        open_checked(path)


def _patch_tensor_info(path: Path, name: str, *, ne0: int | None = None,
                       qtype: int | None = None) -> None:
    """Rewrite a tensor's first dimension or type number in the file's tensor table."""
    data = bytearray(path.read_bytes())
    at = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if ne0 is not None:
        struct.pack_into("<Q", data, at + 4, ne0)
    if qtype is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, qtype)
    path.write_bytes(bytes(data))


def test_wrong_block_size_is_refused(tmp_path):
    # rows of 48 values: not whole blocks of 32
    path = _write(tmp_path / "model.gguf", [("blk.0.attn_v.weight", _q4_1(3, 64), Q.Q4_1)])
    _patch_tensor_info(path, "blk.0.attn_v.weight", ne0=48)
    with pytest.raises(ModelLoadError, match=r"cannot run .*(whole blocks of 32|not a multiple)"):
        open_checked(path)


def test_unsupported_type_is_refused_with_the_supported_list(tmp_path):
    q5k = np.zeros((2, 176), dtype=np.uint8)  # one Q5_K super-block per row (256 values)
    path = _write(tmp_path / "model.gguf", [("blk.0.ffn_up.weight", q5k, Q.Q5_K)])
    with pytest.raises(ModelLoadError, match=r"type Q5_K; the gguf method reads F16, F32, "
                                             r"Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0.*--quantization none"):
        open_checked(path)


def test_unknown_type_number_is_refused(tmp_path):
    path = _write(tmp_path / "model.gguf", [("blk.0.ffn_up.weight", _q4_1(2, 32), Q.Q4_1)])
    _patch_tensor_info(path, "blk.0.ffn_up.weight", qtype=99)
    with pytest.raises(ModelLoadError, match="does not parse"):
        open_checked(path)


def test_other_architectures_are_refused(tmp_path):
    path = _write(tmp_path / "model.gguf", [("blk.0.ffn_up.weight", _q4_1(2, 32), Q.Q4_1)],
                  arch="gemma")
    with pytest.raises(ModelLoadError, match="architecture 'gemma'"):
        open_checked(path)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="--quantization none"):
        open_checked(tmp_path / "model.gguf")


def test_method_check_runs_before_the_model_and_fuses_same_types(tmp_path):
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    from lmkit_plugins.quantization.gguf_cpu import GGUFCpuMethod

    method = GGUFCpuMethod(_facts(tmp_path), options=None)
    _write(tmp_path / "model.gguf", [("blk.0.ffn_up.weight", _q4_1(2, 32), Q.Q4_1)],
           arch="gemma")
    with pytest.raises(ModelLoadError):
        method.check()
    gen = torch.Generator().manual_seed(2)
    a = QuantizedTensor(random_blocks(3, 4, 64, gen), "Q4_1", (4, 64))
    b = QuantizedTensor(random_blocks(3, 2, 64, gen), "Q4_1", (2, 64))
    fused = method.fuse([a, b])
    assert fused is not None and fused.shape == (6, 64)
    c = QuantizedTensor(random_blocks(8, 2, 64, gen), "Q8_0", (2, 64))
    mixed = method.fuse([a, c])  # parts of different types: each keeps its own kernel
    assert mixed is not None and mixed.qtype == "mixed" and mixed.shape == (6, 64)
    xm, bias = torch.randn(3, 64, generator=gen), torch.randn(6, generator=gen)
    torch.testing.assert_close(method.linear(mixed)(xm, bias), torch.cat(
        [method.linear(a)(xm, bias[:4]), method.linear(c)(xm, bias[4:])], dim=1), rtol=0, atol=0)
    assert torch.equal(method.dequantize(mixed), torch.cat([method.dequantize(a),
                                                            method.dequantize(c)]))
    assert method.fuse([a, QuantizedTensor(random_blocks(8, 2, 96, gen), "Q8_0", (2, 96))]) is None
    x = torch.randn(2, 64, generator=gen)
    want = x @ reference_dequantize(3, fused.data, 64).t()
    got = method.linear(fused)(x, None)
    assert (got - want).abs().max() < 0.05 * want.abs().max()

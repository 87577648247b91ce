"""The ``flash_attn`` attention backend without a GPU: spec variants (FlashAttention
generations) and their reasons, ``lmkit plugins list``'s generation line, refusals with
clear reasons, the choice of generation for a device and configuration (with stand-in
modules for the libraries), and the per-step plan built from the metadata."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from lmkit.api import AttentionMetadata, Needs, Spec, Variant, choose_variant
from lmkit.cli.main import build_app
from lmkit.errors import NoBackendError
from lmkit.platform import cuda_compute_capability
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.spec import module_present
from lmkit_kernels.random_batch import make_paged_batch
from lmkit_plugins.attention import FlashAttnAttentionOptions
from lmkit_plugins.attention.flash_attn_backend import build_plan, window_size
from lmkit_plugins.attention.flash_attn_generations import choose_generation
from pydantic import ValidationError
from typer.testing import CliRunner

ENV = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="checks the machine without CUDA")


@pytest.fixture
def fake_libraries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-ins for the three libraries on ``sys.path``: FA4's ``flash_attn.cute`` (in a
    namespace package), FA3's ``flash_attn_interface``, FA2's ``flash_attn_2_cuda``.
    Importing any of them fails, so a check that imports instead of looking fails too."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    for path in (tmp_path / "flash_attn" / "cute" / "__init__.py",
                 tmp_path / "flash_attn_interface.py", tmp_path / "flash_attn_2_cuda.py"):
        path.write_text("raise ImportError('stand-in: must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path


def test_module_present_looks_without_importing_the_parent(tmp_path, monkeypatch):
    pkg = tmp_path / "lmkit_heavy_pkg"
    (pkg / "cute").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported the parent')\n")
    (pkg / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert module_present("lmkit_heavy_pkg.cute")
    assert not module_present("lmkit_heavy_pkg.missing")
    assert not module_present("lmkit_no_such_pkg.cute")
    assert "lmkit_heavy_pkg" not in sys.modules


def test_variant_reasons_name_modules_and_compute_capability():
    v = Variant("v4", requires=("lmkit_no_such_module",), compute_capability={9, 10})
    assert v.unavailable_reasons((9, 0)) == ["missing module 'lmkit_no_such_module'"]
    ok = Variant("any", requires=("json",), compute_capability={9, 10})
    assert ok.unavailable_reasons((8, 6)) == ["compute capability 8.6 (needs 9.x or 10.x)"]
    wide = Variant("w", compute_capability={8, 9, 10, 11, 12})
    assert wide.unavailable_reasons((7, 5)) == ["compute capability 7.5 (needs 8.x to 12.x)"]
    chosen, why = choose_variant((v, ok, wide), (9, 0))
    assert chosen is ok and why["v4"] and why["w"] == []


@needs_no_cuda
def test_a_spec_with_variants_is_unavailable_when_none_can_run():
    spec = Spec(name="x", target="m:X", variants=(
        Variant("a", requires=("lmkit_no_such_module",)),
        Variant("b", requires=("json",), compute_capability={9})))
    assert spec.unavailable_reasons() == [
        "no usable variant: a (missing module 'lmkit_no_such_module'), b (no CUDA device)"]
    cuda = Spec(name="y", target="m:Y", needs_cuda=True,
                variants=(Variant("b", requires=("json",), compute_capability={9}),))
    assert cuda.unavailable_reasons() == ["no CUDA device", "no usable variant: b"]
    assert Spec(name="z", target="m:Z", variants=(Variant("c", requires=("json",)),)
                ).unavailable_reasons() == []


def _run(*args: str):
    return CliRunner().invoke(build_app(env=ENV), list(args), env=ENV)


@needs_no_cuda
def test_plugins_list_shows_which_generation_would_run_and_why_not(fake_libraries):
    result = _run("plugins", "list")
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if x.strip().startswith("flash_attn:"))
    assert "none would run: fa4: no CUDA device; fa3: no CUDA device; fa2: no CUDA device" in line
    data = json.loads(_run("plugins", "list", "--json").stdout)
    spec = {s["name"]: s for s in data["specs"]["attention"]}["flash_attn"]
    assert spec["variant"] is None and not spec["available"]
    assert [v["name"] for v in spec["variants"]] == ["fa4", "fa3", "fa2"]
    assert spec["variants"][0]["requires"] == ["flash_attn.cute"]
    assert "flash_attn" not in sys.modules  # nothing was imported to find out
    (shown,) = json.loads(_run("plugins", "show", "flash_attn", "--json").stdout)["specs"]
    assert shown["variants"] == spec["variants"]
    assert cuda_compute_capability() is None


@needs_no_cuda
def test_plugins_list_says_which_module_is_missing():
    line = next(x for x in _run("plugins", "list").stdout.splitlines()
                if x.strip().startswith("flash_attn:"))
    if module_present("flash_attn.cute"):
        pytest.skip("flash-attn-4 is installed here")
    assert "fa4: missing module 'flash_attn.cute', no CUDA device" in line


@needs_no_cuda
def test_asking_for_flash_attn_without_cuda_is_refused_with_the_reasons():
    host = PluginHost.load(env=ENV)
    with pytest.raises(NoBackendError) as exc:
        host.registry.select("attention", "flash_attn",
                             Needs(values={"device": "cuda", "dtype": "bfloat16"}))
    message = str(exc.value)
    assert "attention 'flash_attn'" in message and "cannot be used: no CUDA device" in message
    assert "no usable variant: fa4" in message
    result = _run("config", "check", "--attn", "flash_attn")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "flash_attn" in result.stderr and "no CUDA device" in result.stderr


def test_auto_ranks_triton_then_flashinfer_then_flash_attn():
    # triton first: faster than flashinfer when serving on the H100 (docs/gpu.md)
    host = PluginHost.load(env=ENV)
    order = [r.name for r in host.registry.all("attention")]
    assert order.index("triton") < order.index("flashinfer") < order.index("flash_attn")
    spec = host.registry.get("attention", "flash_attn").spec
    assert "until measured" in spec.description
    assert spec.caps.why_not(Needs({"sliding_window", "cuda_graphs", "multi_token_query"},
                                   {"device": "cuda", "dtype": "float16", "head_size": 128})) == []
    assert spec.caps.why_not(Needs(values={"dtype": "float32"}))


def test_options_name_the_generation():
    assert FlashAttnAttentionOptions().generation == "auto"
    with pytest.raises(ValidationError, match="fa4"):
        FlashAttnAttentionOptions(generation="fa5")


@pytest.mark.parametrize(("capability", "head_size", "block_size", "expected"), [
    ((9, 0), 128, 16, "fa4"),    # Hopper: FA4, any page size
    ((10, 0), 128, 16, "fa4"),   # Blackwell
    ((10, 0), 192, 256, "fa2"),  # FA4 on 10.x has no head size 192; FA3 is Hopper only
    ((8, 6), 128, 256, "fa2"),   # Ampere: FA2, pages of 256
])
def test_auto_takes_the_first_generation_that_fits(fake_libraries, capability, head_size,
                                                   block_size, expected):
    assert choose_generation("auto", head_size=head_size, block_size=block_size,
                             dtype="bfloat16", capability=capability) == expected


def test_a_generation_that_does_not_fit_is_refused_with_every_reason(fake_libraries):
    assert choose_generation("fa3", head_size=128, block_size=16, dtype="float16",
                             capability=(9, 0)) == "fa3"
    with pytest.raises(ValueError) as exc:
        choose_generation("auto", head_size=128, block_size=16, dtype="bfloat16",
                          capability=(8, 0))
    message = str(exc.value)
    assert "fa4: compute capability 8.0 (needs 9.x or 10.x)" in message
    assert "fa3: compute capability 8.0 (needs 9.x)" in message
    assert "fa2: block size 16 (FlashAttention-2's paged K/V needs a multiple of 256: " \
           "--block-size 256)" in message
    with pytest.raises(ValueError, match="fa4: dtype float32 .supports float16, bfloat16."):
        choose_generation("fa4", head_size=128, block_size=16, dtype="float32",
                          capability=(9, 0))
    with pytest.raises(ValueError, match="head size 72 .paged K/V needs a multiple of 16"):
        choose_generation("fa4", head_size=72, block_size=16, dtype="bfloat16",
                          capability=(9, 0))


def test_without_the_libraries_the_refusal_says_what_to_install():
    if module_present("flash_attn.cute"):
        pytest.skip("flash-attn-4 is installed here")
    with pytest.raises(ValueError) as exc:
        choose_generation("auto", head_size=128, block_size=16, dtype="bfloat16",
                          capability=(9, 0))
    assert "fa4: missing module 'flash_attn.cute'" in str(exc.value)
    assert "pip install 'lmkit[flash-attn]'" in str(exc.value)


def test_the_backend_refuses_a_cpu_device():
    from lmkit_plugins.attention.flash_attn_backend import FlashAttnAttention

    with pytest.raises(ValueError, match="runs on CUDA devices, not cpu; use --attn torch"):
        FlashAttnAttention(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125,
                           dtype=torch.bfloat16, device=torch.device("cpu"), block_size=16)


def test_plan_passes_views_of_the_metadata():
    reqs = [(40, 1), (0, 1), (300, 1), (0, 37), (500, 64)]
    batch = make_paged_batch(reqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                             extra_rows=3, table_width=40)
    md = AttentionMetadata(**batch.metadata_kwargs())
    plan = build_plan(md, block_size=16)
    assert (plan.num_reqs, plan.num_tokens, plan.max_query_len) == (5, 104, 64)
    assert plan.max_seqlen_k == 40 * 16
    for got, want in ((plan.cu_seqlens_q, md.query_start_loc), (plan.seqused_k, md.seq_lens),
                      (plan.page_table, md.block_tables), (plan.slot_mapping, md.slot_mapping)):
        assert got.data_ptr() == want.data_ptr()  # views: fixed addresses for CUDA graphs
    assert plan.seqused_k.tolist() == [41, 1, 301, 37, 564]
    assert plan.page_table.dtype == torch.int32 and plan.page_table.stride(-1) == 1
    assert plan.cu_seqlens_k is None


def test_plan_writes_fa2_cumulative_contexts_in_place():
    # a padded CUDA-graph decode batch: the last two requests have no context
    batch = make_paged_batch([(20, 1), (7, 1), (0, 1), (0, 1)], num_heads=8, num_kv_heads=2,
                             head_size=64, block_size=16)
    md = AttentionMetadata(**batch.metadata_kwargs(cuda_graph=True))
    md.seq_lens[2:] = 0
    buffer = torch.full((8,), -1, dtype=torch.int32)
    plan = build_plan(md, block_size=16, cu_seqlens_k=buffer)
    assert plan.cu_seqlens_k.data_ptr() == buffer.data_ptr()
    assert buffer.tolist() == [0, 21, 29, 29, 29, -1, -1, -1]
    assert plan.max_query_len == 1


def test_window_size_per_generation():
    assert window_size(None, "fa4") == (None, None)
    assert window_size(None, "fa3") == window_size(None, "fa2") == (-1, -1)
    # lmkit: a query at position p sees keys > p - 7, that is 6 to its left
    assert window_size(7, "fa4") == window_size(7, "fa2") == (6, 0)


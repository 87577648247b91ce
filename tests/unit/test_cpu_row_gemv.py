"""The C row-GEMV kernel (CPU decode projections) and how it is built and chosen.

The kernel computes ``x @ w.T + b`` for up to 32 float32 rows (decode batches); each output is one dot
product in a fixed order, so a row's result must not depend on the other rows in the
call or on the thread count. The builder compiles the C source once per source,
compiler and flags, and turns every failure into a :class:`KernelUnavailable` with the
reason (callers then keep torch's linear).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from lmkit_kernels.cpu import build, row_gemv  # noqa: E402
from lmkit_kernels.cpu.row_gemv import (  # noqa: E402
    ISAS,
    MAX_ROWS,
    row_gemv_available,
    row_gemv_isa,
    row_gemv_linear,
    row_gemv_unavailable_reason,
    row_gemv_variants,
)

CPU = torch.device("cpu")


@pytest.fixture
def best_kernel():
    if not row_gemv_available():
        pytest.skip(f"C row-GEMV kernel not available here: {row_gemv_unavailable_reason()}")


@pytest.fixture(params=ISAS)
def kernel(request, best_kernel, monkeypatch):
    """Each build this CPU runs, in turn, behind ``row_gemv_linear``."""
    fn = row_gemv._variants()[0].get(request.param)
    if fn is None:
        pytest.skip(f"this CPU does not run the {request.param} build")
    monkeypatch.setattr(row_gemv, "_kernel", lambda: (fn, ""))
    return request.param


def _problem(m, n, k, seed, *, ldw=None, ldx=None):
    g = torch.Generator().manual_seed(seed)
    w_mem = torch.randn(n, ldw or k, generator=g)
    x_mem = torch.randn(m, ldx or k, generator=g)
    return x_mem[:, :k], w_mem[:, :k], torch.randn(n, generator=g)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 13, 32])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (21, 37), (5, 16), (1, 7), (130, 300)])
def test_matches_torch_for_every_row_count_and_tail(kernel, m, n, k):
    x, w, b = _problem(m, n, k, seed=m * 1000 + n + k)
    got = row_gemv_linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.addmm(b, x, w.t()), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(row_gemv_linear(x, w, None), x @ w.t(), rtol=1e-5, atol=1e-4)


def test_strided_weight_rows_and_input_rows(kernel):
    # rows further apart than k (padded memory, slices of a fused output)
    x, w, b = _problem(3, 200, 100, seed=7, ldw=132, ldx=150)
    assert not w.is_contiguous() and not x.is_contiguous()
    torch.testing.assert_close(row_gemv_linear(x, w, b), torch.addmm(b, x, w.t()),
                               rtol=1e-5, atol=1e-4)
    # a column-strided x is copied, not misread
    x_t = torch.randn(100, 2).t()
    torch.testing.assert_close(row_gemv_linear(x_t, w, None), x_t @ w.t(), rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_its_neighbours_or_the_thread_count(kernel):
    x, w, b = _problem(9, 1000, 576, seed=11)  # three blocks of x rows, the last partial
    together = row_gemv_linear(x, w, b)
    for i in range(9):
        alone = row_gemv_linear(x[i:i + 1], w, b)
        assert torch.equal(alone[0], together[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = row_gemv_linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, together)


def test_zero_rows(kernel):
    x, w, b = _problem(0, 8, 16, seed=3)
    assert row_gemv_linear(x, w, b).shape == (0, 8)


def test_refuses_inputs_it_does_not_take(kernel):
    x, w, b = _problem(MAX_ROWS + 1, 8, 16, seed=4)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        row_gemv_linear(x, w, b)
    with pytest.raises(ValueError, match="float32"):
        row_gemv_linear(x[:1].double(), w.double(), None)
    with pytest.raises(ValueError, match="weight rows must be contiguous"):
        row_gemv_linear(x[:1], torch.randn(16, 8).t(), None)
    with pytest.raises(ValueError, match=r"are not \[m, in\] and \[out, in\]"):
        row_gemv_linear(x[:1], w[:, :15], None)
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[8\]"):
        row_gemv_linear(x[:1], w, torch.randn(9))


def test_the_best_build_this_cpu_runs_is_used(best_kernel):
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                 None) if Path("/proc/cpuinfo").exists() else None
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags here")
    expected = [isa for isa, needs in (("avx512f", {"avx512f"}), ("avx2", {"avx2", "fma"}))
                if needs <= set(flags)]
    assert list(row_gemv_variants()) == expected
    assert row_gemv_isa() == expected[0]


def test_the_builds_agree(best_kernel):
    variants = row_gemv_variants()
    if len(variants) < 2:
        pytest.skip("this CPU runs one build")
    x, w, b = _problem(6, 300, 203, seed=12)  # k tail of 3 (avx2) / 11 (avx512f)
    first, *rest = (fn(x, w, b) for fn in variants.values())
    for out in rest:
        torch.testing.assert_close(out, first, rtol=1e-5, atol=1e-4)


class FakeCpu:
    """Stands in for the library: says which builds the CPU runs."""

    def __init__(self, *isas: str):
        self.isas = isas

    def lmkit_row_gemv_isa_supported(self, isa: bytes) -> int:
        return int(isa.decode() in self.isas)


def test_builds_follow_the_cpu_and_the_pin(monkeypatch):
    monkeypatch.delenv("LMKIT_CPU_ISA", raising=False)
    assert row_gemv._usable(FakeCpu("avx2", "avx512f")) == ["avx512f", "avx2"]
    assert row_gemv._usable(FakeCpu("avx2")) == ["avx2"]
    with pytest.raises(build.KernelUnavailable, match="neither AVX-512F nor AVX2"):
        row_gemv._check(FakeCpu())
    monkeypatch.setenv("LMKIT_CPU_ISA", "AVX2")
    assert row_gemv._usable(FakeCpu("avx2", "avx512f")) == ["avx2"]
    monkeypatch.setenv("LMKIT_CPU_ISA", "avx512f")
    with pytest.raises(build.KernelUnavailable,
                       match="LMKIT_CPU_ISA=avx512f but this CPU does not run avx512f code"):
        row_gemv._usable(FakeCpu("avx2"))
    monkeypatch.setenv("LMKIT_CPU_ISA", "sse")
    with pytest.raises(build.KernelUnavailable,
                       match="LMKIT_CPU_ISA='sse' is not one of avx512f, avx2"):
        row_gemv._usable(FakeCpu("avx2", "avx512f"))


def test_a_pinned_build_is_the_one_used(best_kernel):
    # a fresh process, since the builds are chosen once per process
    code = ("from lmkit_kernels.cpu import row_gemv as r; "
            "print(r.row_gemv_isa(), list(r.row_gemv_variants()))")
    env = dict(os.environ, LMKIT_CPU_ISA="avx2")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    if "avx2" not in row_gemv_variants():
        assert done.stdout.split()[0] == "[]"  # not available: isa is ""
        assert "does not run avx2 code" in done.stderr
    else:
        assert done.stdout.strip() == "avx2 ['avx2']"


def test_model_linear_uses_the_kernel_for_decode_rows_and_onednn_beyond(best_kernel):
    from lmkit_plugins.models.layers import Linear, _onednn_linear, _row_gemv_or_onednn

    lin = Linear(576, {"gate": 1536, "up": 1536}, bias=True, dtype=torch.float32, device=CPU)
    assert lin.kernel is _row_gemv_or_onednn
    assert lin.weight.is_contiguous() and lin.weight.shape == (3072, 576)  # no padding
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(3072, 576, generator=g), torch.randn(3072, generator=g)
    lin.load_shard("gate", weight=weight[:1536], bias=bias[:1536])
    lin.load_shard("up", weight=weight[1536:], bias=bias[1536:])
    x = torch.randn(MAX_ROWS + 1, 576, generator=g)
    with torch.inference_mode():
        assert torch.equal(lin.forward(x[:MAX_ROWS]), row_gemv_linear(x[:MAX_ROWS], weight, bias))
        assert torch.equal(lin.forward(x), _onednn_linear(x, weight, bias))


# ---------------------------------------------------------------- building


@pytest.fixture
def compiler():
    try:
        return build.find_compiler()
    except build.KernelUnavailable as exc:
        pytest.skip(str(exc))


def test_compiles_once_per_source_and_reuses_the_library(tmp_path, compiler):
    src = tmp_path / "answer.c"
    src.write_text("int answer(void) { return 42; }\n")
    first = build.compile_library(src, directory=tmp_path / "cache")
    stamp = first.stat().st_mtime_ns
    assert build.compile_library(src, directory=tmp_path / "cache") == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt
    src.write_text("int answer(void) { return 43; }\n")
    assert build.compile_library(src, directory=tmp_path / "cache") != first  # edited source
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".so", ".so"]  # no temp files


def test_an_edited_local_header_rebuilds_the_library(tmp_path, compiler):
    """Kernels share code through headers next to them (sum_squares.h): the cache key
    covers the headers a source includes with quotes, and a missing one is reported."""
    (tmp_path / "value.h").write_text("static inline int value(void) { return 1; }\n")
    src = tmp_path / "uses.c"
    src.write_text('#include "value.h"\nint uses(void) { return value(); }\n')
    first = build.compile_library(src, directory=tmp_path / "cache")
    assert build.compile_library(src, directory=tmp_path / "cache") == first
    (tmp_path / "value.h").write_text("static inline int value(void) { return 2; }\n")
    assert build.compile_library(src, directory=tmp_path / "cache") != first
    (tmp_path / "value.h").unlink()
    with pytest.raises(build.KernelUnavailable, match="uses.c includes value.h"):
        build.compile_library(src, directory=tmp_path / "cache")


def test_a_compile_error_is_reported_with_the_compilers_message(tmp_path, compiler):
    src = tmp_path / "broken.c"
    src.write_text("int broken(void) { return undeclared_name; }\n")
    with pytest.raises(build.KernelUnavailable, match=r"(?s)compiling broken.c failed.*undeclared_name"):
        build.compile_library(src, directory=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # the failed output is removed


def test_a_library_of_another_abi_is_refused_with_one_warning(tmp_path, compiler, monkeypatch,
                                                             caplog):
    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path))
    src = tmp_path / "future.c"
    src.write_text("int future_abi(void) { return 2; }\n")
    with caplog.at_level("WARNING"):
        lib, reason = build.bind_kernel_library(src, "future_abi", 1, functions={},
                                                what="future kernel", fallback="torch")
    assert lib is None and reason == "future.c: library ABI 2, expected 1"
    assert caplog.messages == ["future kernel not used (torch instead): " + reason]


def test_no_compiler_is_a_clear_reason(monkeypatch):
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(build.KernelUnavailable, match="no C compiler found"):
        build.find_compiler()


def test_cache_dir_and_switch_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LMKIT_CACHE", str(tmp_path))
    assert build.cache_dir() == tmp_path / "kernels"
    monkeypatch.setenv("LMKIT_CPU_KERNELS", "0")
    assert build.kernels_disabled()
    monkeypatch.setenv("LMKIT_CPU_KERNELS", "1")
    assert not build.kernels_disabled()


def test_without_the_kernel_float32_layers_fall_back_to_onednn(monkeypatch):
    import lmkit_plugins.models.cpu_linear as cpu_linear
    import lmkit_plugins.models.layers as layers

    monkeypatch.setattr(cpu_linear, "_row_gemv", lambda: None)
    kernel = layers.cpu_linear_kernel(CPU, torch.float32)
    assert kernel is not layers._row_gemv_or_onednn
    assert layers.cpu_linear_kernel(CPU, torch.bfloat16) is not layers._row_gemv_or_onednn


def test_loading_the_kernel_adds_no_openmp_runtime(best_kernel):
    # a fresh process: the runtimes mapped after importing torch are all there are after
    # loading the kernel (other packages may bring their own renamed copies; that is fine)
    code = ("import torch; from lmkit_kernels.cpu import build; "
            "before = build.openmp_runtimes(); "
            "from lmkit_kernels.cpu.row_gemv import row_gemv_available; "
            "assert row_gemv_available(); "
            "after = build.openmp_runtimes(); "
            "print(len(before), sorted(after - before))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    count, added = done.stdout.split(" ", 1)
    if count == "0":
        pytest.skip("no /proc/self/maps here")
    assert added.strip() == "[]"


def test_the_source_ships_with_the_package():
    from lmkit_kernels.cpu import row_gemv

    assert row_gemv.SOURCE.exists() and row_gemv.SOURCE.suffix == ".c"
    text = Path(row_gemv.SOURCE).read_text()
    assert all(f"void lmkit_row_gemv_{isa}(" in text for isa in row_gemv.ISAS)


def test_tiles_of_three_or_four_rows_prefetch_the_next_tile(best_kernel):
    # the prefetch must be in the built library (a compiler once dropped _mm_prefetch
    # from target("avx512...") code without a word, see qgemv), in the 3- and 4-row
    # tiles of both builds, and not in the 1- and 2-row tiles, which leave the stream to
    # the hardware prefetcher
    import shutil

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not installed")
    listing = subprocess.run([objdump, "-d", str(build.compile_library(row_gemv.SOURCE))],
                             capture_output=True, text=True, check=True).stdout
    functions = {}
    for block in listing.split("\n\n"):  # objdump separates functions by a blank line
        head = block.strip().splitlines()[0] if block.strip() else ""
        if head.endswith(">:") and "<tile_" in head:
            functions[head.split("<")[1].rstrip(">:")] = block
    assert {"tile_avx512f_4_4", "tile_avx512f_4_1", "tile_avx2_4_3"} <= set(functions)
    for name, body in functions.items():
        x_rows = int(name.rsplit("_", 1)[1])
        assert ("prefetcht0" in body) == (x_rows > 2), name

"""Long model loading work reports progress: the ``pypi:`` download (measured by lmkit on
the file pip writes, served here by a throttled loopback index) and each phase of a GGUF
conversion. stderr is captured, so progress comes as lines (the non-terminal form)."""

from __future__ import annotations

import http.server
import os
import re
import threading
import time

import pytest
from lmkit.loading.gguf import convert_gguf_to_safetensors
from lmkit.loading.progress import LineBar, format_bytes, step
from lmkit.loading.pypi import pip_download
from test_model_sources import write_tiny_llama_gguf, write_wheel

WHEEL_BYTES = 2_000_000


def test_line_bar_reports_every_tenth_and_learns_the_total(capsys):
    bar = LineBar(0, "downloading x")
    bar.advance(100)  # total unknown: nothing yet (one line per 5 s)
    bar.advance(100, total=1000)
    for _ in range(8):
        bar.advance(100)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "lmkit: downloading x: 200 bytes of 1.0 kB (20%)"
    assert lines[-1] == "lmkit: downloading x: 1.0 kB of 1.0 kB (100%)"
    assert len(lines) == 9  # 20%, 30%, ..., 100%: each once
    assert format_bytes(93_100_000) == "93.1 MB"


def test_step_says_what_runs_and_how_long_it_took(capsys):
    with step("building the tokenizer", True):
        time.sleep(0.05)
    with step("silent", False):
        pass
    err = capsys.readouterr().err
    assert "lmkit: building the tokenizer ...\n" in err
    assert re.search(r"lmkit: building the tokenizer: done in \d+\.\d s\n", err)
    assert "silent" not in err


class Throttled(http.server.SimpleHTTPRequestHandler):
    """Serves a folder slowly (about 1.5 MB/s), so the download takes over a second."""

    def copyfile(self, source, outputfile):
        while chunk := source.read(64 * 1024):
            outputfile.write(chunk)
            time.sleep(0.04)

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_index(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    write_wheel(wheels, "bigpkg", "1.0", {"bigpkg/blob.bin": os.urandom(WHEEL_BYTES)})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a, **k: Throttled(*a, directory=str(wheels), **k))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", f"http://127.0.0.1:{server.server_port}/")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    yield
    server.shutdown()
    server.server_close()


def test_pip_download_reports_progress(slow_index, tmp_path, capsys):
    wheel = pip_download("bigpkg==1.0", tmp_path / "dest", progress=True)
    assert wheel.name == "bigpkg-1.0-py3-none-any.whl"
    out, err = capsys.readouterr()
    assert out == ""  # progress goes to stderr: `lmkit generate ... > file` keeps it out
    assert "lmkit: downloading bigpkg==1.0 from PyPI" in err
    assert re.search(r"Downloading .*bigpkg-1\.0-py3-none-any\.whl \(2\.\d MB\)", err)  # pip's
    steps = re.findall(r"lmkit: downloading bigpkg==1\.0: [\d.]+ (?:kB|MB) of 2\.\d MB \((\d+)%\)", err)
    assert len(steps) >= 3, err  # measured while pip ran, not only at the end
    assert [int(s) for s in steps] == sorted(int(s) for s in steps) and steps[-1] == "100"


def test_pip_download_without_progress_is_silent(slow_index, tmp_path, capsys):
    pip_download("bigpkg==1.0", tmp_path / "dest", progress=False)
    assert capsys.readouterr().err == ""


def test_gguf_conversion_reports_each_phase(tmp_path, capsys):
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_file)
    convert_gguf_to_safetensors(gguf_file, tmp_path / "cache", progress=True)
    err = capsys.readouterr().err
    for phase in ("building the model from the GGUF tensors (float32)",
                  "building the tokenizer from the GGUF metadata",
                  "writing the safetensors weights", "writing the tokenizer"):
        assert f"lmkit: {phase} ...\n" in err, err
        assert re.search(rf"lmkit: {re.escape(phase)}: done in \d+\.\d s", err), err
    assert re.search(r"lmkit: converted tiny\.gguf in \d+\.\d s", err)

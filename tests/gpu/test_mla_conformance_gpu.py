"""The MLA attention conformance kit (:mod:`lmkit.testing.mla_attention`) against the
registered ``mla_triton`` and ``mla_flashinfer`` specs on CUDA: every property,
``cuda graphs`` included (``run_mla`` of two layers captured and replayed after new
plans). ``mla_flashinfer`` claims only DeepSeek's latent width (576), so the kit runs it
at kv_lora_rank 512 / rope 64; it skips, with the reason, without FlashInfer::

    python -m pytest -q -m gpu tests/gpu/test_mla_conformance_gpu.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 would run the kernels in the interpreter; unset it",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import unavailable  # noqa: E402
from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.testing.mla_attention import MLAAttentionConformance  # noqa: E402


class TestMLABackendsOnCUDA(MLAAttentionConformance):
    @pytest.fixture(params=["mla_triton", "mla_flashinfer"])
    def attention_backend(self, request):
        reason = unavailable(request.param)
        if reason:
            pytest.skip(f"{request.param}: {reason}")
        host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
        return host.registry.get("attention", request.param).spec

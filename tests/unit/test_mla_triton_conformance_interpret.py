"""The MLA attention conformance kit (:mod:`lmkit.testing.mla_attention`) against
``mla_triton`` in Triton's CPU interpreter (``TRITON_INTERPRET=1``).

The registered spec runs on CUDA only; here it is re-declared for the CPU (the same
class, options and features, ``cuda_graphs`` aside) with the kit's small latent widths
(kv_lora_rank + rope = 80, 128) and DeepSeek's (576, in ``shapes``), in float32 and,
for ``dtypes``, float16 and bfloat16. On a GPU machine the kit runs against the real
specs in ``tests/gpu/test_mla_conformance_gpu.py``.
"""

from __future__ import annotations

import pytest
from interpret_mode import interpreted_spec, require_triton_interpreter

require_triton_interpreter()

from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.testing import mla_attention  # noqa: E402
from lmkit.testing.mla_attention import MLAAttentionConformance  # noqa: E402

#: latent widths: the kit's small dimension sets (80, 128) and DeepSeek's (576)
HEAD_SIZES = {80, 128, 576}


class TestMLATritonInterpreted(MLAAttentionConformance):
    @pytest.fixture
    def attention_backend(self):
        host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
        return interpreted_spec(host.registry.get("attention", "mla_triton").spec,
                                head_size=HEAD_SIZES)

    @pytest.mark.slow
    def test_shapes(self, attention_backend, monkeypatch):
        """The kit's shapes over 4 query heads (each latent width) and 128 (the small
        one), not 16: in float32 the decode kernel tiles 16 heads per program (4 heads:
        one tile, 12 rows masked; 128: eight full tiles) and the prefill kernel runs one
        program per head, so 16 heads (one full tile) is no path the others miss, and
        cost 48 of the interpreter's 110 s. The GPU suite runs all head counts."""
        monkeypatch.setattr(mla_attention, "HEAD_COUNTS", (4,))
        super().test_shapes(attention_backend)

    @pytest.mark.slow
    def test_block_sizes(self, attention_backend):
        super().test_block_sizes(attention_backend)

    @pytest.mark.slow
    def test_dtypes(self, attention_backend):
        super().test_dtypes(attention_backend)

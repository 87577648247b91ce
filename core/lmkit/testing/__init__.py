"""Conformance suites for plugin authors: prove an implementation against lmkit's
reference behaviour with one test file.

One module per extension point; each offers a function that runs every check and
raises :class:`ConformanceFailure` (an ``AssertionError``) naming the property and the
input that broke it, and a pytest-friendly base class with one test per property::

    # tests/test_conformance.py of your plugin package
    import pytest
    from lmkit.testing.attention import AttentionConformance

    class TestMyBackend(AttentionConformance):
        @pytest.fixture
        def attention_backend(self):
            from my_pkg.plugin import SPEC      # a Spec, or the class itself
            return SPEC

=====================  ====================================================  ==============================
module                 what it checks                                        the fixture a subclass defines
=====================  ====================================================  ==============================
``attention``          outputs vs dense causal attention: prefill, chunked   ``attention_backend``
                       prefill over a cached prefix, decode, GQA, head and
                       block sizes, claimed dtypes and features
``scheduler``          token budget, ``max_num_seqs``, every request         ``scheduler``
                       finishes with the right tokens, no starvation,
                       preemption and resumption, aborts free blocks
``executor``           greedy tokens equal to ``uniproc`` on a tiny model    ``executor``
``spec_decode``        valid ids, at most k drafts, determinism, draft       ``spec_proposer``
                       probabilities
``structured_output``  accept / rollback / bitmask against brute force on a  ``structured_output_backend``
                       small vocabulary; the language of each constraint
``offload``            bit-exact round trips, lookup, capacity, failed and   ``offload_manager``
                       corrupt loads
``quantization``       check refuses a missing checkpoint, weights close to  ``quantization_method``
                       the dense ones under HF names, linear, fuse,
                       dequantized rows
=====================  ====================================================  ==============================

Every suite first builds the implementation through its kind's one documented
constructor signature (:data:`lmkit.api.contract.CONSTRUCTORS`) and fails property
``constructor signature`` when the class does not accept it.

Importing ``lmkit.testing`` is cheap; the suite modules import torch.
"""

from lmkit.testing.failure import ConformanceFailure

__all__ = ["ConformanceFailure"]

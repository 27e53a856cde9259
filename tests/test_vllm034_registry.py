"""The plugin's vLLM 0.34 path (vllm_plugin/registry_034.py) against vLLM 0.34.0's real modules.

vLLM 0.34 has no CPU build and pins another torch than this project's environment, so the check
runs in a separate environment (`bash scripts/setup_vllm034.sh`, under $VLLM_MOA_CACHE) in a
subprocess (tests/vllm034_probe.py): vLLM's own plugin loader runs our entry point (declared to
it from pyproject.toml; the checkout is on PYTHONPATH), vLLM's own `SpeculativeConfig` takes
`"method": "moa"` with a drafter directory, and vLLM's own `init_speculator` resolves and builds
our speculator. Controls: configs vLLM must refuse, registered under other names. Config level
only: no 0.34 engine runs here.

Skipped when that environment is missing: CI does not build it (it downloads ~3 GB); set
VLLM_MOA_TEST_REQUIRE_VLLM034=1 to make a missing one fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import make_drafter, make_hf_model
from vllm_moa.tiny import default_cache_dir

pytestmark = pytest.mark.slow  # ~20 s: vLLM 0.34 and torch imported in a fresh process

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "VLLM_MOA_TEST_REQUIRE_VLLM034"


def venv_python() -> Path:
    venv = Path(os.environ.get("VLLM_MOA_VENV_034", default_cache_dir() / "venv-vllm034"))
    python = venv / "bin" / "python"
    if not (venv / ".vllm_moa_installed").is_file() or not python.is_file():
        reason = f"no vLLM 0.34.0 environment at {venv}: run `bash scripts/setup_vllm034.sh`"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1)")
        pytest.skip(reason)
    return python


def entry_point_dist(where: Path) -> Path:
    """A dist-info declaring pyproject.toml's `vllm.general_plugins` entry points, so that vLLM's
    plugin loader finds ours as it would after `pip install vllm-moa`."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as vLLM 0.34 needs
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    dist = where / "vllm_moa_under_test-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-moa-under-test\nVersion: 0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in plugins.items())
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")
    return where


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    """What the probe saw in vLLM 0.34.0, for a tiny Llama target and a MoA drafter for it."""
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.hf_target import HFTarget

    python = venv_python()
    tmp = tmp_path_factory.mktemp("vllm034")
    model = make_hf_model("llama")
    model.save_pretrained(tmp / "target")
    drafter = save_drafter(make_drafter(HFTarget(model)), tmp / "drafter")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{entry_point_dist(tmp / 'entry')}"}
    done = subprocess.run(
        [str(python), str(ROOT / "tests" / "vllm034_probe.py"), str(tmp / "target"), str(drafter)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["drafter"] = str(Path(drafter).resolve())
    return result


def test_the_probe_ran_this_checkout_in_vllm_034(seen):
    assert seen["vllm"] == "0.34.0"
    assert seen["vllm_moa_file"] == str(ROOT / "vllm_moa" / "__init__.py")
    assert seen["speculator_file"] == str(ROOT / "vllm_moa" / "vllm_plugin" / "speculator.py")


def test_the_entry_point_registers_the_method(seen):
    assert seen["registered"] == ["moa"]


def test_vllm_resolves_our_config_and_speculator(seen):
    assert seen["custom_method"] == "moa"
    assert seen["method"] is None  # base_method: no built-in method is taken for MoA
    assert seen["model"] == seen["drafter"]  # MoA's checks ran: the drafter dir, resolved
    assert seen["config_class"] == "vllm_moa.vllm_plugin.registry_034.MoASpeculatorConfig"
    assert seen["speculator_class"] == "vllm_moa.vllm_plugin.speculator.MoASpeculator"
    # built by vLLM's init_speculator, whose constructor says plainly that it cannot draft yet
    assert seen["build"].startswith("SpeculatorNotPortedError: vllm_moa's speculator (vllm_moa.")
    assert "Install vllm==0.33.0" in seen["build"]
    assert seen["num_lookahead_tokens"] == 2  # K draft slots reserved (patch 5 on 0.32 / 0.33)
    assert seen["uses_target_hidden_states"] is False


def test_moa_settings_travel_in_speculator_options(seen):
    assert seen["options_ok"] == "ok: None"
    assert "speculator_options of method 'moa' has no key 'moa_adaptiv'" in seen["options_bad_key"]
    assert seen["options_bad_type"].startswith(
        "TypeError: speculator_options['moa_adaptive'] of method 'moa' must be a bool, got str"
    )
    # vLLM's own check of the options a method supports names our method
    assert (
        "dspark_draft_topk is not supported with speculative method 'moa'"
        in (seen["foreign_option"])
    )


def test_moa_checks_refuse_a_model_for_a_drafter(seen):
    assert 'speculative method "moa": ' in seen["not_a_drafter"]
    assert "is not a vllm-moa drafter" in seen["not_a_drafter"]


def test_controls_a_wrong_config_fails_the_same_resolution(seen):
    assert "'moa_no_class' must set speculator_class" in seen["control_no_class"]
    wrong_base = "TypeError: The config of speculative method 'moa_wrong_base' must be a subclass"
    assert seen["control_wrong_base"].startswith(wrong_base)
    assert seen["control_not_a_speculator"].startswith("TypeError: speculator_class ")
    assert (
        "must be a subclass of vllm.v1.worker.gpu.spec_decode.speculator.BaseSpeculator"
        in (seen["control_not_a_speculator"])
    )
    assert "Unknown speculative method 'moa_never_registered'" in seen["control_unregistered"]


def test_the_patches_refuse_vllm_034(seen):
    assert seen["patches_apply"].startswith(
        "UnsupportedVllmVersionError: vllm_moa's patches are for vLLM 0.32.0 and 0.33.0 only"
    )

"""The plugin's patches, config recognition and start-up errors, and the paged-KV reader."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.fixed_k]  # K every step


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "vllm_moa.vllm_plugin:register" in names


def test_version_check_names_the_supported_version():
    from vllm_moa.vllm_plugin import UnsupportedVllmVersionError, check_vllm_version

    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.0+cpu") == "0.32.0"
    assert check_vllm_version("0.33.0") == "0.33.0"
    assert check_vllm_version("0.34.0") == "0.34.0"
    for version in ("0.35.0", "0.31.0"):
        with pytest.raises(
            UnsupportedVllmVersionError,
            match=rf"supports vLLM 0\.32\.0, 0\.33\.0 and 0\.34\.0 only.*{version}.*"
            r"vllm==0\.33\.0",
        ):
            check_vllm_version(version)


def test_the_patches_refuse_a_release_they_were_not_read_against(monkeypatch):
    """0.34 is supported, by registration (registry_034.py), not by the patches: `apply()` on it
    raises before patching anything."""
    import vllm

    from vllm_moa.vllm_plugin import UnsupportedVllmVersionError, patches

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setattr(patches, "_applied", False)
    with pytest.raises(UnsupportedVllmVersionError, match=r"patches are for vLLM 0\.32\.0 and "
                       r"0\.33\.0 only, not 0\.34\.0"):  # fmt: skip
        patches.apply()


@pytest.mark.parametrize("version", ["0.35.0", "0.32.0"])
def test_an_unsupported_release_loads_the_plugin_without_breaking_vllm(version):
    """vLLM loads general plugins in every process: on a release we do not support, loading
    them must not raise (else no `vllm serve` works in that environment, MoA or not); nothing
    is patched and the log says why. Control: on 0.32.0 the same load adds the method."""
    import subprocess
    import sys

    code = (
        "import vllm\n"
        f"vllm.__version__ = {version!r}\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.config.speculative import SpeculativeConfig\n"
        "print('MOA' if 'moa' in str(SpeculativeConfig.__dataclass_fields__['method'].type)"
        " else 'NO MOA')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip().splitlines()[-1]
    if version == "0.35.0":
        assert said == "NO MOA"
        said_why = "'moa' is not available: vllm_moa supports vLLM 0.32.0, 0.33.0 and 0.34.0"
        assert said_why in done.stderr
    else:
        assert said == "MOA" and "is not available" not in done.stderr


def test_register_is_idempotent_and_extends_the_method_literal():
    from vllm.config.speculative import SpeculativeConfig

    from vllm_moa.vllm_plugin import register

    register()
    register()
    assert "moa" in str(SpeculativeConfig.__dataclass_fields__["method"].type)


@pytest.mark.parametrize("scheduled", [[1], [1, 1, 1, 1], [7, 1, 1, 30, 1]])
def test_no_draft_metadata_is_vllms(scheduled):
    """A MoA step without drafts builds its spec-decode metadata directly (patch 4): the same
    tensors, dtypes and lengths as vLLM's own `_calc_spec_decode_metadata` (prompt chunks
    included: one logit each, at the chunk's last token)."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_moa.vllm_plugin.patches import no_draft_metadata

    cu = np.cumsum(np.array(scheduled, dtype=np.int32), dtype=np.int32)
    input_ids = torch.arange(100, 100 + int(cu[-1]) + 8, dtype=torch.int32)
    runner = SimpleNamespace(
        _arange_scratch=np.zeros(64, dtype=np.int64),
        arange_np=np.arange(64, dtype=np.int64),
        device=torch.device("cpu"),
        input_ids=SimpleNamespace(gpu=input_ids),
        speculative_config=None,
    )
    runner._get_cumsum_and_arange = GPUModelRunner._get_cumsum_and_arange.__get__(runner)
    zeros = np.zeros(len(scheduled), dtype=np.int32)
    theirs = GPUModelRunner._calc_spec_decode_metadata(runner, zeros, cu)  # the real one
    ours = no_draft_metadata(cu, input_ids)
    assert ours.num_draft_tokens == theirs.num_draft_tokens and ours.max_spec_len == 0
    for name in (
        "draft_token_ids", "cu_num_draft_tokens", "cu_num_sampled_tokens",
        "target_logits_indices", "bonus_logits_indices", "logits_indices",
    ):  # fmt: skip
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


def test_no_draft_steps_reuse_metadata_and_update_nothing():
    """Patch 4 on a MoA runner: a decode step without drafts reuses its batch size's metadata
    (equal to vLLM's), a step with prompt tokens gets its own; a step in which nothing was
    drafted gives the scheduler no draft update, one with drafts gives vLLM's."""
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_moa.vllm_plugin import register

    register()
    runner = SimpleNamespace(
        input_ids=SimpleNamespace(gpu=torch.arange(64, dtype=torch.int32)),
        speculative_config=SimpleNamespace(method="moa"),
    )
    zeros = np.zeros(4, dtype=np.int32)
    decode = np.arange(1, 5, dtype=np.int32)
    first = GPUModelRunner._calc_spec_decode_metadata(runner, zeros, decode)
    assert GPUModelRunner._calc_spec_decode_metadata(runner, zeros, decode.copy()) is first
    assert torch.equal(first.logits_indices, torch.arange(4))
    chunk = np.array([1, 2, 3, 30], dtype=np.int32)
    mixed = GPUModelRunner._calc_spec_decode_metadata(runner, zeros, chunk)
    assert mixed is not first and mixed.logits_indices.tolist() == [0, 1, 2, 29]

    runner._draft_token_ids = [[], [], []]
    assert GPUModelRunner.take_draft_token_ids(runner) is None
    runner._draft_token_ids = [[], [5, 6], []]
    runner.num_spec_tokens, runner._draft_token_req_ids = 4, ["a", "b", "c"]
    runner._get_draft_token_ids_cpu = lambda: (runner._draft_token_ids, ["a", "b", "c"])
    taken = GPUModelRunner.take_draft_token_ids(runner)
    assert taken.req_ids == ["a", "b", "c"] and taken.draft_token_ids == [[], [5, 6], []]


def _engine_config(target, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(target), dtype="float32", enforce_eager=True, max_model_len=256,
        speculative_config=spec,
    ).create_engine_config()  # fmt: skip


def test_moa_adaptive_key(moa_pair):
    """`moa_adaptive` is a --speculative-config key of method moa (default true); a typo is
    refused by vLLM's own validation, and the key on another method is refused by name."""
    base = {"method": "moa", "model": str(moa_pair["tli0"]), "num_speculative_tokens": 3}
    assert _engine_config(moa_pair["target"], base).speculative_config.moa_adaptive is True
    spec = _engine_config(moa_pair["target"], {**base, "moa_adaptive": False}).speculative_config
    assert spec.moa_adaptive is False and "adaptive=False" in repr(spec)
    with pytest.raises(Exception, match="moa_adaptiv"):
        _engine_config(moa_pair["target"], {**base, "moa_adaptiv": False})
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match='"moa_adaptive" is a key of speculative method "moa"'):
        _engine_config(moa_pair["target"], {**ngram, "moa_adaptive": False})


def test_batch_size_schedule_is_checked_in_the_config_step(moa_pair):
    """vLLM's dynamic speculation schedule: parsed and normalised by vLLM's own validator for
    MoA (which honours it per step), a bad entry refused by name, a cap above K refused."""
    base = {"method": "moa", "model": str(moa_pair["tli0"]), "num_speculative_tokens": 3}
    key = "num_speculative_tokens_per_batch_size"
    spec = _engine_config(moa_pair["target"], {**base, key: [[9, 64, 1], [1, 8, 3]]})
    assert spec.speculative_config.num_speculative_tokens_per_batch_size == [(1, 8, 3), (9, 64, 1)]
    with pytest.raises(Exception, match=r"num_speculative_tokens_per_batch_size: Batch-size range"):
        _engine_config(moa_pair["target"], {**base, key: [[0, 8, 1]]})
    with pytest.raises(Exception, match=r"caps batch sizes 1-8 at 5 drafts, above .*=3"):
        _engine_config(moa_pair["target"], {**base, key: [[1, 8, 5]]})


def test_vllm_033_keeps_the_schedule_for_moa_only():
    """vLLM 0.33 switches the dynamic speculation schedule off on the V1 runner for methods not
    its own (`VllmConfig._maybe_disable_dynamic_sd_for_v1`, absent in 0.32): the patched check
    leaves MoA's schedule alone, which the proposer honours, and runs vLLM's for the others."""
    from types import SimpleNamespace

    from vllm_moa.vllm_plugin.patches import keep_moa_schedule

    def vllms(self):  # what 0.33 does for methods outside its list
        if self.speculative_config is not None:
            self.speculative_config.num_speculative_tokens_per_batch_size = None

    check = keep_moa_schedule(vllms)
    for method, kept in (("moa", True), ("custom_class", False)):
        spec = SimpleNamespace(method=method, num_speculative_tokens_per_batch_size=[(1, 8, 3)])
        check(SimpleNamespace(speculative_config=spec))
        assert (spec.num_speculative_tokens_per_batch_size is not None) == kept, method
    check(SimpleNamespace(speculative_config=None))  # no speculation: vLLM's own check


def test_method_recognised_from_drafter_config(moa_pair):
    config = _engine_config(moa_pair["target"], {"model": str(moa_pair["tli0"]),
                                                 "num_speculative_tokens": 3})  # fmt: skip
    spec = config.speculative_config
    assert spec.method == "moa"
    assert spec.model == str(moa_pair["tli0"].resolve())
    assert spec.num_speculative_tokens == 3
    # A `vllm-moa train --out` directory is accepted for its drafter/ folder.
    out_dir = moa_pair["tli0"].parent
    spec = _engine_config(
        moa_pair["target"], {"method": "moa", "model": str(out_dir), "num_speculative_tokens": 2}
    ).speculative_config
    assert spec.model == str(moa_pair["tli0"].resolve())
    # MoA runs on the V2 model runner where vLLM picks it (its GPU default).
    assert "moa" not in " ".join(config._get_v2_model_runner_unsupported_features())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "moa", "num_speculative_tokens": 3}, "needs \"model\""),
        ({"method": "moa", "model": "/nonexistent/drafter", "num_speculative_tokens": 3},
         "not a drafter directory"),
        ({"method": "moa", "model": "TLI0"}, "num_speculative_tokens"),
    ],
)  # fmt: skip
def test_bad_speculative_configs_fail_clearly(moa_pair, spec, message):
    spec = {k: (str(moa_pair["tli0"]) if v == "TLI0" else v) for k, v in spec.items()}
    with pytest.raises(Exception, match=message):
        _engine_config(moa_pair["target"], spec)


def test_baseline_drafter_is_refused_with_a_hint(moa_pair, tmp_path):
    from vllm_moa.kinds import BY_NAME

    drafter = tmp_path / "eagle"
    shutil.copytree(moa_pair["tli0"], drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["model_type"] = BY_NAME["eagle"].model_type
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="expected 'moa_drafter'"):
        spec = {"method": "moa", "model": str(drafter), "num_speculative_tokens": 2}
        _engine_config(moa_pair["target"], spec)


def _drafter_for(moa_pair, tmp_path, preset="small", **shape):
    """A MoA drafter for the test target with some of its shape changed."""
    import dataclasses

    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.hf_target import load_target_info

    info = load_target_info(moa_pair["target"])
    info = dataclasses.replace(info, shape=dataclasses.replace(info.shape, **shape))
    other = MoADrafter(make_config(info, preset=preset))
    other.init_weights(0)
    return save_drafter(other, tmp_path / "other")


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ({"num_layers": 5}, "layer count 5, but the target has 3"),
        ({"vocab_size": 1024}, "vocab size 1024, but the target has 512"),
        ({"num_kv_heads": 2}, r"KV width \(num_kv_heads \* head_dim\) 128, but the target has 64"),
    ],
)  # fmt: skip
def test_drafter_for_another_target_is_refused_in_the_config_step(moa_pair, tmp_path, shape,
                                                                  message):  # fmt: skip
    """Refused while vLLM validates its config (no engine, no weights read), naming the drafter,
    both values and the fix."""
    path = _drafter_for(moa_pair, tmp_path, **shape)
    with pytest.raises(Exception, match=message) as info:
        _engine_config(moa_pair["target"], {"model": str(path), "num_speculative_tokens": 2})
    assert str(path) in str(info.value) and "use a drafter made for this target" in str(info.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing", "other_weights"])
def test_damaged_weights_file_is_refused_in_the_config_step(moa_pair, tmp_path, damage):
    drafter = tmp_path / "drafter"
    shutil.copytree(moa_pair["tli0"], drafter)
    weights = drafter / "model.safetensors"
    message = {
        "truncated": "truncated or not a safetensors file",
        "garbage": "truncated or not a safetensors file",
        "missing": "has no model.safetensors",
        "other_weights": "does not match its config.json|has shape",
    }[damage]
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_text("not weights")
    elif damage == "missing":
        weights.unlink()
    else:
        paper = _drafter_for(moa_pair, tmp_path, preset="paper")  # other widths
        shutil.copy(paper / "model.safetensors", weights)
    with pytest.raises(Exception, match=message):
        _engine_config(moa_pair["target"], {"model": str(drafter), "num_speculative_tokens": 2})


def test_a_model_is_not_taken_for_a_drafter(moa_pair):
    with pytest.raises(Exception, match=r"not a vllm-moa drafter: .* model_type 'llama'"):
        spec = {"method": "moa", "model": str(moa_pair["target"]), "num_speculative_tokens": 2}
        _engine_config(moa_pair["target"], spec)


def test_pipeline_parallelism_is_refused_first(moa_pair):
    """Before vLLM's own start-up checks (NUMA, workers): the config step refuses it; tensor
    parallelism passes the same step (it runs: test_vllm_tensor_parallel.py)."""
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "moa", "model": str(moa_pair["tli0"]), "num_speculative_tokens": 2}
    with pytest.raises(Exception, match="does not support pipeline parallelism"):
        EngineArgs(
            model=str(moa_pair["target"]), pipeline_parallel_size=2, speculative_config=spec
        ).create_engine_config()
    config = EngineArgs(
        model=str(moa_pair["target"]), tensor_parallel_size=2, speculative_config=spec
    ).create_engine_config()
    assert config.speculative_config.method == "moa"


def test_long_chains_warn_with_the_trained_range(moa_pair, monkeypatch):
    import logging

    from vllm_moa.vllm_plugin.logs import LOGGER_NAME

    warnings: list[str] = []
    logger = logging.getLogger(LOGGER_NAME)
    monkeypatch.setattr(logger, "warning", lambda msg, *args: warnings.append(msg % args))
    spec = {"method": "moa", "model": str(moa_pair["tli0"]), "num_speculative_tokens": 64}
    _engine_config(moa_pair["target"], spec)
    assert len(warnings) == 1 and "was trained for (5 to 15 tokens)" in warnings[0]
    _engine_config(moa_pair["target"], {**spec, "num_speculative_tokens": 8})
    assert len(warnings) == 1


def test_config_line_names_the_drafter(moa_pair):
    spec = {"method": "moa", "model": str(moa_pair["tli0"]), "num_speculative_tokens": 2}
    line = repr(_engine_config(moa_pair["target"], spec).speculative_config)
    assert str(moa_pair["tli0"].resolve()) in line and "method='moa'" in line


def test_channel_split_reader_matches_layout():
    """FlashAttention/Triton layout: [blocks, heads, block_size, 2 * D], K then V channels."""
    from vllm_moa.vllm_plugin.kv_reader import gather_kv, slots_for_positions

    torch.manual_seed(0)
    blocks, heads, bs, d = 5, 3, 16, 8
    cache = torch.randn(blocks, heads, bs, 2 * d)
    block_ids = [3, 0, 4]
    slots = slots_for_positions(block_ids, bs, 10, 40, torch.device("cpu"))
    k, v = gather_kv(cache, slots, "FLASH_ATTN")
    for i, pos in enumerate(range(10, 40)):
        b, off = block_ids[pos // bs], pos % bs
        torch.testing.assert_close(k[i], cache[b, :, off, :d], rtol=0, atol=0)
        torch.testing.assert_close(v[i], cache[b, :, off, d:], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_layout_probe_reads_back_what_vllm_wrote(dtype):
    """Write random K/V with vLLM's CPU cache writer, read them back through the probed layout."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_moa.vllm_plugin.kv_reader import CpuBlockLayout, gather_kv

    heads, bs, d, blocks = 2, 32, 64, 4
    isa = _get_attn_isa(dtype, bs, d)
    layout = CpuBlockLayout.probe(heads, bs, d, dtype, isa)
    cache = torch.zeros(blocks, heads, 2 * bs, d, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    slots = torch.tensor([5, 40, 41, 127, 64, 0])
    k = torch.randn(len(slots), heads, d).to(dtype)
    v = torch.randn(len(slots), heads, d).to(dtype)
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    got_k, got_v = gather_kv(cache.view(blocks, heads, bs, 2 * d), slots, "CPU_ATTN", layout)
    torch.testing.assert_close(got_k, k, rtol=0, atol=0)
    torch.testing.assert_close(got_v, v, rtol=0, atol=0)

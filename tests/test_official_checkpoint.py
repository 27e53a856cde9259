"""`vllm-moa convert-official` against the logits of the MoA authors' own code.

tests/data/official/<geometry>/ holds a tiny random Llama target (RoPE theta 500000), one random
drafter in both release layouts (written by their `save_pretrained` and their
`vllm/convert_checkpoint.py`) and the logits their forward gives with the first P tokens verified
and the rest teacher-forced drafts, for TLI 0 and 1 (scripts/make_official_fixtures.py: commit
eb554aa, transformers 4.45.2, how to rerun). Geometry `lsa64` has LSA heads of 64, `lsa32` of 32;
`lsa64_llama3` is lsa64 on a target with Llama-3.1-style RoPE scaling (`llama3`, factor 8,
original length 16, 18 verified tokens and drafts at positions 18..23), which their SA applies
and their CA and LSA do not (the script checks both under 4.45.2).
The converted drafter drafts through the standalone engine's proposer (`MoAProposer`), the path
inference runs, and must give their rows P..T-1.

Tolerance: both sides compute in float32 on the same bfloat16-valued weights and differ only in
operation order (fused SDPA against their matmul-softmax, where the RoPE tables are built, how
GQA heads are repeated). float32 rounds at 6e-8 relative; about ten dependent stages (LSA, mean,
Ekv2E, SA, CA, their MLPs, TLI's target layer, the LM head), each a sum of at most 128 products,
keep the error near 1e-6 on logits of at most 5.5: observed 2.3e-6 at most (1.6e-6 on
lsa64_llama3; their own inference class and training forward differ by 1.4e-6 on these
fixtures). ATOL 1e-4 leaves a 40x margin, and each control below moves some logit by 0.036 to
2.6 (dropping the RoPE scaling: 0.86 to 1.2), at least 360x ATOL.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_moa.checkpoint import ConvertOptions, convert_official, load_drafter
from vllm_moa.cli.main import main
from vllm_moa.decoding.sampling import SamplingParams
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.hf_target import HFTarget
from vllm_moa.hf_target.info import load_target_info

DATA = Path(__file__).parent / "data" / "official"
SCALED = "lsa64_llama3"  # lsa64 on a target with Llama-3.1-style RoPE scaling
GEOMETRIES = ("lsa64", "lsa32", SCALED)
LAYOUTS = ("release_training", "release_moa_spec")
ATOL = 1e-4
CONTROL_MARGIN = 100 * ATOL  # a control must move some logit by at least this


def _golden(geometry: str) -> tuple[dict[str, torch.Tensor], dict]:
    manifest = json.loads((DATA / geometry / "manifest.json").read_text())
    return load_file(str(DATA / geometry / "golden.safetensors")), manifest


def _convert(tmp_path: Path, geometry: str, layout: str, tli: int, with_target: bool) -> Path:
    target = load_target_info(DATA / geometry / "target") if with_target else None
    options = ConvertOptions(tli=tli, target=target)
    return convert_official(DATA / geometry / layout, tmp_path / f"{layout}_{tli}", options)


def _drafted_logits(
    drafter: MoADrafter, geometry: str, target_dir: Path | None = None
) -> torch.Tensor:
    """The proposer's logits [T - P, V] for rows P..T-1: prefill on the P verified tokens, then
    one chain of teacher-forced drafts from token P (on the fixture's target by default)."""
    golden, manifest = _golden(geometry)
    ids, p = golden["input_ids"].tolist(), manifest["verified"]
    target_dir = target_dir or DATA / geometry / "target"
    target = HFTarget.from_pretrained(target_dir, dtype=torch.float32)
    proposer = MoAProposer(drafter.float(), target)
    proposer.start(ids[:p], target.forward(torch.tensor(ids[:p])))
    proposal = proposer.propose(ids[p], len(ids) - p, SamplingParams(), None, forced=ids[p + 1 :])
    return proposal.logits


@pytest.mark.parametrize("tli", [0, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_converted_release_drafts_their_logits(tmp_path, geometry, layout, tli):
    """Both layouts convert to a drafter whose drafts carry their logits. The training layout is
    converted from its own config.json alone; the moa_spec layout needs --target."""
    golden, manifest = _golden(geometry)
    out = _convert(tmp_path, geometry, layout, tli, with_target=layout == "release_moa_spec")
    drafter = load_drafter(out)
    c = drafter.config
    g = manifest["geometry"]
    assert c.lsa_num_heads == g["num_heads"]  # the target's head count, as their LSA has
    assert c.lsa_width // c.lsa_num_heads == manifest["lsa_head_size"]
    assert c.lsa_num_kv_heads == g["lsa_kv_heads"] and c.sa_num_kv_heads == g["token_kv_heads"]
    assert c.rope_theta == c.lsa_rope_theta == manifest["rope_theta"] and c.tli == tli
    assert c.sa_rope_scaling == manifest.get("rope_scaling")  # SA only, as their training code
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"  # kept
    expected = golden[f"logits_tli{tli}"][manifest["verified"] :]
    torch.testing.assert_close(_drafted_logits(drafter, geometry), expected, atol=ATOL, rtol=0)


def _full_sequence_logits(drafter: MoADrafter, geometry: str) -> torch.Tensor:
    """TLI 0 logits [T, V] of the training-time forward with their memory mask (row i sees
    memory rows j <= min(i, P-1)), on the fixture's target."""
    golden, manifest = _golden(geometry)
    target = HFTarget.from_pretrained(DATA / geometry / "target", dtype=torch.float32)
    ids = golden["input_ids"]
    features = target.forward_batch(ids[None]).layer_kv  # [1, T, L, 2*E_kv]
    limit = torch.arange(len(ids)).clamp(max=manifest["verified"] - 1) + 1
    with torch.no_grad():
        predicted = drafter(target.embed(ids)[None], features, limit)
    return target.lm_logits(predicted[0])


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_full_sequence_forward_matches_every_row(tmp_path, geometry):
    """TLI 0, all T rows, prompt rows included."""
    golden, _ = _golden(geometry)
    drafter = load_drafter(_convert(tmp_path, geometry, LAYOUTS[0], 0, False), dtype=torch.float32)
    logits = _full_sequence_logits(drafter, geometry)
    torch.testing.assert_close(logits, golden["logits_tli0"], atol=ATOL, rtol=0)


def _with(drafter: MoADrafter, **changes) -> MoADrafter:
    """The same weights under a changed configuration."""
    other = MoADrafter(drafter.config.replace(**changes))
    other.load_state_dict(drafter.state_dict())
    return other


@pytest.mark.parametrize(
    ("geometry", "tli", "changes"),
    [
        ("lsa64", 0, {"lsa_rope_theta": 10000.0}),  # the old converter's LSA base
        ("lsa64", 1, {"rope_theta": 10000.0}),  # SA/CA without the target's base
        ("lsa32", 0, {"lsa_num_heads": 1, "lsa_num_kv_heads": 1}),  # old fixed LSA head size 64
        ("lsa32", 1, {"tli": 0}),  # a wrong TLI
    ],
)
def test_controls_fail(tmp_path, geometry, tli, changes):
    """Each misconfiguration the converter used to make (or could make) moves the logits far
    outside the tolerance: the comparison above can fail."""
    golden, manifest = _golden(geometry)
    drafter = load_drafter(_convert(tmp_path, geometry, LAYOUTS[1], tli, True))
    bad = _drafted_logits(_with(drafter, **changes), geometry)
    expected = golden[f"logits_tli{tli}"][manifest["verified"] :]
    assert (bad - expected).abs().max() > CONTROL_MARGIN


def _unscaled_copy(tmp_path: Path, name: str) -> Path:
    """A copy of the rope-scaled fixture's `name` directory with `rope_scaling` null."""
    dst = tmp_path / f"unscaled_{name}"
    shutil.copytree(DATA / SCALED / name, dst)
    config = json.loads((dst / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    config["rope_scaling"] = None
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("layout", "tli"), [(LAYOUTS[0], 0), (LAYOUTS[1], 1)])
def test_rope_scaled_release_with_the_scaling_stripped_fails(tmp_path, layout, tli):
    """Control for the rope-scaled fixture: the same release and target with `rope_scaling`
    stripped from their config.json convert to an unscaled drafter, which misses their logits."""
    golden, manifest = _golden(SCALED)
    target_dir = _unscaled_copy(tmp_path, "target")
    release = _unscaled_copy(tmp_path, layout)
    target = load_target_info(target_dir) if layout == LAYOUTS[1] else None
    out = convert_official(release, tmp_path / "out", ConvertOptions(tli=tli, target=target))
    drafter = load_drafter(out)
    assert drafter.config.sa_rope_scaling is None
    bad = _drafted_logits(drafter, SCALED, target_dir)
    expected = golden[f"logits_tli{tli}"][manifest["verified"] :]
    assert (bad - expected).abs().max() > CONTROL_MARGIN


def test_rope_scaled_release_needs_the_scaling_in_sa(tmp_path):
    """Control, SA alone: the converted drafter with SA's scaling dropped (CA, LSA and the
    target as converted) misses their rows, so the golden logits carry their SA's scaling."""
    golden, manifest = _golden(SCALED)
    drafter = load_drafter(_convert(tmp_path, SCALED, LAYOUTS[0], 0, False), dtype=torch.float32)
    assert drafter.config.sa_rope_scaling is not None
    bad = _full_sequence_logits(_with(drafter, sa_rope_scaling=None), SCALED)
    p = manifest["verified"]
    assert (bad[p:] - golden["logits_tli0"][p:]).abs().max() > CONTROL_MARGIN


def _edited_release(tmp_path: Path, layout: str = LAYOUTS[1], **config_changes) -> Path:
    """A copy of lsa64's release whose config.json has `config_changes` (None deletes a key)."""
    src = tmp_path / "edited"
    shutil.copytree(DATA / "lsa64" / layout, src)
    config = json.loads((src / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_refusals_name_the_missing_fact(tmp_path):
    target = load_target_info(DATA / "lsa64" / "target")
    moa_spec = DATA / "lsa64" / LAYOUTS[1]
    with pytest.raises(ValueError, match=r"drops num_hidden_layers.*pass --target"):
        convert_official(moa_spec, tmp_path / "o", ConvertOptions(tli=0))
    with pytest.raises(ValueError, match=r"does not record TLI.*pass --tli"):
        convert_official(moa_spec, tmp_path / "o", ConvertOptions(target=target))
    other = load_target_info(DATA / "lsa32" / "target")
    with pytest.raises(ValueError, match=r"E_kv .* 64 but the target has 32: pass --target"):
        convert_official(moa_spec, tmp_path / "o", ConvertOptions(tli=0, target=other))
    with pytest.raises(ValueError, match=r"TLI 3 must be in \[0, 3\)"):
        convert_official(moa_spec, tmp_path / "o", ConvertOptions(tli=3, target=target))


@pytest.mark.parametrize(
    ("changes", "layout", "message"),
    [
        ({"rope_theta": 10000.0}, LAYOUTS[1], r"rope_theta 10000.0 but the target has 500000.0"),
        # tests/test_rope_scaling.py converts rope-scaled releases; here: an unscaled target
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, LAYOUTS[1], r"has RoPE scal"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, LAYOUTS[1], "'dynamic'"),
        ({"rope_theta": None}, LAYOUTS[0], "lacks 'rope_theta'"),
        ({"disable_LSA": True}, LAYOUTS[1], "disable_LSA"),
        ({"tli": 1}, LAYOUTS[0], r"--tli 0 contradicts .* TLI 1"),
        ({"layer_self_attention_num_key_value_heads": 2}, LAYOUTS[1], "tensors give 1"),
        ({"model_type": "llama", "num_hidden_layers": None}, LAYOUTS[1], "neither of the"),
        ({"num_hidden_layers": 4}, LAYOUTS[0], "num_hidden_layers 4 but the target has 3"),
    ],
)
def test_refused_release_configs(tmp_path, changes, layout, message):
    src = _edited_release(tmp_path, layout, **changes)
    target = load_target_info(DATA / "lsa64" / "target")
    with pytest.raises(ValueError, match=message):
        convert_official(src, tmp_path / "o", ConvertOptions(tli=0, target=target))


def test_qwen2_style_biases_are_refused(tmp_path):
    """Their Qwen2 drafter's SA and LSA have q/k/v biases, which our drafter does not."""
    src = _edited_release(tmp_path)
    weights = load_file(str(src / "model.safetensors"))
    weights["self_attention.self_attn.q_proj.bias"] = torch.zeros(64, dtype=torch.bfloat16)
    save_file(weights, str(src / "model.safetensors"))
    target = load_target_info(DATA / "lsa64" / "target")
    with pytest.raises(ValueError, match=r"attention biases .*q_proj.bias.*Qwen2"):
        convert_official(src, tmp_path / "o", ConvertOptions(tli=0, target=target))


def test_cli_convert_official(tmp_path, capsys):
    src, target = DATA / "lsa32" / LAYOUTS[1], DATA / "lsa32" / "target"
    argv = ["convert-official", str(src), str(tmp_path / "d"), "--target", str(target)]
    assert main([*argv, "--tli", "1"]) == 0
    assert "converted" in capsys.readouterr().out
    assert load_drafter(tmp_path / "d").config.tli == 1
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-moa convert-official: error:") and "--tli" in err
    assert "\n" not in err

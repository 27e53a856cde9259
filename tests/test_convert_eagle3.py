"""`vllm-moa convert-official` on the EAGLE-3 authors' releases
(vllm_moa/checkpoint/official_eagle3.py).

The fixture release (tests/data/eagle3, made by the authors' own code) converts into a drafter
that drafts what tests/test_eagle3_reference.py's hand renaming drafts (the same weights under
the same config: exactly) and hence the authors' golden chain; `export-eagle` of it writes the
release's tensors back bit for bit. A reduced draft vocabulary, made by our code and exported,
converts back into a drafter that drafts the same tokens. Each refusal is one line naming the
file and the defect; each is followed by its control (the undamaged copy converts).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_cli import run_cli
from tests.test_eagle3_reference import (
    ATOL,
    CONTROL_MARGIN,
    DATA,
    _drafted,
    _drafter,
    _golden,
    _target,
    release_config,
)
from vllm_moa.checkpoint import ConvertOptions, convert_official, load_drafter, save_drafter
from vllm_moa.checkpoint.official_eagle3 import is_eagle3_release
from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle
from vllm_moa.decoding.proposer import DraftProposal
from vllm_moa.drafters.eagle3.model import Eagle3Drafter
from vllm_moa.hf_target import load_target_info

RELEASE, TARGET = DATA / "release", DATA / "target"
WEIGHTS = "model.safetensors"


def _options() -> ConvertOptions:
    return ConvertOptions(target=load_target_info(TARGET))


def _converted(src: Path, out: Path, dtype: torch.dtype | None = torch.float32) -> Eagle3Drafter:
    drafter = load_drafter(convert_official(src, out, _options()), _target().shape, dtype=dtype)
    assert isinstance(drafter, Eagle3Drafter)
    return drafter


def _drafts(drafter: Eagle3Drafter, forced: bool = True) -> DraftProposal:
    """`_drafted` on a fresh target (the target's KV cache keeps what a proposer ran)."""
    return _drafted(drafter, _target(), forced)


def _copy(src: Path, tmp_path: Path, name: str = "release") -> Path:
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


def _edit_config(d: Path, **changes: object) -> None:
    """Set config.json keys (None deletes one)."""
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))


def _edit_weights(d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(d / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(d / WEIGHTS))


# -- the fixture release ------------------------------------------------------------------------


def test_cli_converts_the_release(tmp_path, capsys):
    """Through the CLI: our EAGLE-3 drafter directory, config as the hand mapping builds it,
    weights in the release's dtype; without --target, or with --tli, one line naming the fix."""
    out = tmp_path / "d"
    code, stdout, _ = run_cli(
        capsys, "convert-official", str(RELEASE), str(out), "--target", str(TARGET)
    )
    assert code == 0 and "converted" in stdout
    drafter = load_drafter(out, _target().shape)
    assert drafter.config == release_config(_target())
    assert all(t.dtype == torch.bfloat16 for t in _release_tensors(out).values())
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["training"]["converted_from"]
    for extra, fix in (
        ((), "pass --target TARGET_DIR"),
        (("--target", str(TARGET), "--tli", "1"), "drop it"),
    ):
        code, _, err = run_cli(
            capsys, "convert-official", str(RELEASE), str(tmp_path / "x"), *extra
        )
        line = err.strip()
        assert code == 1 and "\n" not in line and "Traceback" not in line
        assert line.startswith("vllm-moa convert-official: error:") and fix in line
    assert not (tmp_path / "x").exists()


def test_converted_drafts_the_renamed_release(tmp_path):
    """The converted drafter's drafts (forced along the data, and greedy) are the hand-renamed
    release's, exactly (the same bfloat16 weights in float32, the same config and code), hence
    their inference logits and their `topK_genrate` chain within ATOL (test_eagle3_reference)."""
    golden, _ = _golden()
    converted, renamed = _converted(RELEASE, tmp_path / "d"), _drafter(_target())
    for forced in (True, False):
        ours, theirs = _drafts(converted, forced), _drafts(renamed, forced)
        assert ours.tokens == theirs.tokens
        assert torch.equal(ours.logits, theirs.logits)
    chain = _drafts(converted, forced=False)
    assert chain.tokens == golden["greedy_tokens"].tolist()
    torch.testing.assert_close(chain.logits, golden["greedy_logits"], atol=ATOL, rtol=0)
    forced_logits = _drafts(converted).logits
    torch.testing.assert_close(forced_logits, golden["inference_logits"], atol=ATOL, rtol=0)


def test_stated_feature_layers_are_used(tmp_path):
    """The layer ids a release states (top level, or in vLLM's nested eagle_config) are taken
    as stated; the control: other layers than the release was trained on draft other logits."""
    golden, _ = _golden()
    for key, ids in (("top", [2, 4, 5]), ("nested", [2, 4, 6])):
        d = _copy(RELEASE, tmp_path, key)
        if key == "top":
            _edit_config(d, eagle_aux_hidden_state_layer_ids=ids)
        else:
            _edit_config(d, eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        drafter = _converted(d, tmp_path / f"{key}_out")
        assert drafter.config.feature_layers == tuple(ids)
        error = (_drafts(drafter).logits - golden["inference_logits"]).abs().max()
        assert error <= ATOL if ids == [2, 4, 5] else error > CONTROL_MARGIN


def _release_tensors(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / WEIGHTS))


def test_export_of_the_converted_drafter_is_the_release(tmp_path):
    """`export-eagle` of the converted drafter writes the release's tensors bit for bit (less
    d2t / t2d, the identity maps of a whole vocabulary, which vLLM refuses then). Control: a
    release with two same-shaped tensors swapped converts too (shapes cannot tell), and the
    round trip tells it from the original."""
    release = _release_tensors(RELEASE)

    def round_trip(src: Path, name: str) -> dict[str, torch.Tensor]:
        out = convert_official(src, tmp_path / name, _options())
        return _release_tensors(export_vllm_eagle(out, TARGET, tmp_path / f"{name}_x"))

    exported = round_trip(RELEASE, "d")
    assert sorted(exported) == sorted(set(release) - {"d2t", "t2d"})
    assert all(torch.equal(exported[n], release[n]) for n in exported)
    assert all(exported[n].dtype == release[n].dtype for n in exported)

    def swap(t: dict[str, torch.Tensor]) -> None:
        gate, up = "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"
        t[gate], t[up] = t[up], t[gate]

    swapped = _copy(RELEASE, tmp_path, "swapped")
    _edit_weights(swapped, swap)
    exported = round_trip(swapped, "s")
    assert not all(torch.equal(exported[n], release[n]) for n in exported)


def test_pytorch_bin_weights_convert_like_safetensors(tmp_path):
    """The authors' Hugging Face uploads hold pytorch_model.bin: read with weights_only=True,
    converted to the same drafter bit for bit as the safetensors copy. Control: a .bin with one
    weight changed converts to another drafter."""
    reference = _release_tensors(convert_official(RELEASE, tmp_path / "st", _options()))

    def from_bin(name: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> dict:
        d = _copy(RELEASE, tmp_path, name)
        tensors = _release_tensors(d)
        edit(tensors)
        (d / WEIGHTS).unlink()
        torch.save(tensors, d / "pytorch_model.bin")
        return _release_tensors(convert_official(d, tmp_path / f"{name}_out", _options()))

    same = from_bin("bin", lambda t: None)
    assert sorted(same) == sorted(reference)
    assert all(torch.equal(same[n], reference[n]) for n in same)
    changed = from_bin("changed", lambda t: t["fc.weight"].mul_(2))
    assert not torch.equal(changed["fc.weight"], reference["fc.weight"])


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_rope_scaling_in_both_spellings(tmp_path, spelling):
    """A release's RoPE scaling (transformers 4's `rope_scaling` or 5's `rope_parameters`, which
    also carries the base) is recorded as the target's; the control: another factor than the
    target's is refused (our drafter applies the target's scaling)."""
    scaling = {"rope_type": "linear", "factor": 2.0}
    target_dir = _copy(TARGET, tmp_path, "target")
    _edit_config(target_dir, rope_scaling=scaling)
    options = ConvertOptions(target=load_target_info(target_dir))
    for factor in (2.0, 4.0):
        d = _copy(RELEASE, tmp_path, f"release_{factor}")
        stated = {**scaling, "factor": factor}
        if spelling == "rope_parameters":
            _edit_config(d, rope_parameters={**stated, "rope_theta": 500000.0})
        else:
            _edit_config(d, rope_scaling=stated, rope_theta=500000.0)
        if factor == 4.0:
            with pytest.raises(ValueError, match=r"has RoPE scaling .*4.0.* but the target has"):
                convert_official(d, tmp_path / "refused", options)
            continue
        config = load_drafter(convert_official(d, tmp_path / "ok", options)).config
        assert config.rope_scaling == scaling and config.rope_theta == 500000.0


# -- a reduced draft vocabulary -------------------------------------------------------------------

DRAFT_VOCAB = 48


def _reduced_drafter() -> Eagle3Drafter:
    """A drafter of ours over 48 draft tokens (random ascending ids below 127, so that + 1 stays
    in the vocabulary), random weights large enough to give distinct logits."""
    drafter = Eagle3Drafter(release_config(_target()).replace(draft_vocab_size=DRAFT_VOCAB))
    drafter.init_weights(seed=3, std=0.2)
    gen = torch.Generator().manual_seed(0)
    drafter.set_draft_vocab(torch.randperm(127, generator=gen)[:DRAFT_VOCAB].sort().values)
    return drafter.eval()


def _reduced_release(tmp_path: Path, drafter: Eagle3Drafter) -> Path:
    """Our drafter saved and exported by `export-eagle`: the authors' layout with d2t / t2d."""
    ours = save_drafter(drafter, tmp_path / "ours")
    return export_vllm_eagle(ours, TARGET, tmp_path / "reduced_release")


def _shift_vocab(t: dict[str, torch.Tensor]) -> None:
    """Every draft token's target id + 1, t2d to match (a consistent, wrong map)."""
    t["d2t"] = t["d2t"] + 1
    t["t2d"] = torch.roll(t["t2d"], 1)


def test_reduced_vocabulary_converts_back_to_the_same_drafts(tmp_path):
    """Exported, then converted back: the same maps, the same drafts (tokens and logits, forced
    and greedy), and export-eagle writes the release back bit for bit. Control: the release with
    d2t shifted by one (t2d to match) converts, and drafts other tokens."""
    drafter = _reduced_drafter()
    release = _reduced_release(tmp_path, drafter)
    assert {"d2t", "t2d"} <= set(_release_tensors(release))
    converted = _converted(release, tmp_path / "back")
    assert torch.equal(converted.draft_token_ids(), drafter.draft_token_ids())
    for forced in (True, False):
        ours, theirs = _drafts(converted, forced), _drafts(drafter, forced)
        assert ours.tokens == theirs.tokens
        assert torch.equal(ours.logits, theirs.logits)
    again = export_vllm_eagle(tmp_path / "back", TARGET, tmp_path / "again")
    original, exported = _release_tensors(release), _release_tensors(again)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[n], exported[n]) for n in original)

    shifted = _copy(release, tmp_path, "shifted")
    _edit_weights(shifted, _shift_vocab)
    wrong = _converted(shifted, tmp_path / "shifted_out")
    assert _drafts(wrong, False).tokens != _drafts(drafter, False).tokens


REDUCED_REFUSALS = {
    "t2d_of_another_map": (
        lambda t: t.update(t2d=torch.roll(t["t2d"], 1)),
        r"t2d marks 48 target tokens, not the 48 d2t maps draft ids to",
    ),
    "d2t_not_ascending": (
        lambda t: t.update(d2t=t["d2t"].flip(0)),
        r"d2t maps draft ids to target ids .* not strictly ascending in 0..127",
    ),
    "d2t_out_of_range": (
        lambda t: t.update(d2t=t["d2t"] + 200, t2d=torch.ones(128, dtype=torch.bool)),
        r"not strictly ascending in 0..127",
    ),
    "d2t_missing": (lambda t: t.pop("d2t"), r"lacks d2t, which maps a reduced draft vocabulary"),
    "d2t_float": (
        lambda t: t.update(d2t=t["d2t"].float()),
        r"d2t must be integer and t2d bool, got .*float32",
    ),
    "d2t_shorter": (
        lambda t: t.update(d2t=t["d2t"][:-1]),
        r"d2t has shape \(47,\) but draft_vocab_size is 48",
    ),
}


@pytest.mark.parametrize("case", sorted(REDUCED_REFUSALS))
def test_reduced_vocabulary_refusals(tmp_path, case):
    """A d2t / t2d that contradicts draft_vocab_size or each other is refused naming the file;
    the control: the unedited export converts."""
    edit, message = REDUCED_REFUSALS[case]
    release = _reduced_release(tmp_path, _reduced_drafter())
    damaged = _copy(release, tmp_path, "damaged")
    _edit_weights(damaged, edit)
    with pytest.raises(ValueError, match=message) as refused:
        convert_official(damaged, tmp_path / "out", _options())
    assert str(damaged / WEIGHTS) in str(refused.value)
    assert not (tmp_path / "out").exists()
    convert_official(release, tmp_path / "out", _options())


# -- refusals of the fixture release, edited ------------------------------------------------------


def _unlink(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def _config(**changes: object) -> Callable[[Path], None]:
    return lambda d: _edit_config(d, **changes)


def _weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    return lambda d: _edit_weights(d, edit)


def _damaged_bin(d: Path) -> None:
    (d / WEIGHTS).unlink()
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a zip")


def _set(name: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.update({name: value})


_NAN_FC = torch.full((64, 192), float("nan"), dtype=torch.bfloat16)
REFUSALS = {
    "no_config": (_unlink("config.json"), r"has no config.json"),
    "config_not_json": (
        lambda d: (d / "config.json").write_text("{trunc"),
        r"config.json is not valid JSON .*: truncated or damaged",
    ),
    "no_weights": (_unlink(WEIGHTS), r"has no weights \(no \*.safetensors, no pytorch_model"),
    "damaged_bin": (_damaged_bin, r"pytorch_model.bin is truncated or not a .bin weights file"),
    "norm_before_residual": (
        _config(norm_before_residual=True),
        r"sets norm_before_residual \(the residual is hidden_norm\(h\), not h\)",
    ),
    "nested_fc_norm": (_config(eagle_config={"fc_norm": True}), r"sets fc_norm"),
    "two_layers": (_config(num_hidden_layers=2), r"num_hidden_layers 2; .* needs 1"),
    "speculators": (_config(speculators_model_type="eagle3"), r"speculators format"),
    "other_width": (_config(target_hidden_size=128), r"target_hidden_size 128; .* needs 64"),
    "head_dim": (_config(head_dim=32), r"head_dim 32 is not hidden_size / num_attention_heads"),
    "no_mlp_size": (_config(intermediate_size=None), r"lacks 'intermediate_size'"),
    "string_size": (_config(num_key_value_heads="2"), r"num_key_value_heads must be an integer"),
    "missing_tensor": (
        _weights(lambda t: t.pop("midlayer.mlp.up_proj.weight")),
        r"missing \['midlayer.mlp.up_proj.weight'\], unexpected \[\]",
    ),
    "extra_embedding": (
        _weights(_set("embed_tokens.weight", torch.zeros(128, 64, dtype=torch.bfloat16))),
        r"unexpected \['embed_tokens.weight'\] \(an embedding of its own",
    ),
    "mlp_size_vs_config": (
        _config(intermediate_size=128),
        r"midlayer.mlp.\w+_proj.weight has shape \(\w+, \w+\), config implies",
    ),
    "draft_vocab_vs_d2t": (
        _config(draft_vocab_size=64),
        r"d2t has shape \(128,\) but draft_vocab_size is 64",
    ),
    "d2t_not_identity": (
        _weights(_set("d2t", torch.arange(128) % 2)),
        r"draft_vocab_size 128 is the whole vocabulary, but d2t / t2d do not map",
    ),
    "hidden_vs_target": (
        _config(hidden_size=32, intermediate_size=96),
        r"hidden_size 32 but the target has 64: pass --target",
    ),
    "vocab_vs_target": (_config(vocab_size=256), r"vocab_size 256 but the target has 128"),
    "layers_vs_target": (
        _config(eagle_aux_hidden_state_layer_ids=[2, 4, 8]),
        r"feature layers \[2, 4, 8\], with a 8-layer target: .* must lie in 1..L-1",
    ),
    "nan_weight": (_weights(_set("fc.weight", _NAN_FC)), r"1 of 13 tensors hold NaN or Inf: fc"),
    "integer_weight": (
        _weights(_set("norm.weight", torch.ones(64, dtype=torch.int32))),
        r"norm.weight \(int32\); the authors' releases are floating point",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_defective_release_is_refused(tmp_path, case):
    """One ValueError / FileNotFoundError naming the release's file and the defect, nothing
    written; the control: the same directory with the original files back converts."""
    damage, message = REFUSALS[case]
    d = _copy(RELEASE, tmp_path)
    damage(d)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as refused:
        convert_official(d, tmp_path / "out", _options())
    assert str(d) in str(refused.value)
    assert not (tmp_path / "out").exists()
    for extra in d.glob("pytorch_model*.bin"):
        extra.unlink()
    shutil.copytree(RELEASE, d, dirs_exist_ok=True)
    assert load_drafter(convert_official(d, tmp_path / "out", _options())).config.vocab_size


def test_a_defective_release_is_one_cli_line(tmp_path, capsys):
    """Through the CLI, a refusal is one line (no traceback) naming the file; a drafter of ours
    is not converted again."""
    d = _copy(RELEASE, tmp_path)
    _edit_config(d, norm_before_residual=True)
    for src, fragment in ((d, "norm_before_residual"), (tmp_path / "ours", "already a vllm-moa")):
        if src.name == "ours":
            convert_official(RELEASE, src, _options())
        code, _, err = run_cli(
            capsys, "convert-official", str(src), str(tmp_path / "o"), "--target", str(TARGET)
        )
        line = err.strip()
        assert code == 1 and "\n" not in line and "Traceback" not in line
        assert str(src) in line and fragment in line


# -- recognition ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "eagle3"),
    [
        ({"architectures": ["LlamaForCausalLMEagle3"]}, True),  # vLLM's test: Eagle3 in the name
        ({"architectures": ["Eagle3LlamaForCausalLM"]}, True),
        ({"draft_vocab_size": 128}, True),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}, True),
        ({"architectures": ["LlamaForCausalLM"]}, False),  # control: a Llama config alone
        ({"architectures": ["MOASpec"], "num_hidden_layers": 3}, False),  # control: MoA's
    ],
)
def test_recognised_by_its_config(tmp_path, cfg, eagle3):
    assert is_eagle3_release(tmp_path, cfg) is eagle3


def test_recognised_by_its_tensors(tmp_path):
    """A config.json without EAGLE-3's keys: the `midlayer.*` tensors tell; converted with the
    whole vocabulary (vLLM's default for a missing draft_vocab_size). Control: the MoA authors'
    release is not taken for one, and a directory that is neither is refused naming both."""
    d = _copy(RELEASE, tmp_path)
    _edit_config(d, draft_vocab_size=None)
    assert is_eagle3_release(d, json.loads((d / "config.json").read_text()))
    assert _converted(d, tmp_path / "out").config.draft_vocab_size == 128
    moa = Path(__file__).parent / "data" / "official" / "lsa64" / "release_training"
    assert not is_eagle3_release(moa, json.loads((moa / "config.json").read_text()))
    neither = tmp_path / "neither"
    neither.mkdir()
    (neither / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match=r"neither of the MoA release's .* nor an EAGLE-3"):
        convert_official(neither, tmp_path / "o", _options())

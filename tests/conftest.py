"""Shared fixtures: tiny random Hugging Face targets (head_dim 64, as vLLM's CPU backend needs)."""

from __future__ import annotations

import os

import torch

# Triton kernels run in the interpreter when there is no GPU (compiled on CUDA, where the kernel
# tests run on the GPU); set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from vllm_moa.adaptive import ADAPTIVE_ENV, StepCosts
from vllm_moa.drafters.moa.model import MoADrafter
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.drafters.presets import TargetInfo, make_config
from vllm_moa.hf_target import HFTarget

# What the suite tests is the default configuration (adaptive speculation) unless a test says
# otherwise: a shell's VLLM_MOA_ADAPTIVE never reaches a test or the processes it starts.
os.environ.pop(ADAPTIVE_ENV, None)


def _set_mode(mp: pytest.MonkeyPatch, node: pytest.Item | pytest.Collector) -> None:
    """`fixed_k` (on the test, its class or module): VLLM_MOA_ADAPTIVE=0, K drafts every cycle;
    else the default, adaptive."""
    if node.get_closest_marker("fixed_k") is not None:
        mp.setenv(ADAPTIVE_ENV, "0")
    else:
        mp.delenv(ADAPTIVE_ENV, raising=False)


@pytest.fixture(autouse=True, scope="module")
def _module_speculation_mode(request: pytest.FixtureRequest):
    """The module's mode while its module-scoped fixtures (engines made once for several tests)
    are built: autouse fixtures come first in their scope. Restored after the module."""
    with pytest.MonkeyPatch.context() as mp:
        _set_mode(mp, request.node)
        yield


@pytest.fixture(autouse=True)
def _speculation_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Each test's mode (its own marker first), set and restored around it; subprocesses the test
    starts inherit it."""
    _set_mode(monkeypatch, request.node)


def make_hf_model(
    model_type: str = "llama",
    vocab_size: int = 256,
    num_layers: int = 3,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    max_positions: int = 256,
    seed: int = 0,
    logit_scale: float = 1.0,
    rope_parameters: dict | None = None,
):
    """A randomly initialised tiny causal LM of the given architecture (eval mode).
    `rope_parameters`: transformers' RoPE settings (base and scaling), e.g. Llama-3.1's llama3."""
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 7}),
    }
    config_cls, model_cls, extra = classes[model_type]
    if rope_parameters is not None:
        extra = {**extra, "rope_parameters": dict(rope_parameters)}
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model


def make_drafter(
    target: HFTarget, tli: int = 0, seed: int = 0, preset: str = "small", memory: str = "lsa"
) -> MoADrafter:
    info = TargetInfo(target.shape, target.config.num_attention_heads)
    drafter = MoADrafter(make_config(info, preset=preset, tli=tli, memory_source=memory))
    drafter.init_weights(seed)
    return drafter.eval()


class AlternatingCosts(StepCosts):
    """Adaptive speculation under test: costs that make drafting pay after every other engine
    step only (a draft step of 0.01 or 10 against a verify step of 1), so cycles alternate
    between drafting and not. `verify_sizes`: the verify steps observed at the start."""

    def __init__(self, verify_sizes: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        for n in verify_sizes:
            super().observe_verify(n, 1.0)
        super().observe_draft(1, 0.01)
        self.calls = 0

    def observe_verify(self, tokens: int, seconds: float) -> None:
        super().observe_verify(tokens, 1.0)
        self.calls += 1
        self.draft_step = 0.01 if self.calls % 2 else 10.0

    def observe_draft(
        self, steps: int, seconds: float, drafts: int | None = None, rows: int = 0
    ) -> None:
        pass


class OracleMoAProposer(MoAProposer):
    """The real MoA proposer whose logits get a large bonus on the target's greedy next token.

    Every path of the proposer still runs (SA/CA/TLI caches, cropping), but drafts are mostly
    right, so the engine's accept-some / accept-all branches are exercised. Every
    `corrupt_every`-th position keeps the drafter's own choice, forcing rejections.
    """

    def __init__(self, drafter, target, corrupt_every: int = 5, bonus: float = 50.0):
        super().__init__(drafter, target)
        self.corrupt_every = corrupt_every
        self.bonus = bonus
        self.raw_log: list[torch.Tensor] = []  # the drafter's own logits, before the bonus

    @torch.no_grad()
    def draft_logits(self, position: int) -> torch.Tensor:
        logits = super().draft_logits(position)
        self.raw_log.append(logits)
        if position % self.corrupt_every == 0:
            return logits
        ids = torch.tensor([self.tokens[: position + 1]])
        best = self.target.model(ids).logits[0, -1].argmax()
        logits = logits.clone()
        logits[best] += self.bonus
        return logits


@pytest.fixture(scope="session")
def llama_target() -> HFTarget:
    return HFTarget(make_hf_model("llama"))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> str:
    """A tokenizer + tiny Llama on disk (as `vllm-moa demo` builds), shared by CLI tests."""
    from vllm_moa.tiny import TinyTargetSpec, build_tiny_target

    out = tmp_path_factory.mktemp("tiny_target")
    spec = TinyTargetSpec(
        vocab_size=512,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        num_layers=3,
        intermediate_size=256,
        max_position_embeddings=128,
        corpus_bytes=300_000,
    )
    return str(build_tiny_target(out, spec))

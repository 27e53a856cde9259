"""MoA TLI inside vLLM runs the target's own last layers, so any architecture vLLM serves works:
- a sliding-window target (mistral, window 16): the drafted positions' attention in the tail
  layers keeps to each layer's window, as the target's own does, so vLLM's drafts equal the
  standalone engine's (whose target applies the window like Hugging Face) at every context,
  including contexts far past the window;
- a Qwen3 target, whose attention normalises q and k per head (refused with TLI before the tail
  ran through vLLM's own layers).
Random targets and drafters: drafts are compared, not accepted, so no training is needed."""

from __future__ import annotations

import shutil

import pytest

from tests.vllm_integration.conftest import check_drafts_equal_standalone

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

WINDOW = 16
PROMPTS = [
    "import sys\nimport re\n\nclass Parser(object):\n    def __init__(self, text, pos=0):\n",
    "def fibonacci(n):\n",
    "# Return the sum of a list\ndef total(values):\n    result = 0\n",
]


def random_pair(source, base, config, tli: int):
    """A random target of `config` with the test pair's tokenizer, and a random MoA drafter."""
    import torch
    import transformers as tf

    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.drafters.moa.model import MoADrafter
    from vllm_moa.drafters.presets import make_config
    from vllm_moa.hf_target import load_target_info

    target = base / "target"
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    drafter = MoADrafter(make_config(load_target_info(target), preset="small", tli=tli))
    drafter.init_weights(seed=5)
    return target, save_drafter(drafter, base / "drafter")


SHAPE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip


def test_tli_drafts_equal_standalone_past_the_window(moa_pair, tmp_path, monkeypatch):
    import transformers as tf

    vocab = tf.AutoConfig.from_pretrained(moa_pair["target"]).vocab_size
    config = tf.MistralConfig(vocab_size=vocab, sliding_window=WINDOW, **SHAPE)
    target, drafter = random_pair(moa_pair["target"], tmp_path / "pair", config, tli=2)
    check_drafts_equal_standalone(target, drafter, PROMPTS, tmp_path, monkeypatch, max_tokens=40)


def test_tli_drafts_equal_standalone_with_qk_norm(moa_pair, tmp_path, monkeypatch):
    import transformers as tf

    vocab = tf.AutoConfig.from_pretrained(moa_pair["target"]).vocab_size
    config = tf.Qwen3Config(vocab_size=vocab, **SHAPE)
    target, drafter = random_pair(moa_pair["target"], tmp_path / "pair", config, tli=1)
    check_drafts_equal_standalone(target, drafter, PROMPTS, tmp_path, monkeypatch)

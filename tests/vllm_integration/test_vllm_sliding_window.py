"""MoA TLI inside vLLM on a sliding-window target (mistral, window 16): the drafted positions'
attention in the target's tail layers keeps to each layer's window, as the target's own does,
so vLLM's drafts equal the standalone engine's (whose target applies the window like Hugging
Face) at every context, including contexts far past the window."""

from __future__ import annotations

import shutil

import pytest

from tests.vllm_integration.conftest import check_drafts_equal_standalone

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WINDOW = 16
PROMPTS = [
    "import sys\nimport re\n\nclass Parser(object):\n    def __init__(self, text, pos=0):\n",
    "def fibonacci(n):\n",
    "# Return the sum of a list\ndef total(values):\n    result = 0\n",
]


@pytest.fixture(scope="module")
def window_pair(moa_pair, tmp_path_factory):
    """A random 3-layer mistral target with the test pair's tokenizer, and a random MoA TLI=2
    drafter for it (drafts are compared, not accepted, so no training is needed)."""
    import torch
    import transformers as tf

    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.model import MoADrafter, make_config
    from vllm_moa.target import load_target_info

    base = tmp_path_factory.mktemp("window_pair")
    target = base / "target"
    source = moa_pair["target"]
    vocab = load_target_info(source).shape.vocab_size
    config = tf.MistralConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
        sliding_window=WINDOW, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.MistralForCausalLM(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    drafter = MoADrafter(make_config(load_target_info(target), preset="small", tli=2))
    drafter.init_weights(seed=5)
    return target, save_drafter(drafter, base / "drafter")


def test_tli_drafts_equal_standalone_past_the_window(window_pair, tmp_path, monkeypatch):
    target, drafter = window_pair
    check_drafts_equal_standalone(target, drafter, PROMPTS, tmp_path, monkeypatch, max_tokens=40)

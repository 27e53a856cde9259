"""The embedded default: a tiny Llama-architecture target with its own BPE tokenizer.

No model can be downloaded, so the demo and the tests build one locally: a byte-level BPE
tokenizer trained on the running interpreter's standard library sources (every machine has
them) and a randomly initialised Llama with head_dim 64 (a size vLLM's CPU attention accepts).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class TinyTargetSpec:
    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    corpus_bytes: int = 1_000_000  # of standard library source used to train the tokenizer
    seed: int = 0


def stdlib_sources(max_bytes: int) -> list[Path]:
    """The interpreter's own standard library .py files, sorted, up to about max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    top = sorted(root.glob("*.py"))
    deeper = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    for path in dict.fromkeys([*top, *deeper]):  # top-level modules first, then packages
        if total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    if not files:
        raise FileNotFoundError(f"no Python sources under {root} to train a tokenizer on")
    return files


def train_tokenizer(files: list[Path], vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_target(
    out_dir: str | Path, spec: TinyTargetSpec | None = None, corpus: list[Path] | None = None
) -> Path:
    """Write a tokenizer + randomly initialised Llama target into out_dir (an HF directory).

    The tokenizer is trained on `corpus` (default: stdlib sources up to spec.corpus_bytes)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    spec = spec or TinyTargetSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus or stdlib_sources(spec.corpus_bytes), spec.vocab_size)
    tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>")}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"]
    )
    model.save_pretrained(out)
    return out


def default_cache_dir() -> Path:
    return Path(os.environ.get("VLLM_MOA_CACHE", Path.home() / ".cache" / "vllm_moa"))

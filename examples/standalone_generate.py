"""Speculative generation with the standalone engine from Python.

    python examples/standalone_generate.py TARGET_DIR DRAFTER_DIR "def quicksort(xs):"

TARGET_DIR is any Hugging Face Llama/Qwen2/Qwen3/Mistral directory; DRAFTER_DIR a MoA drafter
made for it (`vllm-moa init-drafter`, a trained one, or `vllm-moa convert-official`).
"""

from __future__ import annotations

import sys

from transformers import AutoTokenizer

from vllm_moa.checkpoint import load_drafter
from vllm_moa.decoding import SamplingParams, SpeculativeEngine
from vllm_moa.drafters.moa.proposer import MoAProposer
from vllm_moa.hf_target import HFTarget


def main(target_dir: str, drafter_dir: str, prompt: str) -> None:
    target = HFTarget.from_pretrained(target_dir)
    drafter = load_drafter(drafter_dir, target=target.shape)  # refuses a drafter of another target
    engine = SpeculativeEngine(target, MoAProposer(drafter, target))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    result = engine.generate(
        tokenizer(prompt)["input_ids"],
        max_new_tokens=64,
        params=SamplingParams(temperature=0.0),  # greedy; temperature > 0 samples losslessly
        num_speculative_tokens=4,
        eos_token_ids=[tokenizer.eos_token_id],
    )
    print(tokenizer.decode(result.token_ids, skip_special_tokens=True))
    print(result.stats.to_dict())


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])

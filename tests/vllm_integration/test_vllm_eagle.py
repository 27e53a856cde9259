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


def _vllm_rotated(export_dir, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q [T, H*D] rotated at `positions` by the rotary vLLM builds for the exported EAGLE-3
    layer: the draft config as vLLM's SpeculativeConfig loads it (`get_config`, wrapped in
    `EAGLEConfig`) and llama.py's `get_rope(..., rope_parameters=config.rope_parameters)`."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    loaded = get_config(str(export_dir), trust_remote_code=False)
    config = EAGLEConfig(loaded, method="eagle3", model_type="eagle")
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops read it when built
        rope = get_rope(
            config.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=getattr(config, "rope_parameters", None),
            dtype=torch.float32,
        )
    return rope.forward_native(positions, q.clone(), None)[0]


def test_vllm_rotates_an_exported_scaled_eagle3_as_ours(tmp_path):
    """A rope-scaled target (llama3, tests/test_rope_scaling_token_layers.py): vLLM's rotary
    for the exported EAGLE-3 layer equals our layer's over 8x the original length (what vLLM's
    `eagle3` applies, read through its own config loading; no engine started). Control: the
    previous export's config (rope_parameters of the default type) rotates otherwise."""
    import json

    from tests.test_rope_scaling_token_layers import ORIGINAL, _attentions, _scaled_hf, make_drafter
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle
    from vllm_moa.hf_target.adapter import HFTarget
    from vllm_moa.model.rope import apply_rope

    model = _scaled_hf()
    model.save_pretrained(tmp_path / "target")
    drafter = make_drafter("eagle3", HFTarget(model))
    save_drafter(drafter, tmp_path / "drafter")
    exported = export_vllm_eagle(tmp_path / "drafter", tmp_path / "target", tmp_path / "vllm")
    attn = _attentions(drafter)[0]
    positions = torch.arange(8 * ORIGINAL)
    q = torch.randn(len(positions), attn.num_heads * attn.head_dim)  # [T, H*D]
    cos, sin = attn.cos_sin(positions, torch.float32)
    heads = q.unflatten(-1, (attn.num_heads, attn.head_dim)).transpose(0, 1)[None]  # [1, H, T, D]
    ours = apply_rope(heads, cos, sin)[0].transpose(0, 1).flatten(-2)
    # fp32 on both sides; vLLM keeps its cos/sin in a cache of its own computation.
    torch.testing.assert_close(_vllm_rotated(exported, positions, q), ours, atol=1e-5, rtol=0)

    config = json.loads((exported / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    (exported / "config.json").write_text(json.dumps(config))
    assert (_vllm_rotated(exported, positions, q) - ours)[ORIGINAL:].abs().max() > 0.1


def _served_per_position(target_dir, exported, prompts, max_tokens, k):
    """vLLM's own `eagle3` serving `exported`: greedy outputs and accepted tokens per position."""
    from vllm import SamplingParams

    llm = make_llm(
        target_dir, exported, k=k, method="eagle3", max_model_len=256, skip_tokenizer_init=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    per_position = spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens_per_pos"]
    return [list(o.outputs[0].token_ids) for o in outs], list(per_position)


def test_exported_scaled_eagle3_in_vllm_equals_standalone(tmp_path):
    """A random EAGLE-3 drafter on a llama3-scaled random target (12 tokens, so drafts land),
    prompts of 20 tokens past the original 16: vLLM's `eagle3` on the export gives the
    standalone engine's outputs and accepted tokens per draft position. Control: the same
    export with the previous, unscaled rope_parameters gives other per-position counts (the
    drafts reach where the scaling matters)."""
    import json

    from tests.test_rope_scaling_token_layers import VOCAB, _scaled_hf, make_drafter
    from vllm_moa.checkpoint import save_drafter
    from vllm_moa.checkpoint.vllm_eagle import export_vllm_eagle
    from vllm_moa.decoding import SpeculativeEngine
    from vllm_moa.factories.proposers import make_proposer
    from vllm_moa.hf_target.adapter import HFTarget

    k, max_tokens = 4, 32
    model = _scaled_hf()
    model.save_pretrained(tmp_path / "target")
    target = HFTarget(model)
    drafter = make_drafter("eagle3", target, seed=1)
    save_drafter(drafter, tmp_path / "drafter")
    exported = export_vllm_eagle(tmp_path / "drafter", tmp_path / "target", tmp_path / "vllm")
    prompts = [[(s + 7 * i) % VOCAB for i in range(20)] for s in range(4)]
    outputs, per_position = _served_per_position(
        tmp_path / "target", exported, prompts, max_tokens, k
    )

    engine = SpeculativeEngine(target, make_proposer(drafter, target))
    expected = [0] * k
    for ids, out in zip(prompts, outputs, strict=True):
        result = engine.generate(ids, max_tokens, num_speculative_tokens=k)
        assert out == result.token_ids
        expected = [
            a + b for a, b in zip(expected, result.stats.accepted_per_position, strict=True)
        ]
    assert sum(expected[1:]) > 0, "no draft past the first landed: nothing is compared"
    assert per_position == expected

    config = json.loads((exported / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    (exported / "config.json").write_text(json.dumps(config))
    _, unscaled = _served_per_position(tmp_path / "target", exported, prompts, max_tokens, k)
    assert unscaled != expected

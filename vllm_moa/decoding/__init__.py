"""Standalone speculative decoding: sampling, verification, the proposer protocol (each drafter
kind's proposer: vllm_moa/drafters/KIND/proposer.py), the n-gram proposer and the engine."""

from vllm_moa.decoding.engine import GenerationResult, SpeculativeEngine
from vllm_moa.decoding.factory import make_proposer
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
    "make_proposer",
    "verify_greedy",
    "verify_rejection",
]

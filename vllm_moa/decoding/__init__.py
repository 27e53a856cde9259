"""Standalone speculative decoding: sampling, verification, proposers and the engine."""

from vllm_moa.decoding.engine import GenerationResult, SpeculativeEngine
from vllm_moa.decoding.moa_proposer import MoAProposer
from vllm_moa.decoding.proposer import DraftProposal, Proposer
from vllm_moa.decoding.sampling import SamplingParams, Verdict, verify_greedy, verify_rejection
from vllm_moa.decoding.stats import GenerationStats

__all__ = [
    "DraftProposal",
    "GenerationResult",
    "GenerationStats",
    "MoAProposer",
    "Proposer",
    "SamplingParams",
    "SpeculativeEngine",
    "Verdict",
    "verify_greedy",
    "verify_rejection",
]

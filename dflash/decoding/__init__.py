"""Decoding: proposers (draft), verification (accept), and the speculative loop."""

from dflash.decoding.engine import (
    GenerationConfig,
    GenerationError,
    GenerationOutput,
    GenerationStats,
    SpeculativeEngine,
)
from dflash.decoding.logprobs import TokenLogprob
from dflash.decoding.proposer import DFlashProposer, NoDraftProposer, Proposer
from dflash.decoding.sampling import SamplingParams
from dflash.decoding.verify import greedy_verify, rejection_sample

__all__ = [
    "DFlashProposer", "GenerationConfig", "GenerationError", "GenerationOutput", "GenerationStats",
    "NoDraftProposer", "Proposer", "SamplingParams", "SpeculativeEngine", "TokenLogprob", "greedy_verify",
    "rejection_sample",
]

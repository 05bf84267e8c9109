"""Losslessness on a CUDA GPU: the same checks as the CPU suite's, with the models on the GPU. Skipped where torch
sees no GPU (CI has none); benchmarks/gpu_check.sh runs them on a lent one."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, check_ragged_greedy, random_prompts, tiny_target_model
from dflash.api import DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.model.target import TargetModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 48


@pytest.mark.parametrize("family", [*FAMILIES, "gemma2"])
def test_ragged_batch_on_cuda_is_lossless(family):
    """A ragged batch, block sizes 2, 8 and 16, a drafter right for a random number of tokens per block: the
    output is transformers' greedy output on the same GPU."""
    check_ragged_greedy(TargetModel(tiny_target_model(family).to("cuda")), random_prompts(4, seed=2), MAX_NEW)


@pytest.mark.parametrize("block_size", [8, 16])
def test_embedded_pair_on_cuda_decodes_what_the_target_alone_decodes(block_size):
    """The embedded pair on the GPU, float32, 8 GSM8K test questions in one ragged batch: DFlash's text is the
    target's own greedy text, and the drafter's tokens are accepted (it is the trained drafter, not noise)."""
    pipe = DFlash.from_pretrained(device="cuda", dtype="float32")
    plain = DFlash(pipe.target)  # the same target, decoding alone
    questions = [sample.turns[0] for sample in load_samples("gsm8k", DataOptions(max_samples=8, use_hub=False))]
    drafted = pipe.generate_batch(questions, max_new_tokens=128, block_size=block_size)
    alone = plain.generate_batch(questions, max_new_tokens=128)
    assert [o.output_ids for o in drafted] == [o.output_ids for o in alone]
    assert sum(o.stats.mean_acceptance_length for o in drafted) / len(drafted) > 3.0

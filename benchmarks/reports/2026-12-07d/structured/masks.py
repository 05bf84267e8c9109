"""What a grammar's masks cost a verify step: `Grammar.slot_masks` for a block of 16 (the anchor and 15 draft tokens)
inside the compact JSON schema of `benchmarks/structured.py`, on the embedded tokenizer (4,096 tokens), 200 calls.

python benchmarks/reports/2026-12-07d/structured/masks.py
"""

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from structured import SCHEMA  # noqa: E402

from dflash.api import ASSETS  # noqa: E402
from dflash.decoding.structure import GrammarCompiler  # noqa: E402

torch.set_num_threads(2)
tokenizer = AutoTokenizer.from_pretrained(ASSETS / "target")
grammar = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).grammar(SCHEMA, None)
answer = '{"steps":"He makes 200*2=$400 per week, so in a month he makes 4*400=$1600'
ids = tokenizer.encode(answer, add_special_tokens=False)
assert grammar.advance(ids[:3]) is None  # inside the string
block = ids[2:18]  # the anchor and 15 draft tokens the grammar allows
calls = 200
for _ in range(10):
    grammar.slot_masks(block)
start = time.perf_counter()
for _ in range(calls):
    grammar.slot_masks(block)
per_step_ms = (time.perf_counter() - start) / calls * 1e3
result = {"slots": len(block), "vocab": len(tokenizer), "calls": calls, "ms_per_step": round(per_step_ms, 3)}
print(json.dumps(result))
(Path(__file__).parent / "masks.json").write_text(json.dumps(result, indent=1) + "\n")

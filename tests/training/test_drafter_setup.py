"""Choosing the drafter's mask token (training/drafter_setup.py)."""

from types import SimpleNamespace

import pytest

from dflash.training.drafter_setup import choose_mask_token_id


class Tokenizer:
    def __init__(self, vocab: dict[str, int], mask_token_id: int | None = None):
        self.vocab, self.mask_token_id = vocab, mask_token_id

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


WORDS = {"a": 0, "b": 1, "<eos>": 2}


@pytest.mark.parametrize("vocab, mask_token_id, given, expected", [
    (WORDS, None, 7, 7),                                  # --mask-token-id wins
    ({**WORDS, "<|MASK|>": 3, "<mask>": 4}, 4, None, 3),  # SGLang's <|MASK|> before the tokenizer's own mask token
    ({**WORDS, "<mask>": 3}, 3, None, 3),
    ({**WORDS, "<|mask|>": 3}, None, None, 3),
    (WORDS, None, None, 3),                               # the first embedding row no token uses
])
def test_the_mask_token_is_one_no_text_uses_and_sglangs_own_when_the_tokenizer_has_it(vocab, mask_token_id, given,
                                                                                       expected):
    config = SimpleNamespace(mask_token_id=given)
    assert choose_mask_token_id(config, Tokenizer(vocab, mask_token_id), vocab_size=8) == expected


def test_without_a_free_row_there_is_no_mask_token_to_choose():
    assert choose_mask_token_id(SimpleNamespace(mask_token_id=None), Tokenizer(WORDS), vocab_size=3) is None

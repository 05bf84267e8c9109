"""Where a step of several new tokens stops: where decoding them one at a time would."""

from __future__ import annotations

import pytest

from dflash.decoding.stopping import StopChecker


class CharTokenizer:
    """Token id i decodes to the i-th letter: ids are easy to turn into text."""

    def decode(self, ids, skip_special_tokens=True, **options):
        return "".join(chr(ord("a") + i) for i in ids)


def in_steps(checker: StopChecker, tokens: list[int], step: int) -> tuple[list[int], str | None]:
    """The tokens kept, and why the output ended (None: it did not), offered `step` at a time."""
    kept: list[int] = []
    for i in range(0, len(tokens), step):
        decision = checker.check(kept, tokens[i:i + step])
        kept += tokens[i:i + step][: decision.keep]
        if decision.reason:
            return kept, decision.reason
    return kept, None


def one_at_a_time(checker: StopChecker, tokens: list[int]) -> tuple[list[int], str | None]:
    kept: list[int] = []
    for token in tokens:
        decision = checker.check(kept, [token])
        kept += [token][: decision.keep]
        if decision.reason:
            return kept, decision.reason
    return kept, None


@pytest.mark.parametrize("stop_ids, stop_strings, max_new", [
    ([5], ["cd"], 20),  # the stop string ("cd": tokens 2, 3) ends before the stop token (5)
    ([], ["cd"], 5),  # the stop string ends before max_new_tokens cuts the step
    ([3], ["de"], 20),  # the stop token comes first
    ([], ["bc", "xy", "c"], 20),  # several stop strings: the first one completed
    ([], [], 4),
])
def test_a_step_stops_where_decoding_one_token_at_a_time_would(stop_ids, stop_strings, max_new):
    tokens = [0, 1, 2, 3, 4, 5, 6, 7]
    checker = StopChecker(stop_ids, stop_strings, max_new, CharTokenizer())
    kept, reason = one_at_a_time(checker, tokens)
    decision = checker.check(kept[:1], tokens[1:])
    assert (kept[:1] + tokens[1:][: decision.keep], decision.reason) == (kept, reason)


@pytest.mark.parametrize("step", [2, 3, 16])
def test_a_stop_string_holding_the_replacement_character_stops_alike_at_every_step_size(step):
    """A character cut between two tokens decodes to U+FFFD one token at a time, and whole in a step that holds
    both: with a stop string holding U+FFFD, steps of 2 tokens stopped later than steps of 1, and of 16 never."""
    from transformers import AutoTokenizer

    from dflash.api import DEFAULT_TARGET

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    ids = tokenizer.encode("Hi é and 你好 ok", add_special_tokens=False)
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # byte tokens: characters cut between tokens

    def decode(step_size: int) -> tuple[list[int], str | None]:
        return in_steps(StopChecker([], ["\ufffd"], 100, tokenizer), ids, step_size)

    assert decode(step) == decode(1) and decode(1)[1] == "stop"

"""Where a step of several new tokens stops: where decoding them one at a time would."""

from __future__ import annotations

import pytest

from dflash.decoding.stopping import StopChecker


class CharTokenizer:
    """Token id i decodes to the i-th letter: ids are easy to turn into text."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


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

"""Stop strings and stream deltas read only the end of a long output, and agree with decoding all of it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from conftest import TOKENIZERS, byte_fallback_tokenizer, embedded_tokenizer, make_tokenizer
from dflash.decoding.detokenizer import TextDeltas, byte_tokens, decode, tail_text
from dflash.decoding.stopping import StopChecker

ASSETS = Path(__file__).resolve().parents[2] / "dflash" / "assets" / "target"

TEXT = ("Natalia sold 48 clips in April, héllo wörld, 中文字 🙂 and then half as many in May. "
        "Weng earns $12 an hour; ça fait 0.2 × 50 = 10. ")


@pytest.fixture(params=list(TOKENIZERS), scope="module")
def tokenizer(request):
    return TOKENIZERS[request.param]()


def output_ids(tokenizer, repeats: int = 3) -> list[int]:
    """A long output with special tokens between its sentences (decoding skips them)."""
    ids: list[int] = []
    for _ in range(repeats):
        ids += tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids


def whole(tokenizer, ids) -> str:
    return decode(tokenizer, ids)


def test_the_tail_ends_as_the_whole_text_does(tokenizer):
    ids = output_ids(tokenizer)
    for end in range(1, len(ids) + 1):
        text = whole(tokenizer, ids[:end])
        for min_chars in (1, 4):
            tail, is_whole = tail_text(tokenizer, ids, end, min_chars)
            assert tail[-min_chars:] == text[-min_chars:], (end, tail, text)
            assert is_whole == (tail == text) or not is_whole


def first_stop(tokenizer, ids, stops) -> int | None:
    """How many tokens decoding one at a time keeps when it stops at a stop string: the first prefix holding one."""
    for end in range(1, len(ids) + 1):
        if any(s in whole(tokenizer, ids[:end]) for s in stops):
            return end
    return None


@pytest.mark.parametrize("seed", range(4))
def test_a_stop_string_stops_where_the_whole_text_first_holds_it(tokenizer, seed):
    rng = random.Random(seed)
    ids = output_ids(tokenizer)
    text = whole(tokenizer, ids)
    start = rng.randrange(len(text) // 3, len(text) - 4)  # late in the output, so the tail is short of it
    stops = [text[start: start + rng.randint(1, 4)], "not in the text"]
    expected = first_stop(tokenizer, ids, stops)
    checker = StopChecker([], stops, max_new_tokens=10_000, tokenizer=tokenizer)
    kept: list[int] = []
    while len(kept) < len(ids):
        step = ids[len(kept): len(kept) + rng.randint(1, 6)]  # steps of several tokens, as drafted steps give
        decision = checker.check(kept, step)
        kept += step[: decision.keep]
        if decision.reason:
            break
    assert (len(kept), decision.reason) == (expected, "stop"), stops
    assert checker.ending(kept)[0] == text[: text.find(stops[0])]


@pytest.mark.parametrize("seed", range(3))
def test_stream_deltas_never_take_text_back_and_add_up_to_the_whole_text(tokenizer, seed):
    rng = random.Random(seed)
    ids = output_ids(tokenizer)
    final = whole(tokenizer, ids)
    deltas = TextDeltas(tokenizer, stop_strings=["zzz"])  # never in the text, nor is a "z" that could start it
    done = 0
    while done < len(ids):
        step = ids[done: done + rng.randint(1, 6)]
        deltas.add(step)
        done += len(step)
        # what was sent stays; only half a character at the end (replacement characters) waits
        assert final.startswith(deltas.sent), (deltas.sent, final)
        assert len(deltas.sent) >= len(whole(tokenizer, ids[:done]).rstrip("\ufffd"))
    assert deltas.sent + deltas.finish(final) == final


class CountingTokenizer:
    """Counts the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True, **options):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **options)

    def get_vocab(self):
        return self.tokenizer.get_vocab()


def test_a_long_output_is_not_decoded_again_for_every_token():
    """Checking 1,500 tokens one at a time used to decode ~1.1M token ids (the whole output each time)."""
    counting = CountingTokenizer(embedded_tokenizer())
    ids = output_ids(counting.tokenizer, repeats=30)[:1500]
    checker = StopChecker([], ["never said"], max_new_tokens=10_000, tokenizer=counting)
    deltas = TextDeltas(counting, stop_strings=["never said"])
    for end in range(len(ids)):
        assert checker.check(ids[:end], [ids[end]]).reason is None
        deltas.add([ids[end]])
    assert counting.decoded < 120 * len(ids)  # a few windows of tens of tokens each, whatever the length
    assert deltas.sent + deltas.finish(whole(counting.tokenizer, ids)) == whole(counting.tokenizer, ids)


def test_long_stop_strings_hold_back_only_what_could_begin_one():
    """16 stop strings of 1,000 characters (the server's limit): held-back text is found from the text's last
    character, not by trying every prefix length of every stop string."""
    tokenizer = embedded_tokenizer()
    ids = output_ids(tokenizer, repeats=10)
    stops = [("x" * 999) + str(i) for i in range(10)] + ["9" * 1000, "a" * 1000, ". " * 500, "e" * 1000,
                                                          "5" * 1000, "0" * 1000]
    deltas = TextDeltas(tokenizer, stops)
    for token in ids:
        deltas.add([token])
    final = whole(tokenizer, ids)
    assert deltas.sent + deltas.finish(final) == final
    held = TextDeltas(tokenizer, ["May. Weng", "ab"])
    sent = held.add(tokenizer("in May. We", add_special_tokens=False)["input_ids"])
    assert sent == "in " and held.add(tokenizer("ng", add_special_tokens=False)["input_ids"]) == ""


def stop_at_steps_of(tokenizer, ids, stops, step_size: int) -> tuple[int, str | None]:
    checker, kept = StopChecker([], stops, 10_000, tokenizer), []
    for start in range(0, len(ids), step_size):
        decision = checker.check(kept, ids[start:start + step_size])
        kept += ids[start:start + step_size][:decision.keep]
        if decision.reason:
            return len(kept), decision.reason
    return len(kept), None


@pytest.mark.parametrize("text, stop", [
    ("ok " + "中文字" * 20 + "東京日本語 end", "京日"),
    ("ok! " + "中文字" * 20 + "東京日本語 end", "京日"),
    ("ok " + "中文字" * 20 + "東京日本語 end", "京日本語"),  # a window of another length: it starts mid-character
    ("Emoji: " + "😀🙂👍" * 10 + "🎉 end", "🎉"),
])
def test_a_stop_string_after_a_long_run_of_byte_tokens_stops_alike_at_every_step_size(text, stop):
    """A byte-fallback decoder turns a run of byte tokens into text as a whole: a window that started inside the
    run decoded it as U+FFFD, so plain decoding (steps of 1) never stopped and drafted steps stopped late or never."""
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = first_stop(tokenizer, ids, [stop])
    assert expected is not None and expected < len(ids)
    for step_size in (1, 4, 8):
        assert stop_at_steps_of(tokenizer, ids, [stop], step_size) == (expected, "stop"), step_size
    deltas = TextDeltas(tokenizer, stop_strings=["zzz"])
    for start in range(0, len(ids), 3):
        deltas.add(ids[start:start + 3])
    assert deltas.sent == whole(tokenizer, ids)


def test_text_already_streamed_or_checked_for_a_stop_never_changes_with_space_clean_up():
    """transformers 4's decode cleans up spaces (" !" -> "!") for tokenizers that ask for it (Llama 3's do): a
    stream was cut short after "Bonjour " and a stop string "va " was found at steps of 1 and not of 8."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ASSETS, clean_up_tokenization_spaces=True,
                                              clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    ids = tokenizer("Bonjour ! Ça va ? Oui , merci .", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) != decode(tokenizer, ids)  # the tokenizer does clean up, left to itself
    deltas = TextDeltas(tokenizer, stop_strings=[])
    for token in ids:
        deltas.add([token])
    assert deltas.sent == decode(tokenizer, ids) == "Bonjour ! Ça va ? Oui , merci ."
    assert stop_at_steps_of(tokenizer, ids, ["va "], 1) == stop_at_steps_of(tokenizer, ids, ["va "], 8)
    assert stop_at_steps_of(tokenizer, ids, ["va "], 1)[1] == "stop"


@pytest.mark.parametrize("step_size", [1, 4])
def test_an_output_cut_inside_a_character_keeps_the_characters_a_stream_sent(step_size):
    """max_new_tokens cut 文 after two of its three byte tokens: the byte-fallback decoder wrote the whole run, 中
    included, as U+FFFD, so the final text ('ok �����') no longer began with the streamed 'ok 中', and the stream
    stopped there."""
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer("ok 中文 done", add_special_tokens=False)["input_ids"][:9]
    assert tokenizer.decode(ids) == "ok " + "\ufffd" * 5  # the decoder, left to itself
    final, _ = StopChecker([], [], 100, tokenizer).ending(ids)
    assert final == "ok 中\ufffd"
    deltas = TextDeltas(tokenizer, stop_strings=[])
    for start in range(0, len(ids), step_size):
        deltas.add(ids[start:start + step_size])
    assert deltas.sent + deltas.finish(final) == final


def test_a_long_run_of_byte_tokens_is_not_decoded_again_for_every_token():
    """A window reaches back to the start of the character it falls in, not of the whole run of byte tokens, and a
    stream decodes up to its last whole character: 4,000 tokens of emoji (one run) took 9 s to check for a stop
    string one token at a time, decoding the run each time. The work grows with the output's length, not its
    square."""
    def decoded(n: int) -> tuple[int, int]:
        counting = CountingTokenizer(byte_fallback_tokenizer())
        ids = counting.tokenizer("😀🙂👍" * 400, add_special_tokens=False)["input_ids"][:n]
        checker = StopChecker([], ["zzz"], max_new_tokens=10_000, tokenizer=counting)
        for end in range(len(ids)):
            assert checker.check(ids[:end], [ids[end]]).reason is None
        checked, counting.decoded = counting.decoded, 0
        deltas = TextDeltas(counting, stop_strings=["zzz"])
        for end in range(len(ids)):
            deltas.add([ids[end]])
        assert deltas.sent == whole(counting.tokenizer, ids)  # each emoji sent once its last byte came
        return checked, counting.decoded

    short, long = decoded(801), decoded(1601)  # a space, then 200 and 400 emoji of 4 byte tokens
    assert long[0] < 2.5 * short[0] and long[1] < 2.5 * short[1], (short, long)


def test_a_tokenizer_that_cannot_list_its_vocabulary_still_decodes():
    class Unlisted(CountingTokenizer):
        def get_vocab(self):
            raise NotImplementedError

    tokenizer = Unlisted(make_tokenizer())
    ids = tokenizer.tokenizer("Natalia sold clips", add_special_tokens=False)["input_ids"]
    assert StopChecker([], ["clips"], 100, tokenizer).check(ids[:1], ids[1:]).reason == "stop"


def test_an_answer_cut_inside_its_only_character_ends_in_one_replacement_character():
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer("ok 文", add_special_tokens=False)["input_ids"][:-1]
    assert StopChecker([], [], 100, tokenizer).ending(ids)[0] == "ok \ufffd"


def byte_ids(tokenizer, data: bytes) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]


@pytest.mark.parametrize("step_size", [1, 3, 8])
def test_a_bad_byte_mid_output_leaves_the_text_before_it_and_the_stream_whole(step_size):
    """A model can sample bytes that are no UTF-8: a lead byte with no continuation, between two emoji of one run
    of byte tokens. The byte-fallback decoder wrote that whole run as U+FFFD, the emoji already streamed included,
    so the final text no longer began with the stream and the stream sent nothing more; and a stop string after it
    was found at one step size and not another. Now the bad byte alone is U+FFFD, as a byte-level tokenizer has it."""
    tokenizer = byte_fallback_tokenizer()
    ids = (tokenizer("ok", add_special_tokens=False)["input_ids"] + byte_ids(tokenizer, "😀".encode())
           + byte_ids(tokenizer, b"\xe4") + byte_ids(tokenizer, "🙂 end".encode()))
    assert tokenizer.decode(ids) == "ok" + "\ufffd" * 13  # the decoder, left to itself
    final, _ = StopChecker([], [], 100, tokenizer).ending(ids)
    assert final == "ok😀\ufffd🙂 end"
    deltas = TextDeltas(tokenizer, stop_strings=["zzz"])
    for start in range(0, len(ids), step_size):
        deltas.add(ids[start:start + step_size])
    assert deltas.sent == final
    assert stop_at_steps_of(tokenizer, ids, ["🙂"], step_size) == (len(ids) - 4, "stop")


def test_a_special_token_inside_a_character_is_skipped_before_its_bytes_are_read():
    """The decoder skips special tokens, then joins the bytes around them: 中 split by </s> is still 中."""
    tokenizer = byte_fallback_tokenizer()
    ids = (tokenizer("ok", add_special_tokens=False)["input_ids"] + byte_ids(tokenizer, b"\xe4")
           + [tokenizer.eos_token_id] + byte_ids(tokenizer, b"\xb8\xad"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == decode(tokenizer, ids) == "ok中"


@pytest.mark.parametrize("seed", range(6))
def test_random_bytes_stream_and_stop_alike_at_every_step_size(tokenizer, seed):
    """Any bytes a model may sample: stretches of text and runs of random byte tokens (any byte, so mostly no
    UTF-8). The stream never takes text back and adds up to the final text, and a stop string is found at the same
    token at every step size, as in decoding token by token."""
    rng = random.Random(seed)
    byte_vocab = sorted(byte_tokens(tokenizer))
    if not byte_vocab:  # a byte-level tokenizer: its tokens are byte strings, any sequence of them can come
        byte_vocab = rng.sample(range(len(tokenizer)), min(400, len(tokenizer)))
    ids: list[int] = []
    for _ in range(12):
        ids += tokenizer(rng.choice(TEXT.split(". ")) + " ", add_special_tokens=False)["input_ids"]
        ids += [rng.choice(byte_vocab) for _ in range(rng.randint(1, 9))]
    ids += tokenizer(" the end", add_special_tokens=False)["input_ids"]
    final = StopChecker([], [], 10_000, tokenizer).ending(ids)[0]
    for step_size in (1, 4, 9):
        deltas = TextDeltas(tokenizer, stop_strings=["zzz"])
        for start in range(0, len(ids), step_size):
            deltas.add(ids[start:start + step_size])
            assert final.startswith(deltas.sent), (step_size, deltas.sent, final)
        assert deltas.sent + deltas.finish(final) == final
        assert final.endswith("the end") and deltas.sent.endswith("the end")
    expected = first_stop(tokenizer, ids, ["he en"])
    assert expected is not None
    for step_size in (1, 4, 9):
        assert stop_at_steps_of(tokenizer, ids, ["he en"], step_size) == (expected, "stop"), step_size

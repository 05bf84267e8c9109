"""Reading training records: every mistake is an error naming the file and line, never a traceback."""

from __future__ import annotations

import copy
import json
import re

import pytest

from dflash.errors import UserError
from dflash.training.data import epoch_batches, fingerprint, read_examples, split_examples, split_records


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import make_tokenizer

    return make_tokenizer()


GOOD = {"id": 0, "messages": [], "prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11]}


@pytest.mark.parametrize("record, message", [
    (5, "is 5, not a JSON object"),
    ({"messages": "hi", "response": "x"}, "`messages` must be a non-empty list"),
    ({"prompt": 5, "response": "x"}, "`prompt` must be a non-empty string, got 5"),
    ({"prompt": "q", "response": ["x"]}, "`response` must be a non-empty string"),
    ({"turns": "q", "response": "x"}, "`turns` must be a list of strings"),
    ({"turns": ["q", "and then?"], "response": "x"}, "this record has 2 `turns` and one `response`"),
    ({"prompt": "q"}, "needs `messages` or ShareGPT `conversations` (with the assistant's answers), or a `response`; "
                      "this one holds a prompt without its answer: have the target answer the prompts with `dflash "
                      "datagen` first"),
    ({"text": "q"}, "needs `messages` or ShareGPT `conversations` (with the assistant's answers), or a `response`"),
    ({"messages": [{"role": "user", "content": "q"}]}, "the conversation has no assistant message after a prompt"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},
     "message 1 of the conversation is an empty answer"),
    ({"prompt_ids": [5, 6], "response_ids": "abc"}, "`response_ids` must be a list of token ids"),
    ({"prompt_ids": [5, True], "response_ids": [7, 8]}, "`prompt_ids` must be a list of token ids"),
    ({"prompt_ids": [5, 6], "response_ids": [7, 5000]},
     "`response_ids` holds ids outside the target's vocabulary of 128 (e.g. 5000): this data was made with another "
     "target"),
    ('{"prompt": ' + "[" * 100000, "is nested too deeply to read"),
])
def test_bad_training_records_are_named_with_their_line(tmp_path, tokenizer, record, message):
    path = tmp_path / "data.jsonl"
    line = record if isinstance(record, str) else json.dumps(record)
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    with pytest.raises(UserError, match=re.escape("data.jsonl:3") + ".*" + re.escape(message)):
        read_examples(path, tokenizer, max_length=64, vocab_size=128)


def test_text_records_of_a_base_model_train_on_the_plain_conversation(tmp_path, tokenizer):
    """A tokenizer without a chat template (a base model): each answer after the plain text its prompt is sent as
    (`plain_conversation`, as generate, datagen and bench send it), then a blank line; every turn trains."""
    from dflash.chat import plain_conversation

    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    messages = [{"role": "user", "content": "How many clips?"}, {"role": "assistant", "content": "The answer is 72."},
                {"role": "user", "content": "And in May?"}, {"role": "assistant", "content": "24 clips."}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    [example] = read_examples(path, base, max_length=64).examples  # the second prompt continues the first turn
    assert example.input_ids == base(plain_conversation(messages))["input_ids"]
    assert len(example.responses) == 2
    for (start, end), answered in zip(example.responses, (1, 3)):
        assert example.input_ids[:start] == base(plain_conversation(messages[:answered]))["input_ids"]
        assert example.input_ids[:end] == base(plain_conversation(messages[: answered + 1]))["input_ids"]
        assert base.decode(example.input_ids[start:end]).endswith(messages[answered]["content"])


def test_a_base_model_tokenizer_that_merges_across_the_prompts_end_is_refused(tmp_path):
    """Where the full text's tokens do not start with the prompt's, the answer has no tokens of its own after the
    prompt as generate sends it: an error that points to datagen, not a sequence the target never sees."""

    class Merging:  # one id per character, but "?" and the line break after it become one token
        chat_template = None

        def __call__(self, text, add_special_tokens=True, verbose=False):
            ids, i = [], 0
            while i < len(text):
                pair = text[i:i + 2] == "?\n"
                ids.append(1000 if pair else ord(text[i]))
                i += 2 if pair else 1
            return {"input_ids": ids}

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "How many clips?", "response": "The answer is 72."}) + "\n")
    with pytest.raises(UserError, match="data.jsonl:1: the tokenizer joins the end of the prompt and the start of "
                                        "the answer"):
        read_examples(path, Merging(), max_length=64)


def test_a_chat_template_that_refuses_a_record_is_quoted_with_the_line(tmp_path, tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start "
                            "with a user message') }}{% endif %}" + tokenizer.chat_template)
    path = tmp_path / "data.jsonl"
    good = {"prompt": "How many clips?", "response": "72"}
    bad = {"messages": [{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "72"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(UserError, match=re.escape("data.jsonl:2: the model's chat template refused these messages: "
                                                  "Conversations must start with a user message")):
        read_examples(path, strict, max_length=64)


def test_a_file_that_is_not_utf8_is_named(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(UserError, match="data.jsonl:2 is not UTF-8"):
        read_examples(path, tokenizer, max_length=64)


def test_the_fingerprint_follows_the_tokens_and_their_order(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    other = dict(GOOD, response_ids=[8, 9, 10, 12])
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(other) + "\n")
    examples = read_examples(path, tokenizer, max_length=64).examples
    assert fingerprint(examples) == fingerprint(read_examples(path, tokenizer, max_length=64).examples)
    assert fingerprint(examples) != fingerprint(examples[::-1])
    assert fingerprint(examples) != fingerprint(read_examples(path, tokenizer, max_length=6).examples)


def test_every_answer_of_a_datagen_conversation_is_an_example_after_its_own_prompt(tmp_path, tokenizer):
    """A later turn's prompt renders the earlier answers from their text, which need not be the ids the target
    produced (here it is not): each turn trains on its own stored prompt and answer."""
    two_turns = {"prompt_ids": [5, 6, 7, 20, 21, 9], "response_ids": [30, 31, 32],
                 "earlier_turns": [{"prompt_prefix_length": 2, "prompt_tail_ids": [7], "response_ids": [20, 22, 23]}]}
    path = tmp_path / "data.jsonl"
    short = {"prompt_ids": [5], "response_ids": [6, 7, 8]}
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(two_turns) + "\n" + json.dumps(short) + "\n")
    loaded = read_examples(path, tokenizer, max_length=64, vocab_size=128)
    assert [(e.input_ids, e.response_start, e.record) for e in loaded.examples] == [
        ([5, 6, 7, 8, 9, 10, 11], 3, 1), ([5, 6, 7, 20, 22, 23], 3, 2), ([5, 6, 7, 20, 21, 9, 30, 31, 32], 6, 2),
        ([5, 6, 7, 8], 1, 3)]
    assert loaded.records == 3 and loaded.dropped == []
    # a turn cut below 2 response tokens is left out alone; a record is dropped when none is left
    cut = read_examples(path, tokenizer, max_length=7)
    assert [e.input_ids for e in cut.examples] == [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 20, 22, 23], [5, 6, 7, 8]]
    assert (cut.dropped, cut.cut_turns) == ([], 1)  # the second turn of line 2, counted for the trainer's warning
    assert cut.answers_without_ids == 0
    old_format = dict(GOOD, messages=[{"role": r, "content": "x"} for r in ("user", "assistant") * 3])
    path.write_text(json.dumps(old_format) + "\n")  # datagen before 2026-12-06: three answers, the last one's ids
    assert read_examples(path, tokenizer, max_length=64).answers_without_ids == 2
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(two_turns) + "\n" + json.dumps(short) + "\n")
    tiny = read_examples(path, tokenizer, max_length=4)
    assert (tiny.dropped, tiny.cut_turns) == ([1, 2], 0)
    # without texts, a turn is known by its prompt: lines 1 and 2 open with the same one
    assert loaded.examples[0].asked == loaded.examples[1].asked != loaded.examples[2].asked


@pytest.mark.parametrize("earlier, message", [
    ({"prompt_ids": [5], "response_ids": [6, 7]}, "`earlier_turns` must be a list of"),
    ([{"prompt_ids": [5]}], '`earlier_turns`[0] must be an object with "prompt_ids" (or, instead,'),
    ([{"prompt_tail_ids": [5], "prompt_prefix_length": 9, "response_ids": [6]}],
     "`earlier_turns`[0].`prompt_prefix_length` must be a whole number of the record's prompt_ids (0..3), got 9"),
    ([{"prompt_tail_ids": [5, -1], "prompt_prefix_length": 1, "response_ids": [6]}],
     "`earlier_turns`[0].`prompt_tail_ids` holds ids outside"),
    ([{"prompt_ids": [5], "prompt_tail_ids": [5], "prompt_prefix_length": 1, "response_ids": [6]}],
     '`earlier_turns`[0] must be an object with "prompt_ids" (or, instead,'),
    ([{"prompt_ids": [5], "prompt_prefix_length": 1, "response_ids": [6]}],
     '`earlier_turns`[0] must be an object with "prompt_ids" (or, instead,'),
    ([{"prompt_ids": [5], "response_ids": [6, "7"]}], "`earlier_turns`[0].`response_ids` must be a list of token ids"),
    ([{"prompt_ids": [5, 999], "response_ids": [6]}], "`earlier_turns`[0].`prompt_ids` holds ids outside the target's"),
])
def test_bad_earlier_turns_are_named_with_their_line(tmp_path, tokenizer, earlier, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(dict(GOOD, earlier_turns=earlier)) + "\n")
    with pytest.raises(UserError, match=re.escape("data.jsonl:2: " + message)):
        read_examples(path, tokenizer, max_length=64, vocab_size=128)


def test_turns_that_continue_one_another_are_one_sequence(tmp_path, tokenizer):
    """Where a turn's prompt starts with the turn before it, prompt and answer token for token, the turns are one
    example holding both answers: the target computes the conversation once. A turn whose prompt renders the
    conversation otherwise starts a sequence of its own; --max-length keeps the answers it leaves 2 tokens of."""
    first, second, third = ([5, 6], [20, 21, 22]), ([5, 6, 20, 21, 22, 7], [30, 31, 32]), ([5, 6, 20, 9], [40, 41])
    record = {"prompt_ids": third[0], "response_ids": third[1],
              "earlier_turns": [{"prompt_ids": p, "response_ids": r} for p, r in (first, second)]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(record) + "\n")
    loaded = read_examples(path, tokenizer, max_length=64, vocab_size=128)
    assert [(e.input_ids, e.responses) for e in loaded.examples] == [
        ([5, 6, 20, 21, 22, 7, 30, 31, 32], [(2, 5), (6, 9)]), ([5, 6, 20, 9, 40, 41], [(4, 6)])]
    assert loaded.examples[0].prompts() == [(5, 6), (5, 6, 20, 21, 22, 7)]
    assert loaded.examples[0].response_tokens() == [20, 21, 22, 30, 31, 32]
    cut = read_examples(path, tokenizer, max_length=8, vocab_size=128)  # 2 tokens of the second answer are left
    assert [(e.input_ids, e.responses) for e in cut.examples] == [
        ([5, 6, 20, 21, 22, 7, 30, 31], [(2, 5), (6, 8)]), ([5, 6, 20, 9, 40, 41], [(4, 6)])]
    cut = read_examples(path, tokenizer, max_length=7, vocab_size=128)  # 1: the sequence ends with the first
    assert [(e.input_ids, e.responses) for e in cut.examples] == [([5, 6, 20, 21, 22], [(2, 5)]),
                                                                  ([5, 6, 20, 9, 40, 41], [(4, 6)])]
    assert cut.cut_turns == 1 and cut.examples[0].asked == loaded.examples[0].asked[:1]
    # a prompt that adds nothing to the turn before it: the two answers would touch and read as one response
    record["earlier_turns"][1]["prompt_ids"] = first[0] + first[1]
    path.write_text(json.dumps(record) + "\n")
    touching = read_examples(path, tokenizer, max_length=64, vocab_size=128)
    assert [e.responses for e in touching.examples] == [[(2, 5)], [(5, 8)], [(4, 6)]]
    assert fingerprint(loaded.examples) != fingerprint([loaded.examples[0].keeping([1]), loaded.examples[1]])


def test_a_conversation_with_no_answer_after_a_prompt_is_named(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match="data.jsonl:2: the conversation has no assistant message after a prompt"):
        read_examples(path, tokenizer, max_length=64)


def test_every_assistant_turn_of_a_text_conversation_is_an_example(tmp_path, tokenizer):
    from dflash.training.data import _apply_template, _ids

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many clips?"},
                {"role": "assistant", "content": "72 clips."}, {"role": "user", "content": "And in May?"},
                {"role": "assistant", "content": "36 clips."}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    [example] = read_examples(path, tokenizer, max_length=512).examples  # one sequence: the template continues
    assert example.input_ids == _ids(_apply_template(tokenizer, messages))
    assert len(example.responses) == 2
    for (start, end), answered in zip(example.responses, (3, 5)):
        prompt = _ids(_apply_template(tokenizer, messages[: answered - 1], add_generation_prompt=True))
        assert example.input_ids[:end] == _ids(_apply_template(tokenizer, messages[:answered]))
        assert example.input_ids[:start] == prompt


def test_the_held_out_split_keeps_a_conversation_together_and_one_turn_records_split_as_before(tmp_path, tokenizer):
    rows = [dict(GOOD, prompt_ids=[5, 6, i]) for i in range(20)]
    rows[3]["earlier_turns"] = [{"prompt_ids": [5], "response_ids": [6, 7]}] * 2
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = read_examples(path, tokenizer, max_length=64).examples
    one_turn = [e for e in examples if e.record != 4]
    for seed in range(8):
        train, held = split_records(examples, 0.2, seed)
        assert {e.record for e in train}.isdisjoint(e.record for e in held) and len(train) + len(held) == 22
        assert len({e.record for e in held}) == 4  # a fifth of the 20 records, however many turns they hold
        assert sum(e.record == 4 for e in held) in (0, 3)
        assert split_records(one_turn, 0.2, seed) == split_examples(one_turn, 0.2, seed)


def test_a_sharegpt_conversation_trains_as_the_same_messages_would(tmp_path, tokenizer):
    turns = [("human", "How many clips?"), ("gpt", "72 clips."), ("human", "And in May?"), ("gpt", "36 clips.")]
    roles = {"human": "user", "gpt": "assistant"}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": f, "value": v} for f, v in turns]}) + "\n"
                    + json.dumps({"messages": [{"role": roles[f], "content": v} for f, v in turns]}) + "\n")
    examples = [(e.input_ids, e.responses) for e in read_examples(path, tokenizer, max_length=512).examples]
    assert len(examples) == 2 and examples[0] == examples[1] and len(examples[0][1]) == 2


# as Qwen3's template: thinking off opens the answer with an empty think block, in the prompt and in the full
# conversation's last answer
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' and loop.last and enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_text_records_render_with_the_thinking_mode_they_will_be_served_with(tmp_path, tokenizer):
    """Served with thinking off, the prompt ends with the empty think block and the answer is the text alone."""
    from dflash.training.data import _apply_template, _ids

    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = THINKING
    messages = [{"role": "user", "content": "How many clips?"}, {"role": "assistant", "content": "72 clips."}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    off = read_examples(path, thinking, max_length=512, template_kwargs={"enable_thinking": False}).examples[0]
    served = _ids(_apply_template(thinking, messages[:1], add_generation_prompt=True, enable_thinking=False))
    assert off.input_ids[: off.response_start] == served
    assert thinking.decode(off.input_ids[off.response_start:]).startswith("72 clips.")
    default = read_examples(path, thinking, max_length=512).examples[0]
    assert default.response_start < off.response_start  # the template's own default: no think block


def test_a_turn_is_known_by_the_user_messages_before_its_answer_whatever_the_record_form(tmp_path, tokenizer):
    """The key that keeps a held-out question out of training: the same for a datagen record (its texts carry
    datagen's --prompt-suffix) and a text record of the conversation, with or without a last unanswered question."""
    from dflash.training.data import tokenize_record

    suffix = "\nThink step by step."
    talk = [{"role": "user", "content": "How many clips?"}, {"role": "assistant", "content": "72 clips."},
            {"role": "user", "content": "And in May?"}, {"role": "assistant", "content": "36 clips."}]
    suffixed = [dict(m, content=m["content"] + suffix) if m["role"] == "user" else m for m in talk]
    datagen_record = {"messages": suffixed, "prompt_ids": [5, 6, 7, 8], "response_ids": [9, 10],
                      "earlier_turns": [{"prompt_ids": [5, 6], "response_ids": [7, 8]}]}

    def asked(record, prompt_suffix=""):
        return [a for e in tokenize_record(record, tokenizer, 512, prompt_suffix=prompt_suffix) for a in e.asked]

    text = asked({"messages": talk})
    assert len(set(text)) == 2 and asked(datagen_record, suffix) == text
    assert asked(datagen_record) != text  # the suffix is what datagen added, not what was asked
    assert asked({"messages": talk[:3]}) == text[:1]  # a last question without its answer
    assert asked(dict(datagen_record, messages=[])) == asked({"prompt_ids": [5, 6, 7, 8], "response_ids": [9, 10],
                                                                "earlier_turns": [{"prompt_ids": [5, 6],
                                                                                   "response_ids": [7, 8]}]})
    with pytest.raises(UserError, match="`messages`\\[0\\] needs a string"):  # texts beside the ids are checked
        asked(dict(datagen_record, messages=[{"role": "user"}]))


def test_an_earlier_turn_is_written_as_it_is_read_back(tmp_path, tokenizer):
    """datagen writes `earlier_turn_record`, training reads it: the same prompt, whatever it shares with the last."""
    from dflash.training.data import earlier_turn_record, record_turns

    last = [5, 6, 7, 8, 9]
    for prompt in ([5, 6, 7], [5, 6, 11, 12], [13], last + [14], []):
        entry = earlier_turn_record(prompt, [20, 21], last)
        assert entry["prompt_tail_ids"] == prompt[entry["prompt_prefix_length"]:]
        record = {"prompt_ids": last, "response_ids": [30, 31], "earlier_turns": [entry]}
        assert record_turns(record, tokenizer, 128)[0] == (prompt, [20, 21])


def test_a_thinking_mode_that_opens_answers_otherwise_is_named(tmp_path, tokenizer):
    """A template whose thinking-off prompt opens the answer with a mark that a rendered answer lacks (Qwen3's, for
    an answer holding its reasoning): the record cannot train, and the error names the mode to train with."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking"
        " %}<|mask|>\n{% endif %}{% endif %}")
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "How many clips?", "response": "There are 72."}) + "\n")
    assert read_examples(path, tokenizer, max_length=64).examples  # the template's default mode renders alike
    with pytest.raises(UserError, match="renders the prompt differently inside the full conversation \\(with "
                                        "enable_thinking false, .*train with the mode the answers were written in"):
        read_examples(path, tokenizer, max_length=64, template_kwargs={"enable_thinking": False})


def test_each_epoch_and_seed_draws_its_own_order_of_the_examples():
    epochs = [epoch_batches(64, 8, epoch, seed=0) for epoch in range(3)]
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert epoch_batches(64, 8, 0, seed=1) != epochs[0]
    assert epoch_batches(64, 8, 1, seed=0) == epochs[1]  # and the same again: a resume continues it
    assert all(sorted(sum(batches, [])) == list(range(64)) for batches in epochs)

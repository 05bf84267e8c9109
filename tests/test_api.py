import pytest

from dflash import DFlash
from dflash.errors import UserError


@pytest.fixture(scope="module")
def pipe(tiny_pair):
    target_dir, draft_dir = tiny_pair
    return DFlash.from_pretrained(target_dir, draft_dir, device="cpu")


def test_text_messages_and_ids_encode_consistently(pipe):
    text_ids = pipe.encode("How many clips?")
    assert text_ids == pipe.encode([{"role": "user", "content": "How many clips?"}])
    assert pipe.encode(text_ids) == text_ids
    assert pipe.encode("How many clips?", raw=True) != text_ids  # no chat template


def test_generate_matches_plain_decoding(tiny_pair, pipe):
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    a = pipe.generate("How many clips did Natalia sell?", max_new_tokens=20)
    b = plain.generate("How many clips did Natalia sell?", max_new_tokens=20)
    assert a.output_ids == b.output_ids and a.text == b.text
    assert a.stats.drafter_forwards > 0 and b.stats.drafter_forwards == 0


def test_auto_block_size_pipeline_matches_plain_decoding(tiny_pair):
    auto = DFlash.from_pretrained(*tiny_pair, device="cpu", block_size="auto")
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    assert auto.block_size == "auto"
    a = auto.generate("How many clips did Natalia sell?", max_new_tokens=20)
    b = plain.generate("How many clips did Natalia sell?", max_new_tokens=20)
    assert a.output_ids == b.output_ids
    assert auto.engine._block_policy is not None  # the generation chose its block sizes
    fixed = auto.generate("How many clips did Natalia sell?", max_new_tokens=20, block_size=4)
    assert fixed.output_ids == b.output_ids and max(fixed.stats.acceptance_lengths) <= 4
    with pytest.raises(UserError, match="'auto'"):
        DFlash.from_pretrained(*tiny_pair, device="cpu", block_size="fastest")


def test_stream_pieces_add_up_to_the_text_without_the_stop_string(pipe):
    free = pipe.generate("Weng earns", max_new_tokens=30, stop_token_ids=[])
    assert len(free.text) > 6
    stop = free.text[4:7]
    stream = pipe.stream("Weng earns", max_new_tokens=30, stop_token_ids=[], stop_strings=[stop])
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == free.text[: free.text.find(stop)]
    assert stop not in "".join(pieces)


def test_bad_prompts_and_options(pipe):
    with pytest.raises(UserError, match="messages is empty"):
        pipe.generate([])
    with pytest.raises(UserError, match="role"):
        pipe.generate([{"content": "hi"}])
    with pytest.raises(UserError, match="unknown generation option"):
        pipe.generate("hi", max_tokens=3)


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_variables(tiny_pair):
    pipe = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    pipe.tokenizer.chat_template = THINKING_TEMPLATE
    default = pipe.encode("How many clips?")
    off = pipe.encode("How many clips?", chat_template_kwargs={"enable_thinking": False})
    assert len(off) > len(default) and off[: len(default)] == default
    quiet = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu",
                                   chat_template_kwargs={"enable_thinking": False})
    quiet.tokenizer.chat_template = THINKING_TEMPLATE
    assert quiet.encode("How many clips?") == off
    assert quiet.encode("How many clips?", chat_template_kwargs={"enable_thinking": True}) == default
    assert quiet.encode("How many clips?", raw=True) == pipe.encode("How many clips?", raw=True)  # no template
    for bad in ({"add_generation_prompt": False}, ["enable_thinking"], {1: True}):
        with pytest.raises(UserError, match="chat_template_kwargs"):
            pipe.encode("hi", chat_template_kwargs=bad)

"""Prompt rendering shared by every path (dflash/chat.py)."""

import pytest

from conftest import make_tokenizer
from dflash.chat import as_ids, encode_plain, render_chat, template_roles
from dflash.serve.protocol import ChatMessage

DEVELOPER = [{"role": "developer", "content": "Answer tersely."}, {"role": "user", "content": "How many clips?"}]
SYSTEM = [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "How many clips?"}]


def test_a_developer_message_is_the_system_message_of_a_template_without_that_role():
    tokenizer = make_tokenizer()  # its template writes any role's name: a developer turn would show as one
    assert render_chat(tokenizer, DEVELOPER, add_generation_prompt=True) == \
        render_chat(tokenizer, SYSTEM, add_generation_prompt=True)


def test_a_template_that_knows_the_developer_role_gets_it():
    template = ("{% for m in messages %}{% if m['role'] == 'developer' %}[dev]{% endif %}{{ m['content'] }}"
                "{% endfor %}")
    assert template_roles(DEVELOPER, template) == DEVELOPER
    assert template_roles(DEVELOPER, None) == SYSTEM
    assert template_roles(SYSTEM, None) is SYSTEM  # nothing to change, nothing copied


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_the_server_passes_an_earlier_answers_reasoning_to_the_template(field):
    message = ChatMessage.model_validate({"role": "assistant", "content": "72", field: "48 and 24"})
    assert message.for_template() == {"role": "assistant", "content": "72", field: "48 and 24"}
    tokenizer = make_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m." + field + " %}<|im_start|>{{ m." + field + " }}"
                               "<|im_end|>{% endif %}{{ m.content }}{% endfor %}")
    text = tokenizer.decode(as_ids(render_chat(tokenizer, [message.for_template()])))
    assert text.replace(" ", "") == "<|im_start|>48and24<|im_end|>72"


def bos_adding_tokenizer(adds_bos: bool = True, bos_strips_left: bool = False):
    """A Llama-style tokenizer whose encoding starts with its BOS `<s>` (when `adds_bos`); with `bos_strips_left`
    the BOS token swallows the whitespace before it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [" "]
    tok = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bos = AddedToken("<s>", lstrip=bos_strips_left, special=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=bos, eos_token="</s>")


@pytest.mark.parametrize("adds_bos", [True, False])
def test_a_text_that_starts_with_bos_gets_no_second_one(adds_bos):
    """A completion prompt rendered by a chat template starts with the BOS token; the tokenizer added another."""
    tokenizer = bos_adding_tokenizer(adds_bos)
    added = [1] if adds_bos else []
    assert encode_plain(tokenizer, "ab") == added + [3, 4]
    assert encode_plain(tokenizer, "<s>ab") == [1, 3, 4]
    assert encode_plain(tokenizer, "<s><s>ab") == [1, 1, 3, 4]  # the text's own BOS tokens are kept, each
    assert encode_plain(tokenizer, "a<s>b") == added + [3, 1, 4]
    assert encode_plain(tokenizer, "") == added
    assert encode_plain(tokenizer, "<s>") == [1]


def test_a_bos_that_swallows_the_whitespace_before_it_gets_no_second_one_either():
    tokenizer = bos_adding_tokenizer(bos_strips_left=True)
    assert encode_plain(tokenizer, " <s>ab") == [1, 3, 4]
    assert encode_plain(tokenizer, " ab") == [1, 29, 3, 4]  # a space that is no BOS's is kept

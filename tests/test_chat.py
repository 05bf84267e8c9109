"""Prompt rendering shared by every path (dflash/chat.py)."""

import pytest

from conftest import make_tokenizer
from dflash.chat import as_ids, render_chat, template_roles
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

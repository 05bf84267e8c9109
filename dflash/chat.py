"""Prompts as a target reads them: chat messages through its chat template, text as it is, and the checks both
take. The API, datagen, bench and the server all render prompts through these, so each reads one conversation the
same way (a base model without a chat template gets `plain_conversation`)."""

from __future__ import annotations

import functools
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from dflash.decoding.detokenizer import check_utf8
from dflash.errors import GenerationError


class TemplateRefusal(GenerationError):
    """The target's chat template raised on a conversation (a role or an order it does not take)."""


class ToolsUnshown(GenerationError):
    """Tools for a chat template that never shows them to the model."""


def check_tools_shown(tokenizer, tools: list[dict] | None) -> None:
    """Refuse tools where the chat template never reads its `tools` variable: the model would never see them (and
    transformers would drop them without a word)."""
    if tools and "tools" not in str(getattr(tokenizer, "chat_template", None) or ""):
        raise ToolsUnshown("this model's chat template never shows the model tools (it does not read a `tools` "
                           "variable), so it could not call them; leave tools out, or use a model whose template "
                           "renders them (Qwen's, Llama 3.1's, Mistral's, Hermes' ...)")


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of text sent as it is (no chat template): with the tokenizer's special tokens (e.g. BOS), except
    a BOS the text already starts with (a prompt a chat template rendered, as Llama 3's writes its
    `<|begin_of_text|>`): the model never saw two. The tokenizer does not warn of a text longer than its model's
    context (see `render_chat`)."""
    ids = tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or ids[:2] != [bos, bos]:
        return ids
    own = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return own if ids == [bos] + own and own[:1] == [bos] else ids  # the tokenizer added one before the text's own


def render_chat(tokenizer, messages: list[dict], /, **options) -> Any:
    """The tokenizer's chat template applied to `messages` (token ids); a `TemplateRefusal` quoting the template
    when it raises on them. The tokenizer does not warn of a prompt longer than its model's context: the caller
    measures that against the target's own and says what to do."""
    messages = template_roles(messages, getattr(tokenizer, "chat_template", None))
    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, tokenizer_kwargs={"verbose": False}, **options)
    except TemplateSyntaxError as err:  # the template itself is broken, whatever the messages
        where = getattr(tokenizer, "name_or_path", "") or "the model"
        raise TemplateRefusal(f"the chat template of {where} is not a valid Jinja template ({err}, line {err.lineno}); "
                              "fix its chat_template.jinja (or chat_template in tokenizer_config.json)") from None
    except TemplateError as err:  # templates refuse some conversations (roles, order) by raising
        raise TemplateRefusal(f"the model's chat template refused these messages: {err}") from None
    except ValueError as err:  # transformers, when the template changes the final message it is to continue
        if options.get("continue_final_message"):
            raise TemplateRefusal(f"the last message cannot be continued: {err}") from None
        raise TemplateRefusal(_cannot_render(err)) from None
    except (TypeError, KeyError, AttributeError, IndexError) as err:  # e.g. `arguments | tojson` of a tool call
        raise TemplateRefusal(_cannot_render(err)) from None


def encode_conversation(tokenizer, messages: list[dict], variables: dict[str, Any] | None = None, *,
                        add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """Token ids of chat messages: through the tokenizer's chat template with these template variables, or, for a
    tokenizer without one (a base model), as `plain_conversation` text. `continue_final_message`: the messages end
    with the start of the assistant's answer, which generation continues."""
    messages = text_messages(messages)
    variables = variables or {}
    if not getattr(tokenizer, "chat_template", None):
        text = plain_conversation(messages)
        check_text(text)
        return encode_plain(tokenizer, text)
    if continue_final_message:
        return as_ids(render_chat(tokenizer, messages, add_generation_prompt=False, continue_final_message=True,
                                  **variables))
    return as_ids(render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **variables))


def template_roles(messages: list[dict], template: str | dict | None) -> list[dict]:
    """OpenAI's `developer` messages as `system` ones, unless the template itself knows a `developer` role (as
    gpt-oss's does): most templates render only system, user, assistant and tool turns, and drop the others
    without a word. Every path renders through here, so datagen, training and serving see the same prompt."""
    if "developer" in str(template or "") or not any(m.get("role") == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def _cannot_render(err: Exception) -> str:
    """A template that fails on the messages' contents (a field missing or of another type than it reads)."""
    return (f"the model's chat template cannot render these messages ({type(err).__name__}: {err}); check each "
            "message's fields against OpenAI's chat format (e.g. a tool call's function needs a name and arguments)")


def check_text(text: str, what: str = "the prompt", fix: str = "give the text to decode") -> None:
    """Refuse empty text (`fix` says what to do instead), and text that is not Unicode (see `check_utf8`)."""
    if not text:
        raise GenerationError(f"{what} is empty; {fix}")
    check_utf8(text, what)


# said by the commands that send a base model conversations (bench, datagen), so users know what it was given
PLAIN_CONVERSATION_NOTE = ("the target's tokenizer has no chat template (a base model): prompts are sent as plain "
                           "text, a conversation's turns and answers joined by blank lines (dflash.chat."
                           "plain_conversation)")
# enable_thinking for a target without a chat template, from the API or a command's flag; False is taken there, as
# nothing thinks
THINKING_WITHOUT_TEMPLATE = ("enable_thinking (--enable-thinking) sets a chat template variable, and this target's "
                             "tokenizer has no chat template (a base model) to read it: leave it out")


def plain_conversation(messages: list[dict]) -> str:
    """A conversation as plain text for a target without a chat template (a base model): the messages' contents
    joined by blank lines."""
    return "\n\n".join(m["content"] for m in messages)


def text_messages(messages: list | tuple) -> list[dict]:
    """The messages, each with string 'role' and 'content': a content of OpenAI text parts ([{"type": "text",
    "text": ...}]) becomes their texts joined by newlines, as `dflash serve` and other OpenAI-compatible servers
    join them."""
    checked = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": _joined_parts(m["content"])}
        if isinstance(m, dict) and m.get("content") is None and m.get("tool_calls"):  # an assistant's calls alone
            m = {**m, "content": ""}
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise GenerationError(f"each message needs a string 'role' and a 'content' (a string or a list of text "
                                  f"parts), got {m!r}")
        check_utf8(m["content"], "a message's content")
        checked.append(m)
    return checked


def _joined_parts(parts: list) -> str:
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise GenerationError(f"a message's content parts must be text parts like {{'type': 'text', 'text': "
                                  f"'...'}} (this package reads text only), got {part!r}")
    return "\n".join(part["text"] for part in parts)


def as_ids(encoded) -> list[int]:
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return list(encoded)


# variables a caller may not set: apply_chat_template's own arguments, which the engine decides (those of the
# installed transformers join these: padding, truncation, max_length ... would cut or pad the prompt unseen)
_RESERVED_TEMPLATE_VARIABLES = {"add_generation_prompt", "tokenize", "conversation", "messages", "return_dict",
                                "return_tensors", "continue_final_message", "chat_template", "tools", "documents"}


@functools.cache
def reserved_template_variables() -> frozenset[str]:
    import inspect

    from transformers import PreTrainedTokenizerBase

    named = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    own = {p.name for p in named if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return frozenset(_RESERVED_TEMPLATE_VARIABLES | own)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Chat template variables, checked: a mapping of names (e.g. enable_thinking) to values."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise GenerationError("chat_template_kwargs must be a JSON object of template variables, e.g. "
                              '{"enable_thinking": false}')
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise GenerationError(f"chat_template_kwargs.enable_thinking must be true or false, got {thinking!r}")
    reserved = sorted(set(kwargs) & reserved_template_variables())
    if reserved:
        raise GenerationError(f"chat_template_kwargs may not set {', '.join(reserved)}: dflash sets "
                              f"{'it' if len(reserved) == 1 else 'them'} itself")
    return dict(kwargs)


# a conversation a chat template's modes render differently, if anything does: two turns, then the next answer's
# opening (Qwen3 with enable_thinking false opens it with an empty <think></think>, and strips earlier reasoning)
_PROBE = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"},
          {"role": "user", "content": "And 4 + 4?"}]


def renders_alike(tokenizer, a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether the chat template renders a conversation the same under template variables `a` and `b` (e.g.
    {"enable_thinking": False} and the template's defaults, {} or None). True without a chat template, or when the
    template cannot render the probe conversation (nothing to compare)."""
    if (a or {}) == (b or {}) or not getattr(tokenizer, "chat_template", None):
        return True
    try:
        return as_ids(render_chat(tokenizer, _PROBE, add_generation_prompt=True, **(a or {}))) == \
            as_ids(render_chat(tokenizer, _PROBE, add_generation_prompt=True, **(b or {})))
    except TemplateRefusal:
        return True


def describe_template_kwargs(kwargs: dict[str, Any] | None) -> str:
    """Template variables as a message names them: "enable_thinking false", or "the template's defaults"."""
    if not kwargs:
        return "the chat template's defaults"
    return ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in kwargs.items())


# said where thinking is asked of a template that does not read enable_thinking (off is what such a template does)
THINKING_IGNORED = ("this target's chat template renders a conversation the same with enable_thinking true or false "
                    "(it does not read that variable), so --enable-thinking (chat_template_kwargs enable_thinking "
                    "true) does not make it think: leave it out")


def ignores_thinking(tokenizer) -> bool:
    """Whether the tokenizer has a chat template that renders the same with enable_thinking true and false."""
    return bool(getattr(tokenizer, "chat_template", None)) and \
        renders_alike(tokenizer, {"enable_thinking": True}, {"enable_thinking": False})


def merged_template_kwargs(variables: dict[str, Any] | None, enable_thinking: bool | None) -> dict[str, Any] | None:
    """--chat-template-kwargs with --enable-thinking / --no-enable-thinking over it (None: neither given, the
    template's defaults). Both naming enable_thinking, differently, is refused."""
    merged = dict(check_template_kwargs(variables))
    if enable_thinking is not None:
        if merged.get("enable_thinking", enable_thinking) != enable_thinking:
            flag = "--enable-thinking" if enable_thinking else "--no-enable-thinking"
            raise GenerationError(f"{flag} and --chat-template-kwargs enable_thinking "
                                  f"{str(merged['enable_thinking']).lower()} disagree: give it once")
        merged["enable_thinking"] = enable_thinking
    return merged or None

"""Log-probabilities through the official openai client: chat's and completions' objects, streamed and whole, are
the library's (the target's own), and bad requests for them are refused clearly."""

from __future__ import annotations

import httpx
import pytest

from conftest import TOKENIZERS
from dflash.decoding.detokenizer import decode
from dflash.decoding.logprobs import TokenLogprob
from dflash.serve.logprobs import LogprobFormat, TextOffsets

from .test_api import MODEL, PROMPTS, QUESTION, chat

MAX = 20


def library(server, prompt, top: int, raw: bool = False):
    """The library's answer with log-probabilities, as the server decodes it (greedy, EOS ignored)."""
    prompt = server.pipe.encode(prompt, raw=True) if raw else prompt
    return server.pipe.generate(prompt, max_new_tokens=MAX, ignore_eos=True, logprobs=top)


def test_chat_logprobs_are_the_librarys_streamed_or_not(server, client):
    expected = library(server, QUESTION, top=3)
    fmt = LogprobFormat(server.pipe.tokenizer)
    out = chat(client, max_tokens=MAX, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == len(expected.logprobs)
    for got, want in zip(content, expected.logprobs):
        assert got.token == fmt.token(want.token_id)[0] and got.bytes == fmt.token(want.token_id)[1]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.token for t in got.top_logprobs] == [fmt.token(i)[0] for i, _ in want.top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([p for _, p in want.top], abs=1e-5)
    assert bytes(b for t in content for b in t.bytes).decode() == out.choices[0].message.content
    streamed = [c.choices[0].logprobs for c in chat(client, max_tokens=MAX, logprobs=True, top_logprobs=3,
                                                    stream=True, extra_body={"ignore_eos": True}) if c.choices]
    streamed_content = [t for lp in streamed if lp is not None for t in lp.content]
    assert [(t.token, [a.token for a in t.top_logprobs]) for t in streamed_content] == \
        [(t.token, [a.token for a in t.top_logprobs]) for t in content]
    assert [t.logprob for t in streamed_content] == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert sum(lp is not None for lp in streamed) > 1  # spread over the stream's chunks, not all at the end
    without = chat(client, max_tokens=4)
    assert without.choices[0].logprobs is None


def test_completions_logprobs_are_the_librarys_streamed_or_not(server, client):
    expected = library(server, PROMPTS[0], top=2, raw=True)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text == expected.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for top, token, chosen in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs):
        assert 2 <= len(top) <= 3 and top[token] == pytest.approx(chosen)  # the 2 likeliest and the chosen one
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX, temperature=0, logprobs=2, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset  # offsets run on across chunks
    only_chosen = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0)
    assert all(len(top) == 1 for top in only_chosen.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize("endpoint,fields,param", [
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ("chat/completions", {"logprobs": 2}, "logprobs"),  # chat's logprobs is a boolean
    ("completions", {"logprobs": True}, "logprobs"),  # completions' is a number
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_requests_are_refused(server, endpoint, fields, param):
    body = {"model": MODEL, "max_tokens": 4, **fields}
    body.update({"messages": QUESTION} if endpoint.startswith("chat") else {"prompt": PROMPTS[0]})
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "logprobs" in error["message"]


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_each_tokens_text_and_bytes_make_the_answer(kind):
    """A token's text keeps the space SentencePiece drops at a text's start; a token holding part of a character
    (byte-level BPE, byte fallback) decodes to U+FFFD, and its bytes are its own: together they make the text."""
    tokenizer = TOKENIZERS[kind]()
    fmt = LogprobFormat(tokenizer)
    text = "Natalia sold 48 clips, and then"
    if kind != "metaspace":  # its tiny vocabulary has ASCII only
        text += " h\u00e9llo \u2192 \u6570\u5b66"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert bytes(b for i in ids for b in fmt.token(i)[1]).decode().strip() == text
    assert any(fmt.token(i)[0] == "\ufffd" for i in ids) == (kind != "metaspace")
    assert fmt.token(tokenizer.eos_token_id)[0] == tokenizer.eos_token  # a special token shows as itself


def test_the_byte_level_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from dflash.serve.logprobs import _byte_level_alphabet

    assert _byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}


def test_echo_scores_the_prompt_as_lm_eval_reads_it(server, client):
    """lm-eval's log-likelihood request: token ids, echo, logprobs=1, max_tokens 0 or 1; it sums token_logprobs
    after the context and checks each against its position's most likely token."""
    ids = server.pipe.encode(PROMPTS[1], raw=True)
    expected = server.pipe.generate(ids, raw=True, max_new_tokens=1, prompt_logprobs=1, logprobs=1, ignore_eos=True)
    prompt_only = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=1,
                                            temperature=0)
    choice = prompt_only.choices[0]
    assert choice.text == decode(server.pipe.tokenizer, ids) and choice.finish_reason == "length"
    assert prompt_only.usage.completion_tokens == 0 and prompt_only.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before the first token scores it
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in expected.prompt_logprobs], abs=1e-5)
    assert [max(top, key=top.get) for top in lp.top_logprobs[1:]] == \
        [LogprobFormat(server.pipe.tokenizer).token(e.top[0][0])[0] for e in expected.prompt_logprobs]
    with_answer = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                            temperature=0, extra_body={"ignore_eos": True})
    both = with_answer.choices[0]
    assert both.text == choice.text + expected.text and len(both.logprobs.tokens) == len(ids) + 1
    assert both.logprobs.token_logprobs[:-1] == lp.token_logprobs  # lm-eval's [ctxlen:-1] leaves the answer out
    assert both.logprobs.token_logprobs[-1] == pytest.approx(expected.logprobs[0].logprob, abs=1e-5)
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPTS[1]  # the text as sent
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    plain_echo = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3, echo=True, temperature=0)
    assert plain_echo.choices[0].text.startswith(PROMPTS[1]) and plain_echo.choices[0].logprobs is None


def test_no_tokens_without_echo_and_echo_on_chat_are_refused(server):
    for endpoint, body, param in [("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                                  ("chat/completions", {"messages": QUESTION, "echo": True}, "echo")]:
        response = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": MODEL, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    said = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 0}).json()["error"]
    assert "echo=true" in said["message"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": QUESTION, "max_completion_tokens": 0})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"


def test_a_prompt_alone_may_fill_the_context(server):
    """lm-eval cuts a context to the model's length: scored alone, it fits; asking a token more does not."""
    ids = [5 + i % 50 for i in range(server.server_state.max_model_len)]
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0}
    scored = httpx.post(f"{server.url}/v1/completions", json=body)
    assert scored.status_code == 200, scored.text
    assert len(scored.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    one_more = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1})
    assert one_more.status_code == 400 and one_more.json()["error"]["code"] == "context_length_exceeded"


def test_text_offsets_point_at_each_tokens_text():
    """Special tokens count where the text shows them (a prompt echoed as sent) and not where decoding leaves them
    out; a character split across tokens counts once."""
    tokenizer = TOKENIZERS["byte-level (embedded)"]()
    fmt = LogprobFormat(tokenizer)
    sent = "<|im_start|>user\nJanet\u2019s ducks \U0001f986 lay 16 eggs<|im_end|>"
    ids = tokenizer.encode(sent, add_special_tokens=False)
    entries = [TokenLogprob(t, -1.0) for t in ids[1:]]
    for text, as_sent in ((sent, sent), (decode(tokenizer, ids), None)):
        body = fmt.completion(entries, TextOffsets(), unscored=tuple(ids[:1]), sent=as_sent)
        placed = [(tok, at) for tok, at, i in zip(body["tokens"], body["text_offset"], ids)
                  if "\ufffd" not in tok and (as_sent or i not in tokenizer.all_special_ids)]
        assert all(text[at : at + len(tok)] == tok for tok, at in placed), placed
        assert body["text_offset"][-2] == text.index(" eggs")  # after the emoji's three tokens


def test_a_bos_the_tokenizer_adds_to_a_prompt_sent_as_text_takes_no_room_in_it():
    from tokenizers.processors import TemplateProcessing

    tokenizer = TOKENIZERS["byte fallback"]()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fmt = LogprobFormat(tokenizer)
    sent = "hello world"
    ids = tokenizer.encode(sent)
    assert ids[0] == tokenizer.bos_token_id
    body = fmt.completion([TokenLogprob(t, -1.0) for t in ids[1:]], TextOffsets(), unscored=(ids[0],), sent=sent)
    assert body["text_offset"][:2] == [0, 0]  # the BOS, then the text from its start
    assert body["text_offset"][-1] == 1 + sent.index("d")  # (after the leading space SentencePiece writes)


def test_top_logprobs_of_tokens_with_the_same_text_keep_the_likeliest():
    tokenizer = TOKENIZERS["byte-level (embedded)"]()
    fmt = LogprobFormat(tokenizer)
    first, second = tokenizer.encode("\u00e9", add_special_tokens=False)  # two halves, both U+FFFD alone
    chosen = tokenizer.encode("a", add_special_tokens=False)[0]
    body = fmt.completion([TokenLogprob(chosen, -3.0, ((first, -1.0), (second, -2.0)))], TextOffsets())
    assert body["top_logprobs"][0] == {"\ufffd": -1.0, "a": -3.0}


def test_vllms_prompt_logprobs_score_each_prompt_token_with_its_rank(server):
    """vLLM's prompt_logprobs: None, then per prompt token {id: {logprob, rank, decoded_token}} for it and its
    position's most likely tokens, each the target's own (one transformers forward over the prompt)."""
    import torch

    ids = server.pipe.encode(PROMPTS[1], raw=True)
    with torch.no_grad():
        reference = server.pipe.target.model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    scores = answer["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    fmt = LogprobFormat(server.pipe.tokenizer)
    for position, (token, entry) in enumerate(zip(ids[1:], scores[1:])):
        row = reference[position]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert mine["rank"] == int((row > row[token]).sum()) + 1 and mine["decoded_token"] == fmt.token(token)[0]
        best = row.topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in best] == [1, 2] and len(entry) == len({token, *best})
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "prompt_logprobs": 0}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]  # the answer's, once, on chat
    assert all(len(p) == 1 for p in answer["prompt_logprobs"][1:])
    for fields, says in (({"stream": True}, "not in a stream"), ({"echo": True, "logprobs": 1}, "send one of them"),
                         ({"prompt_logprobs": 21}, "less than or equal to 20")):
        refused = httpx.post(f"{server.url}/v1/completions", json={**body, **fields}, timeout=60)
        assert refused.status_code == 400 and says in refused.json()["error"]["message"], refused.text
        assert refused.json()["error"]["param"] == "prompt_logprobs"

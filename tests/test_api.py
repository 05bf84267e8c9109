import math
import shutil
import time
import warnings

import numpy as np
import pytest
import torch

from dflash import CheckpointError, DFlash, GenerationError
from dflash.errors import DFlashWarning, UserError


@pytest.fixture(scope="module")
def pipe(tiny_pair):
    target_dir, draft_dir = tiny_pair
    return DFlash.from_pretrained(target_dir, draft_dir, device="cpu")


def test_text_messages_and_ids_encode_consistently(pipe):
    text_ids = pipe.encode("How many clips?")
    assert text_ids == pipe.encode([{"role": "user", "content": "How many clips?"}])
    assert pipe.encode(text_ids) == text_ids
    assert pipe.encode("How many clips?", raw=True) != text_ids  # no chat template


def test_a_base_models_messages_are_its_turns_as_plain_text(pipe, monkeypatch):
    """No chat template: what datagen trains on and bench measures, through this one rule."""
    monkeypatch.setattr(pipe.tokenizer, "chat_template", None)
    messages = [{"role": "user", "content": "How many clips?"}, {"role": "assistant", "content": "72"},
                {"role": "user", "content": "And pens?"}]
    assert pipe.encode(messages) == pipe.encode("How many clips?\n\n72\n\nAnd pens?", raw=True)
    for prompt in (messages, "How many clips?"):  # nothing reads it, as the commands refuse --enable-thinking
        with pytest.raises(GenerationError, match=r"enable_thinking \(--enable-thinking\) sets a chat template "
                                                  "variable, and this target's tokenizer has no chat template"):
            pipe.encode(prompt, chat_template_kwargs={"enable_thinking": True})
    assert pipe.encode(messages, chat_template_kwargs={"enable_thinking": False}) == pipe.encode(messages)
    with pytest.raises(UserError, match=r"enable_thinking \(--enable-thinking\) sets a chat template variable"):
        DFlash(pipe.target, chat_template_kwargs={"enable_thinking": True})  # a pipeline's own, as each command's


def test_generate_matches_plain_decoding(tiny_pair, pipe):
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    a = pipe.generate("How many clips did Natalia sell?", max_new_tokens=20)
    b = plain.generate("How many clips did Natalia sell?", max_new_tokens=20)
    assert a.output_ids == b.output_ids and a.text == b.text
    assert a.stats.drafter_forwards > 0 and b.stats.drafter_forwards == 0


def test_a_prompt_with_nan_logits_fails_alone_in_a_batch_and_raises_on_its_own(tiny_pair, monkeypatch):
    """generate_batch failed the whole call, and every other prompt's answer, on one prompt's NaN logits."""
    import dataclasses

    from dflash import NoTokenError

    pipe = DFlash.from_pretrained(*tiny_pair, device="cpu")
    prompts = ["How many clips?", "Natalia sold clips.", "How much did she earn?"]
    alone = [pipe.generate(p, max_new_tokens=10).output_ids for p in prompts]
    overflowing = pipe.encode(prompts[1])
    original = pipe.target.forward

    def forward(input_ids, *args, **kwargs):  # that prompt's prefill gives NaN logits
        out = original(input_ids, *args, **kwargs)
        if input_ids.shape[0] == 1 and input_ids[0].tolist() == overflowing:
            out = dataclasses.replace(out, logits=torch.full_like(out.logits, math.nan))
        return out

    monkeypatch.setattr(pipe.target, "forward", forward)
    outputs = pipe.generate_batch(prompts, max_new_tokens=10)
    assert [out.finish_reason for out in outputs][1] == "error" and "NaN" in outputs[1].error
    assert [outputs[0].output_ids, outputs[2].output_ids] == [alone[0], alone[2]]
    with pytest.raises(NoTokenError, match="logits are NaN.*bfloat16 or float32"):
        pipe.generate(prompts[1], max_new_tokens=10)
    with pytest.raises(NoTokenError, match="logits are NaN"):
        list(pipe.stream(prompts[1], max_new_tokens=10))


def test_a_pipeline_without_a_drafter_refuses_per_call_drafting_options(tiny_pair):
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    for options, named in (({"block_size": 4}, "block_size shapes"), ({"branch_length": 2}, "branch_length shapes"),
                           ({"block_size": 8, "branch_length": 1}, "block_size, branch_length shape")):
        with pytest.raises(UserError, match=f"^{named} drafting, and this pipeline decodes with the target alone"):
            plain.generate("How many clips?", max_new_tokens=4, **options)
    assert plain.generate("How many clips?", max_new_tokens=4, block_size=None, branch_length=0).output_ids
    # "auto" chooses among block sizes, and there are none to choose: taken per call as at load
    assert DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu", block_size="auto").block_size == "auto"
    assert plain.generate("How many clips?", max_new_tokens=4, block_size="auto").output_ids


def test_auto_block_size_pipeline_matches_plain_decoding(tiny_pair):
    auto = DFlash.from_pretrained(*tiny_pair, device="cpu", block_size="auto")
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    assert auto.block_size == "auto"
    assert DFlash.from_pretrained(*tiny_pair, device="cpu", block_size=" AUTO").block_size == "auto"  # as the CLI
    a = auto.generate("How many clips did Natalia sell?", max_new_tokens=20)
    b = plain.generate("How many clips did Natalia sell?", max_new_tokens=20)
    assert a.output_ids == b.output_ids
    assert auto.engine._block_policy is not None  # the generation chose its block sizes
    fixed = auto.generate("How many clips did Natalia sell?", max_new_tokens=20, block_size=4)
    assert fixed.output_ids == b.output_ids and max(fixed.stats.acceptance_lengths) <= 4
    with pytest.raises(UserError, match="'auto'"):
        DFlash.from_pretrained(*tiny_pair, device="cpu", block_size="fastest")


def test_a_pipeline_branch_length_reaches_every_generation_and_a_call_may_override_it(tiny_pair):
    branched = DFlash.from_pretrained(*tiny_pair, device="cpu", block_size=4, branch_length=2)
    plain = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    a = branched.generate("How many clips did Natalia sell?", max_new_tokens=20)
    assert a.output_ids == plain.generate("How many clips did Natalia sell?", max_new_tokens=20).output_ids
    assert max(a.stats.block_sizes) > 4  # the block and a branch
    b = branched.generate("How many clips did Natalia sell?", max_new_tokens=20, branch_length=0)
    assert max(b.stats.block_sizes) == 4  # no branch (a last block may be cut)
    with pytest.raises(UserError, match="branch_length"):
        DFlash.from_pretrained(*tiny_pair, device="cpu", branch_length=-1)


def test_stream_pieces_add_up_to_the_text_without_the_stop_string(pipe):
    free = pipe.generate("Weng earns", max_new_tokens=30, ignore_eos=True)
    assert len(free.text) > 6
    stop = free.text[4:7]
    stream = pipe.stream("Weng earns", max_new_tokens=30, ignore_eos=True, stop_strings=[stop])
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == free.text[: free.text.find(stop)]
    assert stop not in "".join(pieces)
    assert (stream.result.stop_string, free.stop_string) == (stop, None)  # what cut it (the server's stop_reason)


def test_openai_text_parts_are_their_texts_joined_as_the_server_joins_them(pipe):
    parts = [{"role": "user", "content": [{"type": "text", "text": "How many"}, {"type": "text", "text": "clips?"}]}]
    assert pipe.encode(parts) == pipe.encode([{"role": "user", "content": "How many\nclips?"}])
    with pytest.raises(GenerationError, match="content parts must be text parts like"):
        pipe.encode([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_an_option_given_as_none_is_its_default_as_in_an_openai_request(pipe):
    """A program forwarding an OpenAI request passes "stop": null, "temperature": null ...; they were refused."""
    options = dict(stop_strings=None, temperature=None, top_p=None, top_k=None, seed=None, ignore_eos=None,
                   branch_length=None, block_size=None, stop_token_ids=None)
    plain = pipe.generate("hi", max_new_tokens=6).output_ids
    assert pipe.generate("hi", max_new_tokens=6, **options).output_ids == plain


def test_a_generation_config_or_a_loaded_model_is_refused_with_the_way_to_pass_it(pipe, tiny_pair):
    import dataclasses

    import transformers

    from dflash import GenerationConfig

    config = GenerationConfig(max_new_tokens=5)
    for call in (lambda: pipe.generate("hi", config), lambda: pipe.generate("hi", config=config)):
        with pytest.raises(GenerationError, match=r"generate\(prompt, \*\*dataclasses.asdict\(config\)\)"):
            call()
    plain = pipe.generate("hi", max_new_tokens=5).output_ids
    assert pipe.generate("hi", **dataclasses.asdict(config)).output_ids == plain
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_pair[0])
    with pytest.raises(UserError, match=r"DFlash\(TargetModel\(model, tokenizer\), load_drafter\(path\)\)"):
        DFlash(model)


def test_bad_prompts_and_options(pipe):
    with pytest.raises(UserError, match="role"):
        pipe.generate([{"content": "hi"}])
    with pytest.raises(UserError, match=r"unknown generation option\(s\) \['max_tokens'\] \(did you mean: "
                                         r"max_tokens -> max_new_tokens\?\)"):
        pipe.generate("hi", max_tokens=3)  # vLLM's name
    with pytest.raises(UserError, match=r"\['max_new_token', 'stop'\] \(did you mean: max_new_token -> "
                                         r"max_new_tokens, stop -> stop_strings\?\)"):
        pipe.generate("hi", max_new_token=3, stop="\n")
    with pytest.raises(UserError, match=r"\['colour'\]; known"):  # nothing near: no guess
        pipe.generate("hi", colour=3)
    with pytest.raises(UserError, match=r"chat_template_kwargs \['max_new_tokens'\] are generation options: pass "
                                         "them as keywords"):
        pipe.generate("hi", False, {"max_new_tokens": 3})  # an options dict in the template variables' place
    with pytest.raises(UserError, match="raw=True sends text without the chat template, and messages are always"):
        pipe.generate([{"role": "user", "content": "hi"}], raw=True)


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ("", "the prompt is empty"),
    (["first", "second"], "several prompts: pass them to generate_batch"),
    ({"role": "user", "content": "hi"}, "wrap the message in a list"),
    ([1, "a"], "also holds 'a'"),
    ([True, False], "not bool"),
    ([1.0, 2.0], "not float"),
    (torch.tensor([1, 2]), r"\.tolist\(\)"),
    (b"hi", "not bytes"),
    ("caf\udce9", "not UTF-8"),  # a byte that was not UTF-8, as Python decodes a command line
    ([{"role": "user", "content": "\udcff"}], "not UTF-8"),
])
def test_a_prompt_that_is_none_of_the_three_kinds_says_what_a_prompt_is(pipe, prompt, message):
    with pytest.raises(GenerationError, match=message):
        pipe.generate(prompt, max_new_tokens=2)


def test_token_ids_may_be_a_tuple_or_numpy_integers(pipe):
    ids = pipe.encode("How many clips?")
    assert pipe.encode(tuple(ids)) == pipe.encode([np.int64(t) for t in ids]) == ids
    assert all(type(t) is int for t in pipe.encode([np.int64(t) for t in ids]))


def test_numpy_integer_options_decode_as_python_integers(pipe):
    """A numpy seed overflowed in the seeded noise's 64-bit arithmetic (a traceback, not a draw)."""
    options = dict(max_new_tokens=6, temperature=0.8, ignore_eos=True)
    expected = pipe.generate("How many clips?", seed=3, **options).output_ids
    for seed in (np.int64(3), np.uint64(3), np.int32(3)):
        assert pipe.generate("How many clips?", seed=seed, **options).output_ids == expected
    big = 2**64 - 5
    assert (pipe.generate("How many clips?", seed=np.uint64(big), **options).output_ids
            == pipe.generate("How many clips?", seed=big, **options).output_ids)


def test_batches_and_streams_are_used_as_documented(pipe):
    assert pipe.generate_batch([], max_new_tokens=2) == []
    with pytest.raises(GenerationError, match="for one prompt call generate"):
        pipe.generate_batch("How many clips?", max_new_tokens=2)  # not five prompts of one character
    with pytest.raises(GenerationError, match="one prompt's token ids"):
        pipe.generate_batch([5, 6, 7], max_new_tokens=2)
    with pytest.raises(GenerationError, match="raw is True or False"):
        pipe.generate("hi", raw="yes")
    stream = pipe.stream("Weng earns", max_new_tokens=4)
    with pytest.raises(GenerationError, match="iterate it first"):
        stream.result  # noqa: B018 - reading it is the test
    text = "".join(stream)
    assert text == stream.result.text
    with pytest.raises(GenerationError, match="iterated once; read its .result"):
        list(stream)
    left = pipe.stream("Weng earns", max_new_tokens=8, ignore_eos=True)
    next(iter(left))  # a break after the first piece
    with pytest.raises(GenerationError, match="this stream has no result: it has not been read to its end .*was "
                                              "left at a break"):
        left.result  # noqa: B018 - reading it is the test
    with pytest.raises(GenerationError, match="iterated once; this one was read before; call stream"):
        list(left)
    read = pipe.stream("Weng earns", max_new_tokens=8, ignore_eos=True)  # next() reads it too, piece by piece
    pieces = [next(read)]
    with pytest.raises(StopIteration):
        while True:
            pieces.append(next(read))
    assert "".join(pieces) == read.result.text == pipe.generate("Weng earns", max_new_tokens=8, ignore_eos=True).text


def test_a_streams_time_to_first_token_runs_from_its_first_read(pipe):
    """Its clock started when stream() was called, so time spent before the loop counted as the model's."""
    stream = pipe.stream("Weng earns", max_new_tokens=4, block_size=4)
    time.sleep(0.5)
    "".join(stream)
    assert stream.result.stats.time_to_first_token_s < 0.4


@pytest.mark.parametrize("temperature", [math.nan, math.inf, 1e39, 100.5])
def test_temperature_must_be_finite(pipe, temperature):
    with pytest.raises(GenerationError, match="temperature must be a finite number"):
        pipe.generate("hi", max_new_tokens=2, temperature=temperature)
    with pytest.raises(GenerationError, match="temperature must be a finite number"):
        pipe.stream("hi", max_new_tokens=2, temperature=temperature)


@pytest.mark.parametrize("options", [dict(seed=3), dict(top_p=0.5, top_k=5), dict(temperature=0.0, seed=1)])
def test_sampling_options_with_temperature_0_decode_greedily_as_in_vllm(pipe, options):
    """A program may forward an OpenAI request's seed or top_p with temperature 0: the API decodes greedily, as vLLM
    does (dflash generate and datagen refuse them from a user's flags, tests/cli/test_generate.py)."""
    greedy = pipe.generate("hi", max_new_tokens=4).output_ids
    assert pipe.generate("hi", max_new_tokens=4, **options).output_ids == greedy
    assert "".join(pipe.stream("hi", max_new_tokens=4, **options)) == pipe.generate("hi", max_new_tokens=4).text


def test_an_empty_stop_string_is_refused(pipe):
    with pytest.raises(GenerationError, match="stop string is empty"):
        pipe.generate("hi", max_new_tokens=2, stop_strings=["x", ""])


def test_a_conversation_the_chat_template_refuses_is_a_generation_error(tiny_pair, monkeypatch):
    strict = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('No user query found') }}{% endif %}x"
    monkeypatch.setattr(strict.tokenizer, "chat_template", template)
    with pytest.raises(GenerationError, match="chat template refused these messages: No user query found"):
        strict.generate([{"role": "assistant", "content": "x"}], max_new_tokens=2)


def test_a_broken_chat_template_is_named_as_the_template_not_the_messages(tiny_pair, monkeypatch):
    broken = DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu")
    monkeypatch.setattr(broken.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(GenerationError, match=r"chat template of .* is not a valid Jinja template \(.*\); fix its "
                                              r"chat_template.jinja"):
        broken.generate("hi", max_new_tokens=2)


def test_pairs_that_cannot_be_meant_are_refused_before_loading(tiny_pair, pipe):
    target_dir, draft_dir = tiny_pair
    with pytest.raises(UserError, match="no_draft is True or False"):
        DFlash.from_pretrained(target_dir, draft_dir, no_draft="no")
    with pytest.raises(UserError, match="needs its target"):
        DFlash.from_pretrained(draft=draft_dir)  # would pair it with the embedded target
    with pytest.raises(UserError, match="needs draft="):
        DFlash.from_pretrained(target_dir)  # silently plain decoding before
    with pytest.raises(UserError, match="takes a dflash.TargetModel"):
        DFlash(str(target_dir))
    with pytest.raises(UserError, match="DFlashDraftModel"):
        DFlash(pipe.target, str(draft_dir))


@pytest.mark.parametrize("device, message", [("bogus", "unknown device"), ("meta", "holds no data"),
                                             (0, "must be a string")])
def test_a_device_this_machine_lacks_is_a_clear_error(tiny_pair, device, message):
    with pytest.raises(UserError, match=message):
        DFlash.from_pretrained(*tiny_pair, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it(tiny_pair):
    with pytest.raises(UserError, match="'cuda' is not available"):
        DFlash.from_pretrained(*tiny_pair, device="cuda")


def _copy_target(tiny_pair, tmp_path, drop=()):
    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target, ignore=shutil.ignore_patterns(*drop))
    return target


def test_a_target_without_a_tokenizer_or_that_is_a_drafter_is_refused(tiny_pair, tmp_path):
    bare = _copy_target(tiny_pair, tmp_path, drop=("tokenizer*", "special_tokens_map.json", "chat_template*"))
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        DFlash.from_pretrained(bare, no_draft=True)
    with pytest.raises(CheckpointError, match="is a DFlash drafter, not a target"):
        DFlash.from_pretrained(tiny_pair[1], no_draft=True)


@pytest.mark.parametrize("damaged", ["model.safetensors", "tokenizer.json"])
def test_a_damaged_target_file_is_named_not_a_traceback(tiny_pair, tmp_path, damaged):
    target = _copy_target(tiny_pair, tmp_path)
    (target / damaged).write_bytes((target / damaged).read_bytes()[:100])
    with pytest.raises(CheckpointError, match="damaged or incomplete"):
        DFlash.from_pretrained(target, no_draft=True, device="cpu")


def test_error_types_are_exported():
    import dflash

    assert issubclass(dflash.CheckpointError, dflash.UserError)
    assert issubclass(dflash.GenerationError, dflash.UserError)


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
    # apply_chat_template's own arguments would cut or pad the prompt unseen, or fail inside transformers
    for bad in ({"truncation": True, "max_length": 3}, {"padding": "bogus"}, {"tokenizer_kwargs": 5}):
        with pytest.raises(UserError, match=f"chat_template_kwargs may not set {', '.join(sorted(bad))}: dflash"):
            pipe.encode("hi", chat_template_kwargs=bad)
    # a call takes them as encode does, as a server request's chat_template_kwargs
    thinking_off = pipe.generate("How many clips?", max_new_tokens=4, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off.output_ids == pipe.generate(off, max_new_tokens=4).output_ids
    streamed = pipe.stream("How many clips?", max_new_tokens=4, chat_template_kwargs={"enable_thinking": False})
    assert "".join(streamed) == thinking_off.text
    assert [o.output_ids for o in quiet.generate_batch(["How many clips?"], max_new_tokens=4,
                                                       chat_template_kwargs={"enable_thinking": True})] == [
        pipe.generate(default, max_new_tokens=4).output_ids]


@pytest.mark.parametrize("which", ["DEFAULT_DRAFT", "HANDOFF_DRAFT"])
def test_both_embedded_drafters_decode_as_the_embedded_target_alone(which):
    """The shipped DFlash2 drafter, and the DFlash one the hand-off to vLLM / SGLang defaults to."""
    import dflash.api

    question = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?"
    drafted = DFlash.from_pretrained(dflash.api.DEFAULT_TARGET, getattr(dflash.api, which))
    plain = DFlash.from_pretrained(no_draft=True)
    a, b = drafted.generate(question, max_new_tokens=48), plain.generate(question, max_new_tokens=48)
    assert a.output_ids == b.output_ids and len(a.output_ids) > 8
    assert a.stats.mean_acceptance_length > 1.5  # a trained drafter: many of its tokens are accepted


def test_a_seed_whose_noise_was_extreme_at_a_position_decodes_as_the_target_alone():
    """Seed 3 put the smallest noise there was at position 74 of this prompt (token 491, probability 0 there): in
    float32 that noise was 0, the DFlash2 drafter's path search crashed, and plain decoding at top_k 1 drew the
    zero-probability token instead of the greedy one. (Since the noise takes 48 bits that draw is the largest;
    a seeded decode past it still must match.)"""
    question = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
                "many clips did Natalia sell altogether in April and May?\nPlease reason step by step, and put your "
                "final answer within \\boxed{}.")
    drafted, plain = DFlash.from_pretrained(), DFlash.from_pretrained(no_draft=True)
    assert len(drafted.encode(question)) < 74 < len(drafted.encode(question)) + 32
    sampled = drafted.generate(question, max_new_tokens=32, temperature=0.9, seed=3)
    assert sampled.output_ids == plain.generate(question, max_new_tokens=32, temperature=0.9, seed=3).output_ids
    greedy = plain.generate(question, max_new_tokens=32).output_ids
    assert plain.generate(question, max_new_tokens=32, temperature=0.9, top_k=1, seed=3).output_ids == greedy


@pytest.mark.parametrize("precision", ["auto", "bfloat16", "float32"])
def test_a_drafter_of_another_width_is_refused_naming_the_mismatch_at_every_precision(tiny_pair, precision):
    """The drafter precision's timing drafts with the target's LM head: it ran before the pair was checked, and a
    drafter of another hidden size crashed there (shapes cannot be multiplied) instead of being refused."""
    import dflash.api

    with pytest.raises(UserError, match="this drafter does not fit this target: hidden size: drafter 256"):
        DFlash.from_pretrained(tiny_pair[0], dflash.api.DEFAULT_DRAFT, drafter_precision=precision)


def test_bfloat16_products_beside_a_bfloat16_target_are_refused_naming_its_dtype(tiny_pair):
    """The refusal named an LM head that was not a plain linear layer, or other devices: neither was the case."""
    from dflash.model.loading import load_drafter
    from dflash.model.target import TargetModel

    target = TargetModel.from_pretrained(tiny_pair[0], dtype="bfloat16")
    drafter = load_drafter(tiny_pair[1], dtype="float32")
    with pytest.raises(UserError, match=r"cannot draft with bfloat16 products \(its target is in bfloat16 and the "
                                        r"drafter in float32; load the drafter in the target's dtype\)"):
        DFlash(target, drafter, drafter_precision="bfloat16")
    assert DFlash(target, load_drafter(tiny_pair[1], dtype="bfloat16"), drafter_precision="bfloat16").drafter


def test_a_drafter_reused_after_its_products_moved_to_bfloat16(tiny_pair):
    """A second pipeline on the same drafter object was refused, naming two identical devices."""
    from dflash.model.loading import load_drafter
    from dflash.model.target import TargetModel

    target, drafter = TargetModel.from_pretrained(tiny_pair[0]), load_drafter(tiny_pair[1])
    first = DFlash(target, drafter, drafter_precision="bfloat16")
    assert drafter.draft_head is not None and drafter.draft_head.dtype == torch.bfloat16
    again = DFlash(target, drafter, drafter_precision="bfloat16")  # already so: nothing to do
    assert again.generate("How many clips?", max_new_tokens=8).output_ids == \
        first.generate("How many clips?", max_new_tokens=8).output_ids
    with pytest.raises(UserError, match=r"^this drafter already multiplies in bfloat16 .* load it again for "
                                        r"float32 products$"):
        DFlash(target, drafter, drafter_precision="float32")


def test_pipelines_decode_on_several_threads_at_once(pipe):
    """Each forward captures the target's features for its own thread: concurrent calls give what each gives alone."""
    import threading

    prompts = ["How many clips?", "Weng earns $12 an hour.", "Natalia sold clips.", "Betty saves money."]
    alone = [pipe.generate(p, max_new_tokens=12).output_ids for p in prompts]
    seeded = [pipe.generate(p, max_new_tokens=12, temperature=0.8, seed=i).output_ids for i, p in enumerate(prompts)]
    results, errors = {}, []

    def decode(i):
        try:
            results[i] = (pipe.generate(prompts[i], max_new_tokens=12).output_ids,
                          pipe.generate(prompts[i], max_new_tokens=12, temperature=0.8, seed=i).output_ids)
        except Exception as err:  # noqa: BLE001 - any failure on a thread is the test's failure
            errors.append(err)

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[i] for i in range(len(prompts))] == list(zip(alone, seeded))


def test_mistakes_in_calls_name_the_argument(pipe):
    with pytest.raises(GenerationError, match="a prompt is .*, not int"):
        pipe.generate(5)
    with pytest.raises(GenerationError, match=r"generation options are keywords: generate\(prompt, max_new_tokens"):
        pipe.generate("hi", {"max_new_tokens": 4})
    with pytest.raises(GenerationError, match=r"prompt 2: prompt token ids \[99999\] are outside the vocabulary"):
        pipe.generate_batch(["a", "b", [99999]], max_new_tokens=2)
    with pytest.raises(GenerationError, match="prompt 1: the prompt is empty"):
        pipe.generate_batch(["a", []], max_new_tokens=2)
    with pytest.raises(GenerationError, match=r"stop_token_ids \[99999\] are outside the vocabulary"):
        pipe.generate("hi", max_new_tokens=2, stop_token_ids=[99999])
    for seed in (2**64, -(2**63) - 1):  # beyond torch's range a seed would wrap onto another
        with pytest.raises(GenerationError, match=r"seed must be in \[-2\*\*63, 2\*\*64\)"):
            pipe.generate("hi", max_new_tokens=2, temperature=0.7, seed=seed)


def test_a_block_size_below_two_is_refused_before_the_models_load(tiny_pair, monkeypatch):
    import dflash.api

    monkeypatch.setattr(dflash.api, "load_target", lambda *a, **k: pytest.fail("loaded the target first"))
    for block_size in (0, 1, -3):
        with pytest.raises(GenerationError, match="block_size is at least 2"):
            DFlash.from_pretrained(*tiny_pair, block_size=block_size)


def test_the_target_adapter_refuses_what_the_pipeline_refuses(tiny_pair):
    from dflash.model import TargetModel

    with pytest.raises(CheckpointError, match="is a DFlash drafter, not a target model"):
        TargetModel.from_pretrained(tiny_pair[1])
    with pytest.raises(UserError, match="unknown device 'gpu'"):
        TargetModel.from_pretrained(tiny_pair[0], device="gpu")


def test_options_that_shape_drafting_are_refused_without_a_drafter_and_empty_paths_are_named(tiny_pair):
    with pytest.raises(UserError, match=r"block_size \(--block-size\), branch_length \(--branch-length\) shape "
                                        r"drafting, and no_draft \(--no-draft\)"):
        DFlash.from_pretrained(tiny_pair[0], no_draft=True, block_size=4, branch_length=2)
    with pytest.raises(UserError, match=r"mask_token_id \(--mask-token-id\) shapes drafting"):
        DFlash.from_pretrained(tiny_pair[0], no_draft=True, mask_token_id=3)
    with pytest.raises(UserError, match="target is an empty path"):
        DFlash.from_pretrained("", no_draft=True)


def test_a_trainer_takes_a_checked_config():
    from dflash.training import Trainer

    with pytest.raises(UserError, match=r"Trainer takes a TrainConfig, not dict: Trainer\(load_config"):
        Trainer({"data": "x"})


def test_a_drafter_trained_for_another_local_target_is_a_warning(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    other = tmp_path / "other-target"
    shutil.copytree(target, other)  # the same shape: nothing else would tell them apart
    recorded = tmp_path / "drafter"
    shutil.copytree(draft, recorded)
    (recorded / "training_config.yaml").write_text(f"target: {other}\nblock_size: 8\n")
    with pytest.warns(DFlashWarning, match=f"the drafter in {recorded} was trained for the target in {other} .*not "
                                           f"{target}: the output stays the target's own"):
        DFlash.from_pretrained(target, recorded, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DFlashWarning)
        DFlash.from_pretrained(other, recorded, device="cpu")  # its own target: no warning
        (recorded / "training_config.yaml").write_text("target: some-org/some-model\n")
        DFlash.from_pretrained(target, recorded, device="cpu")  # a hub id: nothing to compare here
    from dflash.cli.main import main

    (recorded / "training_config.yaml").write_text(f"target: {other}\n")
    assert main(["generate", "--target", str(target), "--draft", str(recorded), "--prompt", "hi",
                 "--max-new-tokens", "2"]) == 0
    assert f"dflash generate: warning: the drafter in {recorded} was trained for" in capsys.readouterr().err


def test_a_drafter_trained_in_another_thinking_mode_is_a_warning(tiny_pair, tmp_path, capsys):
    target, recorded = tmp_path / "target", tmp_path / "drafter"
    shutil.copytree(tiny_pair[0], target)
    shutil.copytree(tiny_pair[1], recorded)
    (target / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    (recorded / "training_config.yaml").write_text("enable_thinking: false\n")
    with pytest.warns(DFlashWarning, match=f"the drafter in {recorded} was trained on prompts rendered with "
                                           "enable_thinking false .*, and prompts here render with the chat template's "
                                           "defaults: .*pass --no-enable-thinking"):
        DFlash.from_pretrained(target, recorded, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DFlashWarning)
        DFlash.from_pretrained(target, recorded, device="cpu", chat_template_kwargs={"enable_thinking": False})
        DFlash.from_pretrained(tiny_pair[0], recorded, device="cpu")  # a template without the switch renders alike
    from dflash.cli.main import main

    assert main(["generate", "--target", str(target), "--draft", str(recorded), "--prompt", "hi",
                 "--max-new-tokens", "2", "--enable-thinking"]) == 0
    assert "dflash generate: warning: the drafter in" in capsys.readouterr().err
    assert main(["generate", "--target", str(target), "--draft", str(recorded), "--prompt", "hi",
                 "--max-new-tokens", "2", "--no-enable-thinking"]) == 0
    assert "warning" not in capsys.readouterr().err
    # trained with the template's defaults (an export since 2026-12-07 says so with its chat_template_kwargs key)
    (recorded / "training_config.yaml").write_text("enable_thinking: null\nchat_template_kwargs: null\n")
    with pytest.warns(DFlashWarning, match="rendered with the chat template's defaults .*, and prompts here render "
                                           "with enable_thinking false: .*leave --enable-thinking and "
                                           "--chat-template-kwargs out"):
        DFlash.from_pretrained(target, recorded, device="cpu", chat_template_kwargs={"enable_thinking": False})
    (recorded / "training_config.yaml").write_text("enable_thinking: null\n")  # an older export: nothing known
    with warnings.catch_warnings():
        warnings.simplefilter("error", DFlashWarning)
        DFlash.from_pretrained(target, recorded, device="cpu", chat_template_kwargs={"enable_thinking": False})


def test_thinking_asked_of_a_template_that_does_not_read_it_is_said_to_change_nothing(tiny_pair, tmp_path):
    with pytest.warns(DFlashWarning, match="renders a conversation the same with enable_thinking true or false"):
        DFlash.from_pretrained(tiny_pair[0], tiny_pair[1], device="cpu", chat_template_kwargs={"enable_thinking": True})
    with warnings.catch_warnings():  # off is what a template without the switch does: nothing to say
        warnings.simplefilter("error", DFlashWarning)
        DFlash.from_pretrained(tiny_pair[0], no_draft=True, device="cpu",
                               chat_template_kwargs={"enable_thinking": False})
    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    (target / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DFlashWarning)
        DFlash.from_pretrained(target, no_draft=True, device="cpu", chat_template_kwargs={"enable_thinking": True})


def test_a_prompt_beyond_the_context_is_said_once_by_dflash_not_by_the_tokenizer(tiny_pair, caplog):
    """transformers' tokenizer warned of "indexing errors" at its own model_max_length before DFlash measured the
    prompt against the target's context and said what to do."""
    from transformers.utils import logging as hf_logging

    pipe = DFlash.from_pretrained(*tiny_pair, device="cpu")
    pipe.tokenizer.model_max_length = 8
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            for prompt, raw in (("How many clips did Natalia sell in April and May?", False),
                                ("How many clips did Natalia sell in April and May?", True),
                                ([{"role": "user", "content": "How many clips did Natalia sell?"}], False)):
                assert len(pipe.encode(prompt, raw)) > 8
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "sequence length" in r.getMessage()]


def test_dtype_names_float64_as_the_torch_dtype_is_taken(tiny_pair):
    pipe = DFlash.from_pretrained(*tiny_pair, device="cpu", dtype="float64")
    assert pipe.target.model.dtype == torch.float64
    with pytest.raises(CheckpointError, match="unknown dtype 'float8'; use auto .*, float32, float16, bfloat16 or "
                                              "float64"):
        DFlash.from_pretrained(*tiny_pair, device="cpu", dtype="float8")
    with pytest.raises(CheckpointError, match="dtype torch.float8_e4m3fn cannot hold a model's weights here; use "
                                              "auto"):  # a floating type: it had reached transformers' own error
        DFlash.from_pretrained(*tiny_pair, device="cpu", dtype=torch.float8_e4m3fn)


def test_a_loaded_model_a_non_float_dtype_and_stop_strings_without_a_tokenizer_are_named(tiny_pair):
    """Each was a wall of text or a ValueError from deep inside before: the module's whole printed tree, a
    CheckpointError blaming the checkpoint for dtype=torch.int8, a bare ValueError from the stop checker."""
    from transformers import AutoModelForCausalLM

    from dflash.model import TargetModel

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0])
    for args in ((model, tiny_pair[1]), (tiny_pair[0], model)):
        with pytest.raises(CheckpointError, match="not a loaded Qwen3ForCausalLM; wrap a loaded model instead: "
                                                  r"DFlash\(TargetModel\(model, tokenizer\)") as err:
            DFlash.from_pretrained(*args, device="cpu")
        assert len(str(err.value)) < 300
    with pytest.raises(CheckpointError, match="dtype torch.int8 cannot hold a model's weights here; use auto"):
        DFlash.from_pretrained(*tiny_pair, dtype=torch.int8, device="cpu")
    bare = DFlash(TargetModel(model))
    with pytest.raises(GenerationError, match="this target has no tokenizer to decode it: give it one"):
        bare.generate([5, 6, 7], max_new_tokens=3, stop_strings=["a"])
    with pytest.raises(GenerationError, match=r"stream\(\) yields text, and this target has no tokenizer"):
        bare.stream([5, 6, 7], max_new_tokens=3)  # it was an AttributeError from the detokenizer
    assert len(bare.generate([5, 6, 7], max_new_tokens=3).output_ids) == 3


def test_a_block_size_of_none_in_a_call_is_the_pipelines_own(tiny_pair):
    """None in a call meant the pipeline's fixed block size, but turned a pipeline's "auto" off."""
    fixed = DFlash.from_pretrained(*tiny_pair, device="cpu", block_size=4)
    assert max(fixed.generate("How many clips?", max_new_tokens=12, block_size=None).stats.block_sizes) == 4
    auto = DFlash.from_pretrained(*tiny_pair, device="cpu", block_size="auto")
    assert auto._config({"block_size": None}).block_size == auto._config({}).block_size == "auto"
    assert auto._config({"block_size": 3}).block_size == 3


def test_the_stop_token_that_ends_an_answer_adds_no_text(pipe):
    """As vLLM (include_stop_str_in_output off): the ids keep the stop token, the text leaves it out, streamed
    or not."""
    free = pipe.generate("Weng earns", max_new_tokens=20, ignore_eos=True).output_ids
    stop = next(t for t in free[3:] if pipe.tokenizer.decode([t]).strip())
    end = free.index(stop)
    out = pipe.generate("Weng earns", max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    assert out.output_ids == free[: end + 1] and out.finish_reason == "stop"
    assert out.text == pipe.tokenizer.decode(free[:end], skip_special_tokens=True)
    stream = pipe.stream("Weng earns", max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    assert "".join(stream) == stream.result.text == out.text


def test_a_mistyped_drafter_is_named_before_the_target_loads(tiny_pair, tmp_path, monkeypatch):
    """With an 8B target, a typo in the drafter's path showed only after the whole target had loaded."""
    from dflash.model import TargetModel

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the drafter's path was checked")

    monkeypatch.setattr(TargetModel, "from_pretrained", no_loading)
    with pytest.raises(CheckpointError, match="drafterr"):
        DFlash.from_pretrained(tiny_pair[0], tmp_path / "drafterr", device="cpu")


def test_bfloat16_drafter_precision_is_refused_for_a_draft_model_it_would_not_change(draft_model_pair):
    """A draft model runs in its own dtype: the option was taken and did nothing."""
    with pytest.raises(UserError, match="this drafter is a draft model .* load it in bfloat16 \\(dtype\\) instead"):
        DFlash.from_pretrained(*draft_model_pair, drafter_precision="bfloat16")
    assert DFlash.from_pretrained(*draft_model_pair, drafter_precision="float32").drafter is not None


class _CountedSeeds(torch.Generator):
    """A generator whose `seed()` (an unseeded row's fresh seed) takes the next of 0, 1, 2, ...: a test that counts
    unseeded draws then draws the same ones every run."""

    drawn = 0

    def seed(self) -> int:
        _CountedSeeds.drawn += 1
        self.manual_seed(_CountedSeeds.drawn)
        return _CountedSeeds.drawn


def test_unseeded_sampling_with_the_trained_pair_follows_the_target_where_drafts_are_accepted(monkeypatch):
    """Rejection sampling end to end with DFlash2's sampled path and a drafter the target agrees with often (the
    engine tests' random drafters are turned down at nearly every step): after a cut of the target's greedy answer
    before two unsure positions, the first three tokens of many unseeded generations (the prefill's, then one step's
    accepted draft tokens and its recovered or bonus token) are counted against the target's own probabilities."""
    from conftest import check_triples_follow_the_target
    from dflash.decoding import GenerationConfig
    from dflash.decoding.sampling import SamplingParams

    monkeypatch.setattr(torch, "Generator", _CountedSeeds)
    monkeypatch.setattr(_CountedSeeds, "drawn", 0)
    pipe = DFlash.from_pretrained()
    engine, model = pipe.engine, pipe.engine.target.model
    prompt = pipe.encode("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                         "How much did she earn?\nPlease reason step by step, and put your final answer within "
                         "\\boxed{}.")
    answer = engine.generate([prompt], GenerationConfig(max_new_tokens=60))[0].output_ids
    with torch.no_grad():  # the target's surest probability at each answer position
        sure = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].softmax(-1).max(-1).values
    # a sure first token (the prefill's), then two unsure ones (the step's): its draft tokens are judged there
    cut = min(range(len(answer) - 3), key=lambda i: float(sure[i + 1] + sure[i + 2] - sure[i]))
    prompt = prompt + answer[:cut]
    params = SamplingParams(temperature=1.0, top_k=3)
    config = GenerationConfig(max_new_tokens=3, temperature=1.0, top_k=3, ignore_eos=True, block_size=16)
    draws, counts, accepted = 1000, {}, 0
    for _ in range(draws // 500):
        for out in engine.generate([prompt] * 500, config):
            counts[tuple(out.output_ids)] = counts.get(tuple(out.output_ids), 0) + 1
            accepted += out.stats.acceptance_lengths[1] > 1
    assert accepted > draws / 5  # the drafter's tokens were accepted, not only recovered
    assert _CountedSeeds.drawn >= draws  # every row drew from a counted seed: the same draws every run
    check_triples_follow_the_target(model, params, prompt, counts, min_cells=4)

import io
import json
import os
import re
import threading

import pytest
import torch

from dflash.cli import generate
from dflash.cli.main import build_parser, main
from dflash.errors import GenerationError


def test_json_output_has_the_documented_fields(tiny_pair, capsys):
    target, draft = tiny_pair
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "How many clips?",
                 "--max-new-tokens", "12", "--json", "--compare"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("text", "output_ids", "num_output_tokens", "acceptance_lengths", "mean_acceptance_length",
                "time_to_first_token_s", "decode_tokens_per_s"):
        assert key in report
    assert sum(report["acceptance_lengths"]) == report["num_output_tokens"] == len(report["output_ids"])
    assert report["matches_baseline"] is True and report["stop_string"] is None
    stop = report["text"][3:5]
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "How many clips?",
                 "--max-new-tokens", "12", "--json", "--stop", stop]) == 0
    assert json.loads(capsys.readouterr().out)["stop_string"] == stop


def test_streaming_output_ends_with_a_stats_line(tiny_pair, capsys):
    target, draft = tiny_pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Weng earns",
                 "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "acceptance length" in captured.err


def test_user_errors_are_one_line(tiny_pair, capsys):
    target, draft = tiny_pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x",
                 "--block-size", "99"]) == 2
    assert "--block-size 99 is not usable with this drafter" in capsys.readouterr().err
    assert main(["generate", "--target", str(target), "--no-draft", "--prompt", "x", "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--draft", str(draft), "--prompt", "x"]) == 2
    assert "--draft needs --target" in capsys.readouterr().err
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "  "]) == 2
    assert "--prompt is empty" in capsys.readouterr().err
    assert main(["generate", "--target", str(target), "--no-draft", "--compare", "--prompt", "x"]) == 2
    assert "drop --no-draft" in capsys.readouterr().err


def test_block_size_is_auto_by_default_and_named_sizes_work(tiny_pair, capsys):
    target, draft = tiny_pair
    for extra in ([], ["--block-size", "auto"], ["--block-size", "4"]):
        assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "How many clips?",
                     "--max-new-tokens", "10", "--json", "--compare", *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["matches_baseline"] is True
        assert len(report["block_sizes"]) == len(report["acceptance_lengths"]) - 1
        assert all(n <= b for n, b in zip(report["acceptance_lengths"][1:], report["block_sizes"]))
        if extra[-1:] == ["4"]:
            assert max(report["acceptance_lengths"]) <= 4 and max(report["block_sizes"]) == 4
    with pytest.raises(SystemExit) as exit_info:  # argparse: usage and the reason, status 2
        main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--block-size", "big"])
    assert exit_info.value.code == 2
    assert "a block size (a number) or 'auto', got 'big'" in capsys.readouterr().err


def test_branch_length_verifies_more_tokens_per_step_and_changes_no_text(tiny_pair, capsys):
    target, draft = tiny_pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "How many clips?",
                 "--max-new-tokens", "12", "--json", "--compare", "--block-size", "4", "--branch-length", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["matches_baseline"] is True and max(report["block_sizes"]) > 4


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_enable_thinking_flag(command):
    from dflash.cli.common import chat_template_kwargs
    from dflash.cli.main import build_parser

    extra = ["--prompt", "x"] if command == "generate" else []
    parse = build_parser().parse_args
    assert chat_template_kwargs(parse([command, *extra])) is None  # the template's own default
    assert chat_template_kwargs(parse([command, *extra, "--no-enable-thinking"])) == {"enable_thinking": False}
    assert chat_template_kwargs(parse([command, *extra, "--enable-thinking"])) == {"enable_thinking": True}
    both = parse([command, *extra, "--chat-template-kwargs", '{"reasoning_effort": "low"}', "--enable-thinking"])
    assert chat_template_kwargs(both) == {"reasoning_effort": "low", "enable_thinking": True}


def _args(tiny_pair, *extra) -> list[str]:
    return ["generate", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), *extra]


def test_a_second_prompt_is_refused_not_silently_used(tiny_pair, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_args(tiny_pair, "--prompt", "first", "--prompt", "second"))
    assert exit_info.value.code == 2
    assert "--prompt: given more than once" in capsys.readouterr().err


def test_stop_strings_read_escapes_as_the_readme_writes_them(capsys):
    args = build_parser().parse_args(["generate", "--prompt", "x", "--stop", r"\n\n", "--stop", r"a\tb\\n"])
    assert args.stop == ["\n\n", "a\tb\\n"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--stop", ""])
    assert "a stop string cannot be empty" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--temperature", "1e39"], "at most 100"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--seed", "3", "--top-k", "3"], "--top-k, --seed shape sampling, and --temperature 0 (the default) decodes "
                                      "greedily: pass a --temperature above 0, e.g. --temperature=0.7, or leave them "
                                      "out"),
    (["--seed", "3"], "--seed shapes sampling, and --temperature 0 (the default) decodes greedily: pass a "
                      "--temperature above 0, e.g. --temperature=0.7, or leave it out"),
    (["--block-size", "4", "--mask-token-id", "3"], "block_size (--block-size), mask_token_id (--mask-token-id) "
                                                    "shape drafting, and no_draft (--no-draft) decodes with the "
                                                    "target alone"),
    (["--branch-length", "2"], "branch_length (--branch-length) shapes drafting, and no_draft (--no-draft)"),
    (["--drafter-precision", "bfloat16"], "drafter_precision (--drafter-precision) shapes drafting, and no_draft "
                                          "(--no-draft)"),  # it was taken and did nothing
    (["--stop", "caf\udce9"], "--stop is not valid text"),  # it could never be met
    (["--raw", "--enable-thinking"], "drop one of them"),
    (["--raw", "--chat-template-kwargs", '{"x": 1}'], "drop one of them"),
    (["--chat-template-kwargs", '{"enable_thinking": true}', "--no-enable-thinking"],
     "--no-enable-thinking and --chat-template-kwargs enable_thinking true disagree: give it once"),
    (["--chat-template-kwargs", '{"tokenize": true}'], "chat_template_kwargs may not set tokenize"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--min-p", "0.1"], "--min-p shapes sampling, and --temperature 0"),  # greedy: it would change nothing
    (["--min-p", "2", "--temperature", "1"], "--min-p must be in [0, 1] (0 = off), got 2.0"),
    (["--device", "bogus"], "unknown device 'bogus'"),
    (["--system", ""], "--system is empty; give the system message, or leave the flag out"),  # "the text to decode"
])
def test_bad_options_are_refused_before_any_model_loads(flags, message, capsys):
    """The target does not exist: the option is named first, without waiting for a model to load."""
    assert main(["generate", "--target", "/nonexistent/target", "--no-draft", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_prompt_that_is_not_utf8_and_a_target_without_a_drafter(tiny_pair, capsys):
    assert main(_args(tiny_pair, "--prompt", "caf\udce9")) == 2  # what Python makes of a Latin-1 byte in argv
    assert "--prompt is not valid text" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_pair[0]), "--prompt", "x"]) == 2  # was: plain decoding
    assert "--target needs --draft" in capsys.readouterr().err


def test_a_prompt_and_answer_beyond_the_context_say_how_many_tokens_fit(tiny_pair, capsys):
    """Before: the engine's sum, which the warm-up's 2 tokens replaced the asked-for number in."""
    assert main(_args(tiny_pair, "--prompt", "How many clips?", "--max-new-tokens", "5000")) == 2
    err = capsys.readouterr().err
    assert re.search(r"leaves room for at most \d+ new tokens in the target's context of 1024 .*--max-new-tokens", err)
    assert main(_args(tiny_pair, "--prompt", "Natalia sold clips " * 400)) == 2
    assert "leaves no room for an answer in the target's context of 1024 tokens" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(tiny_pair, capsys):
    assert main(_args(tiny_pair, "--prompt", "x", "--device", "cuda")) == 2
    assert "'cuda' is not available" in capsys.readouterr().err


def test_one_token_has_no_decode_step_to_measure(tiny_pair, capsys):
    assert main(_args(tiny_pair, "--prompt", "How many clips?", "--max-new-tokens", "1", "--compare")) == 0
    err = capsys.readouterr().err
    assert "[1 token | no decode step to measure |" in err and "0.00x" not in err
    assert main(_args(tiny_pair, "--prompt", "How many clips?", "--max-new-tokens", "1", "--compare", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speedup"] is None and report["matches_baseline"] is True


class _Interrupted:
    """A stream that yields one piece, then the user presses Ctrl-C."""

    result = None

    def __iter__(self):
        yield "The answer"
        raise KeyboardInterrupt


def test_ctrl_c_while_streaming_ends_the_line(tiny_pair, capsys, monkeypatch):
    from dflash.api import DFlash

    monkeypatch.setattr(DFlash, "stream", lambda self, *args, **kwargs: _Interrupted())
    assert main(_args(tiny_pair, "--prompt", "x", "--max-new-tokens", "4")) == 130
    captured = capsys.readouterr()
    assert captured.out == "The answer\n" and captured.err.strip() == "dflash generate: interrupted"


def test_ctrl_c_during_the_plain_decode_still_reports_dflash(tiny_pair, capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "compare_with_plain", interrupted)
    assert main(_args(tiny_pair, "--prompt", "x", "--max-new-tokens", "4", "--compare")) == 130
    err = capsys.readouterr().err
    assert "acceptance length" in err and err.strip().endswith("dflash generate: interrupted")


def test_a_closed_output_pipe_stops_quietly(tiny_pair, capsys, monkeypatch):
    def closed_pipe(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(generate, "run", closed_pipe)
    assert main(_args(tiny_pair, "--prompt", "x")) == 141
    assert capsys.readouterr().err == ""


def test_every_option_says_what_it_does():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["generate"]
    undocumented = [a.option_strings[0] for a in sub._actions if a.option_strings and not a.help]
    assert undocumented == []


def test_stats_line_reads_well():
    report = {"num_output_tokens": 40, "acceptance_lengths": [1, 4, 3], "mean_acceptance_length": 3.5,
              "decode_tokens_per_s": 378.4, "time_to_first_token_s": 0.008, "baseline_decode_tokens_per_s": 256.5,
              "fastest_decode_tokens_per_s": 391.0, "compare_rounds": 3, "speedup": 1.52, "matches_baseline": True}
    assert generate.stats_line(report) == ("[40 tokens | acceptance length 3.50 | 378.4 tok/s | TTFT 8 ms | fastest "
                                           "of 3: 391.0 tok/s, plain decoding 256.5 tok/s -> 1.52x, identical output]")


def test_compare_of_a_sample_without_a_seed_says_it_cannot_compare(tiny_pair, capsys):
    """Two unseeded samples differ whatever decodes them: --compare printed OUTPUT DIFFERS, which read as a
    losslessness failure."""
    base = _args(tiny_pair, "--prompt", "How many clips?", "--max-new-tokens", "12", "--json", "--compare",
                 "--temperature", "0.9")
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out)["matches_baseline"] is None
    assert main([*base, "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["matches_baseline"] is True  # seeded: the target's own sample
    report = {"num_output_tokens": 12, "acceptance_lengths": [1, 4], "mean_acceptance_length": 4.0,
              "decode_tokens_per_s": 300.0, "time_to_first_token_s": 0.008, "baseline_decode_tokens_per_s": 200.0,
              "fastest_decode_tokens_per_s": 300.0, "compare_rounds": 3, "speedup": 1.5, "matches_baseline": None}
    assert generate.stats_line(report).endswith("1.50x, output not compared (sampled without --seed; add one to "
                                                "compare)]")


def test_compare_takes_turns_and_counts_each_sides_fastest_run(tiny_pair, capsys, monkeypatch):
    """A plain decode caught by other work once read as a 37x speedup: plain decoding and DFlash decode in turns,
    and the report (and the speedup) takes each side's fastest run, so one slow run cannot fake a speedup."""
    from dflash.decoding.engine import SpeculativeEngine

    runs = []  # (drafting?, decode tokens/s) of every timed run, in order
    real_generate = SpeculativeEngine.generate

    def generate_with_a_slow_first_plain_run(engine, prompts, config=None):
        outs = real_generate(engine, prompts, config)
        if config.max_new_tokens > 2:  # not a warm-up
            drafting = engine.proposer.kind != "none"
            if not drafting and not any(not d for d, _ in runs):
                outs[0].stats.decode_time_s *= 20  # the burst
            runs.append((drafting, outs[0].stats.decode_tokens_per_s))
        return outs

    monkeypatch.setattr(SpeculativeEngine, "generate", generate_with_a_slow_first_plain_run)
    assert main(_args(tiny_pair, "--prompt", "How many clips?", "--max-new-tokens", "12", "--json", "--compare")) == 0
    report = json.loads(capsys.readouterr().out)
    assert [d for d, _ in runs] == [True, False] * generate.COMPARE_ROUNDS  # the streamed or JSON run first
    plain = [speed for d, speed in runs if not d]
    ours = [speed for d, speed in runs if d]
    assert report["compare_rounds"] == generate.COMPARE_ROUNDS
    assert report["baseline_decode_tokens_per_s"] == round(max(plain), 2) > 5 * plain[0]
    assert report["fastest_decode_tokens_per_s"] == round(max(ours), 2)
    assert report["speedup"] == round(max(ours) / max(plain), 2)
    assert report["matches_baseline"] is True


def _json_text(capsys) -> str:
    return json.loads(capsys.readouterr().out)["text"]


def test_the_prompt_can_come_from_standard_input_or_a_file(tiny_pair, capsys, monkeypatch, tmp_path):
    text = "How many clips did Natalia sell?\nSay it twice."
    assert main(_args(tiny_pair, "--prompt", text, "--max-new-tokens", "6", "--json")) == 0
    expected = _json_text(capsys)
    monkeypatch.setattr("sys.stdin", io.StringIO(text + "\n"))  # echo's line break
    assert main(_args(tiny_pair, "--prompt", "-", "--max-new-tokens", "6", "--json")) == 0
    assert _json_text(capsys) == expected
    (tmp_path / "prompt.txt").write_text(text + "\n", encoding="utf-8")  # an editor's
    assert main(_args(tiny_pair, "--prompt-file", str(tmp_path / "prompt.txt"), "--max-new-tokens", "6", "--json")) == 0
    assert _json_text(capsys) == expected
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())  # the byte order mark Notepad writes
    assert main(_args(tiny_pair, "--prompt-file", str(tmp_path / "bom.txt"), "--max-new-tokens", "6", "--json")) == 0
    assert _json_text(capsys) == expected
    pipe = tmp_path / "pipe"  # a shell's <(echo ...), or /dev/stdin: "does not exist", it said
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_text(text + "\n"))
    writer.start()
    assert main(_args(tiny_pair, "--prompt-file", str(pipe), "--max-new-tokens", "6", "--json")) == 0
    writer.join()
    assert _json_text(capsys) == expected


def test_a_branch_for_sampling_without_a_seed_is_refused_not_ignored(tiny_pair, capsys):
    assert main(_args(tiny_pair, "--prompt", "Hi", "--branch-length", "2", "--temperature", "0.7")) == 2
    assert "--branch-length verifies a branch in greedy or seeded decoding" in capsys.readouterr().err
    assert main(_args(tiny_pair, "--prompt", "Hi", "--branch-length", "2", "--temperature", "0.7", "--seed", "1",
                      "--max-new-tokens", "4")) == 0


def test_prompt_files_that_cannot_be_read_are_named(tiny_pair, capsys, monkeypatch, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("  \n")
    for path, message in ((tmp_path / "nope.txt", "does not exist"), (tmp_path, "is a directory"),
                          (tmp_path / "latin1.txt", "is not UTF-8 text (byte 3); save it as UTF-8"),
                          (tmp_path / "blank.txt", "--prompt-file is empty")):
        assert main(_args(tiny_pair, "--prompt-file", str(path))) == 2
        assert message in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(_args(tiny_pair, "--prompt", "-")) == 2
    assert "--prompt (standard input) is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_args(tiny_pair, "--prompt", "x", "--prompt-file", str(tmp_path / "blank.txt")))
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_system_message_goes_before_the_prompt_through_the_chat_template(tiny_pair, capsys, monkeypatch):
    from dflash.api import DFlash

    encoded = []
    real_encode = DFlash.encode
    monkeypatch.setattr(DFlash, "encode", lambda self, prompt, *args, **kw: encoded.append(prompt) or real_encode(
        self, prompt, *args, **kw))
    assert main(_args(tiny_pair, "--prompt", "How many?", "--system", "Be brief.", "--max-new-tokens", "2")) == 0
    assert encoded[0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many?"}]
    capsys.readouterr()
    assert main(_args(tiny_pair, "--prompt", "How many?", "--system", "Be brief.", "--raw")) == 2
    assert "--system adds a message for the chat template, and --raw" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--system", "Be brief."], ["--enable-thinking"]])
def test_chat_template_flags_for_a_base_model_are_refused_not_ignored(tiny_pair, tmp_path, capsys, flag):
    """(--no-enable-thinking is taken: a base model does not think, which is what it asks for.)"""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_pair[0], base)
    config = base / "tokenizer_config.json"
    config.write_text(re.sub(r'"chat_template": "(?:[^"\\]|\\.)*",?', "", config.read_text()))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    args = ["generate", "--target", str(base), "--no-draft", "--prompt", "How many?", "--max-new-tokens", "2"]
    assert main([*args, *flag]) == 2
    assert "chat template" in capsys.readouterr().err
    assert main([*args, "--no-enable-thinking"]) == 0


def test_a_prompt_files_or_the_inputs_one_final_line_break_is_dropped(tmp_path, monkeypatch):
    import argparse

    from dflash.cli.generate import read_prompt

    for written, read in (("x\n", "x"), ("x\r\n", "x"), ("x\n\n", "x\n"), ("x", "x"), ("a\nb\n", "a\nb")):
        (tmp_path / "p.txt").write_bytes(written.encode())
        assert read_prompt(argparse.Namespace(prompt_file=str(tmp_path / "p.txt"), prompt=None)) == read
        monkeypatch.setattr("sys.stdin", io.StringIO(written))
        assert read_prompt(argparse.Namespace(prompt_file=None, prompt="-")) == read.replace("\r", "")
    assert read_prompt(argparse.Namespace(prompt_file=None, prompt="x\n")) == "x\n"  # --prompt TEXT is as given


def test_a_block_size_beyond_the_drafters_names_the_flag_and_one_token_of_room_is_one_token(tiny_pair, capsys):
    assert main(_args(tiny_pair, "--prompt", "x", "--block-size", "17")) == 2
    assert "error: --block-size 17 is not usable with this drafter: choose 2.." in capsys.readouterr().err
    from dflash.api import DFlash

    pipe = DFlash.from_pretrained(*tiny_pair)
    with pytest.raises(GenerationError, match=r"leaves room for at most 1 new token, not max_new_tokens=2"):
        pipe.generate([3] * 1023, max_new_tokens=2)


def test_standard_output_closed_is_one_line_not_a_traceback(tiny_pair):
    """`dflash generate ... >&-` ended in AttributeError: 'NoneType' object has no attribute 'write'."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dflash.cli.main", *_args(tiny_pair, "--prompt", "x")],
                          stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "standard output is closed, so there is nowhere to write the results" in proc.stderr


def test_chat_template_kwargs_that_are_not_a_json_object_say_how_to_write_them(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["generate", "--prompt", "x", "--chat-template-kwargs", "[1]"])
    assert exit.value.code == 2
    assert ("argument --chat-template-kwargs: '[1]' is not a JSON object; write it like '{\"enable_thinking\": "
            "false}'") in capsys.readouterr().err


def test_the_prompt_may_be_the_one_positional_argument(tiny_pair, capsys):
    """`dflash generate "What is 7 * 8?"` was refused as a stray argument, with a message that did not say so."""
    flags = ["--max-new-tokens", "8", "--json"]
    assert main(_args(tiny_pair, "--prompt", "How many clips?", *flags)) == 0
    flagged = json.loads(capsys.readouterr().out)["output_ids"]
    assert main(_args(tiny_pair, "How many clips?", *flags)) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] == flagged
    with pytest.raises(SystemExit):
        main(_args(tiny_pair, "How", "many", "clips?"))
    assert ('unrecognized arguments: many clips? (a prompt of several words goes in quotes: dflash generate "What is '
            '7 * 8?")') in capsys.readouterr().err
    for extra, message in [(["--prompt", "x", "4"], "the prompt was given as --prompt and PROMPT; give it once"),
                           (["--prompt-file", "f", "x"], "the prompt was given as --prompt-file and PROMPT"),
                           ([], "no prompt: give it as PROMPT"), ([""], "PROMPT is empty")]:
        assert main(_args(tiny_pair, *extra)) == 2
        assert message in capsys.readouterr().err


def test_penalties_and_structure_flags(tiny_pair, tmp_path, capsys):
    """--presence-penalty, --frequency-penalty, --repetition-penalty, --json-schema and --regex reach the decode;
    a bad value is a one-line error naming the flag."""
    from conftest import byte_fallback_tokenizer, save_tiny_pair

    target, draft = tiny_pair
    assert main(["generate", "--target", str(target), "--no-draft", "--prompt", "x", "--presence-penalty", "3"]) == 2
    assert "--presence-penalty must be a number from -2 to 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: usage and the reason, status 2
        main(["generate", "--target", str(target), "--no-draft", "--prompt", "x", "--json-schema", "{bad"])
    assert "the text is not JSON" in capsys.readouterr().err
    assert main(["generate", "--target", str(target), "--no-draft", "--prompt", "x", "--regex", "a+"]) == 2
    assert "llguidance cannot read this tokenizer" in capsys.readouterr().err  # a Metaspace decoder
    plain = ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "12 apples", "--json",
             "--max-new-tokens", "12"]
    assert main(plain) == 0
    unpenalized = json.loads(capsys.readouterr().out)["output_ids"]
    assert main(plain + ["--repetition-penalty", "3", "--frequency-penalty", "2", "--compare"]) == 0
    penalized = json.loads(capsys.readouterr().out)
    assert penalized["output_ids"] != unpenalized and penalized["matches_baseline"] is True
    byte_target, byte_draft = save_tiny_pair(tmp_path, tokenizer=byte_fallback_tokenizer())
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"enum": ["yes", "no"]}))
    for flags, answers in ((["--regex", "(April|May) [0-9]"], None),
                           (["--json-schema", str(schema)], ('"yes"', '"no"'))):
        assert main(["generate", "--target", str(byte_target), "--draft", str(byte_draft), "--raw", "--prompt",
                     "12 apples", "--json", "--max-new-tokens", "12", *flags]) == 0
        text = json.loads(capsys.readouterr().out)["text"]
        assert text in answers if answers else re.fullmatch("(April|May) [0-9]", text), text


def test_min_new_tokens_flag(tiny_pair, capsys):
    """--min-new-tokens holds the stop back (here a stop string the answer's first tokens hold), through the warm-up
    and --compare's plain decode; past --max-new-tokens it is a one-line error naming both flags."""
    target, draft = tiny_pair
    plain = ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "12 apples", "--json", "--raw",
             "--max-new-tokens", "12"]
    assert main(plain) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert len(text) >= 3, text  # the test's premise
    assert main(plain + ["--stop", text[1:3]]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == text[:1]
    assert main(plain + ["--stop", text[1:3], "--min-new-tokens", "12", "--compare"]) == 0
    held = json.loads(capsys.readouterr().out)
    assert held["text"].startswith(text[:3]) and held["matches_baseline"] is True
    assert main(plain + ["--min-new-tokens", "13"]) == 2
    assert "--min-new-tokens must be from 0 to --max-new-tokens (12)" in capsys.readouterr().err

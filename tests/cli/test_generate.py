import json

import pytest

from dflash.cli.main import main


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
    assert report["matches_baseline"] is True


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
    assert "block size 99" in capsys.readouterr().err
    assert main(["generate", "--target", str(target), "--no-draft", "--prompt", "x", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
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
            assert max(report["acceptance_lengths"]) <= 4 and set(report["block_sizes"]) == {4}
    with pytest.raises(SystemExit) as exit_info:  # argparse: usage and the reason, status 2
        main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "x", "--block-size", "big"])
    assert exit_info.value.code == 2
    assert "a block size (a number) or 'auto', got 'big'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_enable_thinking_flag(command):
    from dflash.cli.common import chat_template_kwargs
    from dflash.cli.main import build_parser

    extra = ["--prompt", "x"] if command == "generate" else []
    parse = build_parser().parse_args
    assert chat_template_kwargs(parse([command, *extra])) is None  # the template's own default
    assert chat_template_kwargs(parse([command, *extra, "--no-enable-thinking"])) == {"enable_thinking": False}
    assert chat_template_kwargs(parse([command, *extra, "--enable-thinking"])) == {"enable_thinking": True}

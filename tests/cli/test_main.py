"""The command line's last line of defence: what no subcommand catches still reads as an error, not a traceback."""

import pytest

import dflash.cli.generate as generate_module
from dflash.cli.main import main


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"),
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    MemoryError(),
])
def test_running_out_of_memory_says_so_and_what_to_lower(monkeypatch, capsys, error):
    def run(args):
        raise error

    monkeypatch.setattr(generate_module, "run", run)
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash generate: error: out of memory (")
    assert "ask for less at once (a smaller --batch-size, --max-length, --max-new-tokens" in err


def test_other_runtime_errors_are_not_dressed_up_as_memory(monkeypatch):
    def run(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(generate_module, "run", run)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["generate", "--prompt", "hi"])


def test_under_torchrun_each_process_names_its_rank(monkeypatch, capsys):
    from dflash.errors import UserError

    def run(args):
        raise UserError("--data x.jsonl does not exist")

    monkeypatch.setattr(generate_module, "run", run)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["generate", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == "dflash generate [rank 1/2]: error: --data x.jsonl does not exist\n"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["generate", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.startswith("dflash generate: error: ")


@pytest.mark.parametrize("argv, hint", [
    (["bench", "--draft-model", "d"], "arguments: --draft-model d (did you mean --draft for --draft-model?)"),
    (["generate", "--prompt", "x", "--temprature=0.5"], "(did you mean --temperature for --temprature?)"),
    (["serve", "--no-draft", "--model", "m"], "(did you mean --target for --model?)"),
    (["train", "--frobnicate"], "unrecognized arguments: --frobnicate\n"),
    (["generate", "--prompt", "x", "--stop-strings", "y"], "(did you mean --stop for --stop-strings?)"),
    (["bench", "--concurrency", "1", "4"], "arguments: 4 (a sweep's values go joined by commas: --concurrency 1,4"),
    (["generate", "--", "-x", "--max-new-tokens", "8"], "(--max-new-tokens comes after --, which makes it text: give "
                                                         "the flags before --)"),
    (["generate", "-x"], "(a prompt that starts with '-' goes after --: dflash generate -- \"-x ...\")"),
    (["generate", "--prompt", "x", "--num-speculative-tokens", "15"],
     "(did you mean --block-size for --num-speculative-tokens, N + 1 for N speculative tokens: the block holds the "
     "anchor too?)"),
])
def test_an_unknown_flag_gets_the_subcommands_usage_and_a_hint(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: dflash {argv[0]} ") and f"dflash {argv[0]}: error: " in err
    assert hint in err


def test_sigterm_stops_a_command_as_ctrl_c_does_and_says_so(monkeypatch, capsys):
    """A scheduler's SIGTERM runs the commands' own stop paths (datagen says how to resume, bench keeps its
    results) and ends in one line and status 143, instead of killing the process mid-write without a word."""
    import argparse
    import signal
    import sys
    import time
    import types

    from dflash.cli.main import run_command

    stopped = []
    command = types.ModuleType("a_command")

    def run(args):
        try:
            signal.raise_signal(signal.SIGTERM)
            time.sleep(10)  # the signal arrives long before
        except KeyboardInterrupt:
            stopped.append(True)  # what datagen and bench catch to keep their work
            raise
        return 0

    command.run = run
    monkeypatch.setitem(sys.modules, "a_command", command)
    before = signal.getsignal(signal.SIGTERM)
    assert run_command(argparse.Namespace(module="a_command"), "dflash datagen") == 143
    assert stopped == [True]
    assert capsys.readouterr().err.strip() == "dflash datagen: terminated"
    assert signal.getsignal(signal.SIGTERM) is before  # put back once the command ends


def test_python_dash_m_dflash_is_the_dflash_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "dflash", "serve", "--allowed-origins", "ftp://x", "--no-draft"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert "usage: dflash serve" in done.stderr  # the command's own name, not __main__.py
    assert "'ftp://x' is not an origin: give scheme://host[:port]" in done.stderr


def test_integer_lists_take_a_trailing_comma_but_not_an_empty_item():
    import argparse

    from dflash.cli.common import block_size_list, int_list

    assert int_list("1,9,17") == [1, 9, 17] and int_list("1,9,") == [1, 9] and int_list(" 4 , 8") == [4, 8]
    assert int_list(",") == [] == int_list("")  # the flag's own check names it ("--concurrency was given no value")
    for typo in ("1,,2", ",1", "1;2"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected integers separated by commas"):
            int_list(typo)
    # --block-size's lists follow the same rule (one splitter, dflash.config_types.split_list)
    assert block_size_list("auto, 8,16,") == ["auto", 8, 16] and block_size_list(",") == []
    for typo in ("8,,16", ",8"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected block sizes separated by commas"):
            block_size_list(typo)


def test_the_decoding_commands_name_the_flags_in_the_api_errors(capsys):
    """GenerationConfig's errors name its fields (block_size, top_p ...); from the command line they name the flag."""
    assert main(["generate", "--prompt", "x", "--block-size", "1"]) == 2
    assert "error: --block-size is at least 2 (the anchor and one draft token), got 1" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--temperature", "0.7", "--branch-length", "-1"]) == 2
    assert "error: --branch-length is a number of tokens >= 0" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--temperature", "1", "--seed", str(2**80)]) == 2
    assert "error: --seed must be in [-2**63, 2**64)" in capsys.readouterr().err
    from dflash.cli.main import GENERATION_FLAGS, _respelled

    kept = "dflash_config.block_size 5000 exceeds ...; top_p (--top-p) ...; max_new_tokens_left; runs/top_p/q.txt"
    assert _respelled(kept, GENERATION_FLAGS) == kept  # a config key, a name spelled out already, a word, a path
    # only the generation options' own errors: a path or a drafter's config.json field is no flag
    assert main(["datagen", "--prompts", "sweeps/temperature/prompts.jsonl", "--output", "o.jsonl"]) == 2
    assert "--prompts sweeps/temperature/prompts.jsonl: there is no local file" in capsys.readouterr().err


def test_the_command_line_module_imports_nothing_heavy_before_its_interrupt_handler():
    """`import dflash` imported torch and transformers: a Ctrl-C in the first second or two of any command ended in
    a KeyboardInterrupt traceback, before `main` (which catches it while it loads them) ran. The package's names
    still import as before."""
    import subprocess
    import sys

    probe = ("import sys, dflash.cli.main; heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
             "print(heavy); from dflash import DFlash, load_drafter, UserError; print(DFlash.__name__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "DFlash"]


def test_a_name_too_long_for_the_file_system_says_to_shorten_it(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    output = tmp_path / ("a" * 250 + ".jsonl")  # its settings file, OUTPUT.datagen.json, is past 255 bytes
    assert main(["datagen", "--prompts", str(prompts), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert "error: a file name is too long: " in err and "shorten the name you gave" in err
    assert "[Errno" not in err


@pytest.mark.parametrize("argv, loads_torch", [(["--help"], False), (["--version"], False),
                                               (["generate", "--help"], True)])
def test_the_top_levels_help_and_version_load_no_command(argv, loads_torch):
    """`dflash --help` and `--version` took 2-3 s: every command's module was imported (torch, transformers) for
    flags they do not show."""
    import subprocess
    import sys

    script = (f"import sys\nfrom dflash.cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
              "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == str(loads_torch)
    if argv == ["--help"]:
        assert all(name in done.stdout for name in ("generate", "datagen", "train", "serve", "bench"))

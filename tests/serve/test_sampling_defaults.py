"""`dflash serve --generation-config`: a request that leaves out a sampling field gets the target's
generation_config.json value (vLLM's `auto`, SGLang's `model`), or OpenAI's with `vllm`; max_new_tokens caps."""

from __future__ import annotations

import json
import logging
import shlex

import httpx
import pytest
from transformers import GenerationConfig

from dflash.cli.main import main
from dflash.errors import UserError
from dflash.serve.sampling_defaults import SamplingDefaults, from_generation_config, sampling_defaults

PROMPT = "12 apples and 5 pears"


def _complete(server, **fields) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **fields}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_values_a_generation_config_sets_are_read_and_the_rest_stay_openais():
    config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=64,
                              repetition_penalty=1.05)
    defaults = from_generation_config(config, "the file")
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.95, 20, 64)
    assert defaults.repetition_penalty == 1.05 and defaults.unapplied == ()  # applied, as vLLM and SGLang do
    assert "temperature=0.6, top_p=0.95, top_k=20" in defaults.describe() and "capped at 64" in defaults.describe()
    only_top_p = from_generation_config(GenerationConfig(top_p=0.8), "the file")
    assert (only_top_p.temperature, only_top_p.top_p, only_top_p.top_k, only_top_p.max_tokens) == (1.0, 0.8, 0, None)
    assert sampling_defaults("vllm", config) == SamplingDefaults() == sampling_defaults("openai", config)
    assert sampling_defaults("auto", None) == SamplingDefaults()
    assert sampling_defaults("auto", config).changed() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                           "repetition_penalty": 1.05}


@pytest.mark.parametrize("field, value, expected", [
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("temperature", -1.0, "temperature must be a finite number >= 0"),
    ("temperature", 150.0, "at most 100, got 150.0"),  # as a request's is (SamplingParams)
    ("top_k", -2, "top_k must be a number of tokens >= 1, or 0 or -1 (off), got -2"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1, got 0"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
])
def test_values_a_request_could_not_send_are_refused_naming_the_file_and_the_way_out(field, value, expected):
    config = GenerationConfig()
    setattr(config, field, value)
    with pytest.raises(UserError) as err:
        from_generation_config(config, "gen/generation_config.json")
    assert expected in str(err.value) and "gen/generation_config.json" in str(err.value)
    assert "--generation-config vllm" in str(err.value)


def _server_with(start_server, tmp_path_factory, **generation_config):
    """A server given a directory holding a generation_config.json of these values (--generation-config DIR)."""
    directory = tmp_path_factory.mktemp("generation_config")
    (directory / "generation_config.json").write_text(json.dumps(generation_config))  # as a model's authors write it
    return start_server(generation_config=str(directory))


def test_a_request_that_leaves_the_fields_out_gets_the_files_values_and_one_that_sends_them_its_own(
        start_server, server, tmp_path_factory):
    # top_k 1 leaves one token to sample: at temperature 1 and any seed, the answer is the greedy one
    topk1 = _server_with(start_server, tmp_path_factory, top_k=1)
    greedy = _complete(server, temperature=0)["choices"][0]["text"]
    assert _complete(topk1, temperature=1.0, seed=3)["choices"][0]["text"] == greedy
    sampled = [_complete(server, temperature=1.0, seed=seed)["choices"][0]["text"] for seed in (3, 4, 5)]
    assert any(text != greedy for text in sampled)  # so without the file's top_k the seeds would differ from greedy
    # a request's own top_k wins over the file's
    assert [_complete(topk1, temperature=1.0, top_k=0, seed=seed)["choices"][0]["text"] for seed in (3, 4, 5)] \
        == sampled
    # the file's temperature: 0 is greedy; the request's own temperature wins
    cold = _server_with(start_server, tmp_path_factory, temperature=0.0)
    assert _complete(cold, seed=3)["choices"][0]["text"] == greedy
    assert _complete(cold, temperature=1.0, seed=4)["choices"][0]["text"] == sampled[1]
    assert _complete(cold, temperature=None, seed=4)["choices"][0]["text"] == greedy  # null: left out


def test_max_new_tokens_caps_every_request_as_in_vllm(start_server, tmp_path_factory):
    capped = _server_with(start_server, tmp_path_factory, max_new_tokens=5)
    answer = _complete(capped, max_tokens=12)
    assert answer["usage"]["completion_tokens"] == 5 and answer["choices"][0]["finish_reason"] == "length"
    chat = httpx.post(f"{capped.url}/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 5
    assert _complete(capped, max_tokens=3)["usage"]["completion_tokens"] == 3  # below the cap: as asked


def test_the_server_logs_its_defaults_and_warns_of_what_it_leaves_out(start_server, tmp_path_factory, caplog):
    with caplog.at_level(logging.INFO, logger="dflash.serve"):
        _server_with(start_server, tmp_path_factory, temperature=0.7, repetition_penalty=1.1, max_new_tokens=50)
    said = caplog.text
    assert "temperature=0.7" in said and "capped at 50" in said and "--generation-config vllm" in said
    assert "repetition_penalty=1.1" in said and "does not apply" not in said  # applied, as vLLM and SGLang do
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash.serve"):
        _server_with(start_server, tmp_path_factory, no_repeat_ngram_size=3)
    assert "no_repeat_ngram_size=3, which this server does not apply (nor do vLLM and SGLang)" in caplog.text


# ---- the command line and the hand-off -----------------------------------------------------------------------
def _dry_run(capsys, tiny_pair, engine: str, *args: str) -> list[str]:
    target, draft = map(str, tiny_pair)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", engine, *args, "--dry-run"]) == 0
    return shlex.split(capsys.readouterr().out.strip())


def test_the_choice_carries_over_to_vllm_and_sglang(tiny_pair, tmp_path, capsys, monkeypatch):
    GenerationConfig(temperature=0.5, do_sample=True).save_pretrained(tmp_path)
    assert "--generation-config" not in _dry_run(capsys, tiny_pair, "vllm")  # auto: both engines' default
    assert "--sampling-defaults" not in _dry_run(capsys, tiny_pair, "sglang")
    vllm = _dry_run(capsys, tiny_pair, "vllm", "--generation-config", "openai")
    assert vllm[vllm.index("--generation-config") + 1] == "vllm"
    vllm = _dry_run(capsys, tiny_pair, "vllm", "--generation-config", str(tmp_path))
    assert vllm[vllm.index("--generation-config") + 1] == str(tmp_path)
    monkeypatch.chdir(tmp_path.parent)  # a relative directory reaches vLLM as an absolute one
    vllm = _dry_run(capsys, tiny_pair, "vllm", "--generation-config", tmp_path.name)
    assert vllm[vllm.index("--generation-config") + 1] == str(tmp_path.resolve())
    sglang = _dry_run(capsys, tiny_pair, "sglang", "--generation-config", "vllm")
    assert sglang[sglang.index("--sampling-defaults") + 1] == "openai"
    target, draft = map(str, tiny_pair)
    assert main(["serve", "--target", target, "--draft", draft, "--engine", "sglang", "--generation-config",
                 str(tmp_path), "--dry-run"]) == 2
    assert "SGLang reads sampling defaults from the target's own generation_config.json" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "no file", "bad value", "not json"])
def test_a_directory_that_cannot_serve_is_refused_before_the_models_load(tiny_pair, tmp_path, capsys, monkeypatch,
                                                                          case):
    import dflash.cli.serve

    monkeypatch.setattr(dflash.cli.serve, "load_pipeline", lambda *a, **k: pytest.fail("loaded the models first"))
    directory = tmp_path / "gen"
    if case != "missing":
        directory.mkdir()
    if case == "bad value":
        (directory / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    if case == "not json":
        (directory / "generation_config.json").write_text("{top_p: ")
    target, draft = map(str, tiny_pair)
    assert main(["serve", "--target", target, "--draft", draft, "--generation-config", str(directory)]) == 2
    err = capsys.readouterr().err
    expected = {"missing": "no directory", "no file": "a directory without a generation_config.json",
                "bad value": "top_p must be in (0, 1], got 2.0", "not json": "cannot be read"}[case]
    assert expected in err and "Traceback" not in err


@pytest.mark.parametrize("choice", ["auto", "vllm"])
def test_auto_reads_the_targets_own_file_and_vllm_ignores_it(tiny_pair, tmp_path, choice):
    """The default, `auto`, reads the generation_config.json next to the target's weights."""
    import shutil

    from dflash.api import DFlash
    from dflash.serve import ServeConfig
    from dflash.serve.fallback import FallbackConfig

    from .conftest import LiveServer

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    GenerationConfig(do_sample=True, top_k=1, max_new_tokens=6).save_pretrained(target)
    pipe = DFlash.from_pretrained(str(target), str(tiny_pair[1]), dtype="float32", device="cpu")
    server = LiveServer(pipe, ServeConfig(served_model_name="tiny", fallback=FallbackConfig(0.0),
                                          generation_config=choice))
    try:
        greedy = _complete(server, temperature=0, max_tokens=6)["choices"][0]["text"]
        sampled = [_complete(server, temperature=1.0, seed=seed) for seed in (3, 4, 5)]
        if choice == "auto":  # top_k 1: the greedy answer whatever the seed, cut at the file's 6 tokens
            assert all(a["choices"][0]["text"] == greedy and a["usage"]["completion_tokens"] == 6 for a in sampled)
        else:
            assert any(a["choices"][0]["text"] != greedy for a in sampled)
            assert all(a["usage"]["completion_tokens"] == 12 for a in sampled)
    finally:
        server.stop()


def test_the_targets_own_file_is_checked_before_the_models_load(tiny_pair, tmp_path, capsys, monkeypatch):
    import shutil

    import dflash.cli.serve

    monkeypatch.setattr(dflash.cli.serve, "load_pipeline", lambda *a, **k: pytest.fail("loaded the models first"))
    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    (target / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 150.0}))
    assert main(["serve", "--target", str(target), "--draft", str(tiny_pair[1])]) == 2
    err = capsys.readouterr().err
    assert "the target's generation_config.json: temperature must be a finite number >= 0" in err
    assert "at most 100, got 150.0" in err and "--generation-config vllm" in err


def test_min_p_from_the_request_or_the_file_is_the_librarys(start_server, server, tmp_path_factory):
    """min_p 1 leaves the likeliest token alone: any seed samples the greedy answer. A request's min_p is the
    library's; the file's is the default of a request that leaves it out, as vLLM takes it."""
    greedy = _complete(server, temperature=0)["choices"][0]["text"]
    assert _complete(server, temperature=1.0, min_p=1.0, seed=3)["choices"][0]["text"] == greedy
    ids = server.pipe.encode(PROMPT, raw=True)
    library = server.pipe.generate(ids, raw=True, max_new_tokens=12, ignore_eos=True, temperature=1.0, min_p=0.2,
                                   seed=4).text
    assert _complete(server, temperature=1.0, min_p=0.2, seed=4)["choices"][0]["text"] == library
    from_file = _server_with(start_server, tmp_path_factory, min_p=1.0)
    assert _complete(from_file, temperature=1.0, seed=3)["choices"][0]["text"] == greedy
    assert _complete(from_file, temperature=1.0, min_p=0.2, seed=4)["choices"][0]["text"] == library
    assert from_generation_config(GenerationConfig(min_p=0.1), "the file").changed() == {"min_p": 0.1}


def test_logit_bias_is_the_librarys_and_a_bad_one_is_refused_by_name(server):
    """OpenAI's logit_bias: token ids as strings. -100 bans a token, as the library's bias does."""
    ids = server.pipe.encode(PROMPT, raw=True)
    greedy = server.pipe.generate(ids, raw=True, max_new_tokens=12, ignore_eos=True)
    banned = {str(greedy.output_ids[0]): -100, str(greedy.output_ids[2]): -100.0}
    library = server.pipe.generate(ids, raw=True, max_new_tokens=12, ignore_eos=True,
                                   logit_bias={int(k): float(v) for k, v in banned.items()})
    answer = _complete(server, temperature=0, logit_bias=banned)
    assert answer["choices"][0]["text"] == library.text != greedy.text
    for bad, says in [({"x": 1}, "token ids (as strings"), ({"5": 101}, "from -100 to 100"),
                      ({str(10**6): 1}, "outside the vocabulary")]:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "logit_bias": bad}
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias", refused.text
        assert says in refused.json()["error"]["message"]


def test_penalties_are_the_librarys_and_the_files_repetition_penalty_is_the_default(start_server, server,
                                                                                   tmp_path_factory):
    """OpenAI's presence and frequency penalties and vLLM's repetition_penalty decode as the library's; the target's
    generation_config.json repetition_penalty is the default of a request that leaves it out, as vLLM takes it."""
    ids = server.pipe.encode(PROMPT, raw=True)
    plain = server.pipe.generate(ids, raw=True, max_new_tokens=12, ignore_eos=True).text
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    library = server.pipe.generate(ids, raw=True, max_new_tokens=12, ignore_eos=True, **penalties).text
    assert _complete(server, temperature=0, **penalties)["choices"][0]["text"] == library != plain
    repeated = server.pipe.generate(ids, raw=True, max_new_tokens=12, ignore_eos=True, repetition_penalty=2.0).text
    from_file = _server_with(start_server, tmp_path_factory, repetition_penalty=2.0)
    assert _complete(from_file, temperature=0)["choices"][0]["text"] == repeated != plain
    assert _complete(from_file, temperature=0, repetition_penalty=1.0)["choices"][0]["text"] == plain
    for field, bad, says in [("presence_penalty", 2.5, "less than or equal to 2"),
                             ("frequency_penalty", -3, "greater than or equal to -2"),
                             ("repetition_penalty", 0, "greater than 0"), ("repetition_penalty", "x", "number")]:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, field: bad}
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert says in refused.json()["error"]["message"], refused.text

import dataclasses
import json
import sys
import time
import types

import pytest

from dflash import hub
from dflash.bench import datasets
from dflash.bench.datasets import DataOptions, load_samples, resolve_names, subset
from dflash.errors import UserError

from .conftest import GSM8K, write_jsonl


def only(data_dir, **kw) -> DataOptions:
    """Options that see the fixture directory and nothing else (no bundled copies, no hub)."""
    return DataOptions(data_dir=str(data_dir), extra_dirs=[], use_hub=False, **kw)


def test_gsm8k_uses_the_usual_prompt_format(data_dir):
    samples = load_samples("gsm8k", only(data_dir))
    assert len(samples) == len(GSM8K)
    assert samples[0].turns == (GSM8K[0]["question"] + "\nPlease reason step by step, and put your final "
                                "answer within \\boxed{}.",)
    assert samples[0].history == ()


def test_humaneval_reads_gzip_and_wraps_the_code(data_dir):
    [sample] = load_samples("humaneval", only(data_dir))
    assert sample.id == "HumanEval/0"
    assert sample.turns[0].startswith("Write a solution to the following problem and make sure that it passes "
                                      "the tests:\n```python\ndef add(a, b):")
    assert sample.turns[0].endswith("\n```")


def test_mt_bench_keeps_both_turns(data_dir):
    samples = load_samples("mt-bench", only(data_dir))
    assert [s.id for s in samples] == ["81", "82"]
    assert samples[0].turns == ("Write a haiku about clips.", "Now make it rhyme.")


def test_math500_and_mbpp_from_a_data_file(data_dir):
    math = load_samples("math500", DataOptions(data_file=str(data_dir / "math500" / "test.jsonl"), use_hub=False))
    assert math[0].id == "test/algebra/1.json"
    assert math[0].turns[0].startswith("What is $1+1$?\nPlease reason step by step")
    [mbpp] = load_samples("mbpp", DataOptions(data_file=str(data_dir / "mbpp" / "test.jsonl"), use_hub=False))
    assert "here is your task: Write a function to find the shared elements" in mbpp.turns[0]
    assert mbpp.turns[0].endswith("assert similar_elements((1,), (2,)) == ()")


def test_generic_records_prompt_turns_and_messages(tmp_path):
    path = tmp_path / "mine.jsonl"
    write_jsonl(path, [
        {"prompt": "plain prompt"},
        {"turns": ["first", "second"]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "reference answer, dropped"}]},
    ])
    a, b, c = load_samples("gsm8k", DataOptions(data_file=str(path), use_hub=False))
    assert a.turns == ("plain prompt",)  # no gsm8k format: the record is not in gsm8k's own format
    assert b.turns == ("first", "second")
    assert c.history == ({"role": "system", "content": "be brief"},) and c.turns == ("hi",)
    write_jsonl(path, [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "dropped"}]}])
    assert load_samples("gsm8k", DataOptions(data_file=str(path), use_hub=False))[0].turns == ("hi",)  # ShareGPT


def test_data_dir_from_the_environment(data_dir, monkeypatch):
    monkeypatch.setenv(datasets.DATA_DIR_ENV, str(data_dir))
    assert len(load_samples("math500", DataOptions(extra_dirs=[], use_hub=False))) == 2


def test_bundled_copies_are_used_without_any_source():
    gsm8k = load_samples("gsm8k", DataOptions(use_hub=False, max_samples=3))
    mt = load_samples("mt-bench", DataOptions(use_hub=False))
    humaneval = load_samples("humaneval", DataOptions(use_hub=False))
    math = load_samples("math500", DataOptions(use_hub=False))
    mbpp = load_samples("mbpp", DataOptions(use_hub=False))
    assert len(gsm8k) == 3 and len(mt) == 80 and len(humaneval) == 164 and len(math) == 500 and len(mbpp) == 500
    assert all(len(s.turns) == 2 for s in mt)
    assert sorted(int(s.id) for s in mbpp) == list(range(11, 511))  # the MBPP test split
    assert all(s.turns[0].endswith(datasets.MATH_SUFFIX) for s in math)


def test_subset_is_deterministic_and_seeded(data_dir):
    first = load_samples("gsm8k", DataOptions(use_hub=False, max_samples=5, seed=1))
    again = load_samples("gsm8k", DataOptions(use_hub=False, max_samples=5, seed=1))
    other = load_samples("gsm8k", DataOptions(use_hub=False, max_samples=5, seed=2))
    assert [s.id for s in first] == [s.id for s in again] != [s.id for s in other]
    assert subset(first, 0, 0) == first and subset(first, 99, 0) == first


def test_offline_without_data_says_what_to_provide(monkeypatch, tmp_path):
    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    monkeypatch.delenv(datasets.DATA_DIR_ENV, raising=False)
    with pytest.raises(UserError) as err:
        load_samples("mbpp", DataOptions(extra_dirs=[tmp_path]))
    message = str(err.value)
    assert message.startswith("no data for mbpp: pass --data-file FILE.jsonl")
    assert "mbpp/test.jsonl under --data-dir" in message and "google-research-datasets/mbpp" in message


def test_hub_records_are_formatted(monkeypatch):
    calls = []

    def load_dataset(path, config, split):
        calls.append((path, config, split))
        return [{"problem": "What is 2+2?", "answer": "4", "unique_id": "x"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(hub, "unreachable", lambda *args, **kwargs: None)  # the hub answers
    [sample] = load_samples("math500", DataOptions(extra_dirs=[]))
    assert calls == [("HuggingFaceH4/MATH-500", None, "test")]
    assert sample.turns[0].startswith("What is 2+2?\nPlease reason step by step")


def test_names_aliases_and_errors():
    assert resolve_names(["all"]) == ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]
    assert resolve_names(["gsm8k,MATH-500", "mt_bench", "gsm8k"]) == ["gsm8k", "math500", "mt-bench"]
    with pytest.raises(UserError, match="unknown dataset 'gsmk'; choose from .* or 'all'$"):
        resolve_names(["gsmk"])
    with pytest.raises(UserError, match=r"unknown dataset './p40.jsonl'.*\(a file of prompts goes to --data-file\)"):
        resolve_names(["./p40.jsonl"])
    with pytest.raises(UserError, match="--dataset 'gsm8k,,mbpp' holds an empty name between commas"):
        resolve_names(["gsm8k,,mbpp"])  # measured two datasets where three were likely meant


def test_bad_files_are_user_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(UserError, match="bad.jsonl:2 is not valid JSON"):
        load_samples("gsm8k", DataOptions(data_file=str(bad)))
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"query": "no known field"}) + "\n")
    with pytest.raises(UserError, match="none of the fields"):
        load_samples("gsm8k", DataOptions(data_file=str(odd)))
    with pytest.raises(UserError, match="does not exist"):
        load_samples("gsm8k", DataOptions(data_file=str(tmp_path / "missing.jsonl")))


@pytest.mark.parametrize("name, line, message", [
    ("gsm8k", {"turns": "hello"}, '`turns` must be a list of strings, e.g. ["first", "second"], not one string'),
    ("mt-bench", {"question_id": 1, "turns": "Tell me a joke"}, "`turns` must be a list of strings"),
    ("gsm8k", {"turns": ["first", 2]}, "`turns` must be a non-empty list of non-empty strings, got [\"first\", 2]"),
    ("gsm8k", {"question": 5}, "`question` must be a non-empty string, got 5"),
    ("math500", {"problem": ["x"]}, '`problem` must be a non-empty string, got ["x"]'),
    ("humaneval", {"prompt": None, "entry_point": "f"}, "`prompt` must be a non-empty string, got null"),
    ("mbpp", {"test_list": 5}, "`test_list` must be a list of non-empty strings, got 5"),
    ("mbpp", {"test_list": ["assert f()"]}, "an mbpp record needs the task in 'prompt'"),
    ("gsm8k", {"prompt": 7}, "`prompt` must be a non-empty string, got 7"),
    ("gsm8k", {"messages": [{"role": "user", "content": None}]}, '`messages`[0] needs a string "role" and a string'),
    ("gsm8k", {"messages": [{"role": "assistant", "content": "a"}]}, "must end with a non-empty user message"),
    ("gsm8k", {"messages": [{"role": "User", "content": "hi"}]},  # was: as if it were no user message
     "must end with a non-empty user message to answer (assistant messages after it are dropped); roles are "
     "lowercase: its last role is 'User', not 'user'"),
    ("gsm8k", {"messages": [{"role": "user", "content": "   "}]}, "must end with a non-empty user message"),  # as a
])  # whitespace-only prompt or turn is refused
def test_bad_fields_name_the_file_line_and_field(tmp_path, name, line, message):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [{"prompt": "a fine first record"}, line])
    with pytest.raises(UserError) as err:
        load_samples(name, DataOptions(data_file=str(path), use_hub=False))
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value)


def test_unreadable_files_are_user_errors(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin.jsonl:2 is not UTF-8 text \(byte 0xe9 .*save the file as UTF-8"):
        load_samples("gsm8k", DataOptions(data_file=str(latin)))
    not_gzip = tmp_path / "plain.jsonl.gz"
    not_gzip.write_text('{"prompt": "x"}\n')
    with pytest.raises(UserError, match="plain.jsonl.gz is not a readable gzip file"):
        load_samples("gsm8k", DataOptions(data_file=str(not_gzip)))
    with_bom = tmp_path / "bom.jsonl"
    with_bom.write_bytes(b'\xef\xbb\xbf{"prompt": "saved by a Windows editor"}\n')
    assert load_samples("gsm8k", DataOptions(data_file=str(with_bom)))[0].turns == ("saved by a Windows editor",)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="empty.jsonl has no records"):
        load_samples("gsm8k", DataOptions(data_file=str(empty)))


def test_no_dataset_name_is_an_error():
    for names in ([","], [""], []):
        with pytest.raises(UserError, match="no dataset given"):
            resolve_names(names)


def test_data_source_names_the_file_used(data_dir):
    assert datasets.data_source("gsm8k", only(data_dir)) == str(data_dir / "gsm8k" / "test.jsonl")
    assert datasets.data_source("gsm8k", DataOptions(use_hub=False)) == str(datasets.BUNDLED_DIR / "gsm8k" /
                                                                            "test.jsonl")
    assert datasets.data_source("gsm8k", DataOptions(extra_dirs=[])) == "openai/gsm8k (Hugging Face Hub)"


def test_a_hub_dataset_when_the_hub_does_not_answer_is_a_clear_error_in_seconds(silent_hub, monkeypatch):
    """With no bundled copy and no data directory the hub is the last source: asked once, bounded, then the cache."""
    pytest.importorskip("datasets")
    spec = datasets.DATASETS["gsm8k"]
    monkeypatch.setitem(datasets.DATASETS, "gsm8k", dataclasses.replace(
        spec, hub=dataclasses.replace(spec.hub, path="dflash-tests/no-such-set")))
    start = time.monotonic()
    with pytest.raises(UserError, match=r"no data for gsm8k: pass --data-file.*\(the hub is not reachable \(no answer "
                                        r"in 0.5 s.*the local datasets cache has no copy of dflash-tests/no-such-set"):
        load_samples("gsm8k", DataOptions(extra_dirs=[]))
    assert time.monotonic() - start < 15
    monkeypatch.setattr("dflash.hub.offline", lambda: True)
    with pytest.raises(UserError, match=r"\(HF_HUB_OFFLINE \(or TRANSFORMERS_OFFLINE\) is set, and the local "
                                        r"datasets cache has no copy of dflash-tests/no-such-set \(.+\)\)$"):
        load_samples("gsm8k", DataOptions(extra_dirs=[]))


def test_repeated_ids_become_distinct(tmp_path):
    """Answers are matched by id: two records with one id made the server backend compare the second answer with
    the first's and count a mismatch."""
    path = tmp_path / "dup.jsonl"
    write_jsonl(path, [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}, {"id": "x (2)", "prompt": "c"},
                       {"id": "y", "prompt": "d"}])
    samples = load_samples("gsm8k", DataOptions(data_file=str(path), use_hub=False))
    assert [s.id for s in samples] == ["x", "x (2)", "x (2) (2)", "y"]
    assert [s.turns[0] for s in samples] == ["a", "b", "c", "d"]


def test_a_given_data_dir_without_the_dataset_is_named_where_the_data_comes_from(data_dir, tmp_path, monkeypatch):
    """A wrong --data-dir silently measured the bundled copy; now a warning says where each dataset comes from."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.warns(datasets.DFlashWarning, match=r"--data-dir .*empty has no gsm8k/test.jsonl; gsm8k comes "
                                                     r"from .*dflash/bench/data/gsm8k/test.jsonl"):
        assert len(load_samples("gsm8k", DataOptions(data_dir=str(empty), use_hub=False, max_samples=2))) == 2
    monkeypatch.setenv(datasets.DATA_DIR_ENV, str(empty))
    with pytest.warns(datasets.DFlashWarning, match=r"\$DFLASH_DATA_DIR .*empty has no mt-bench/question.jsonl"):
        load_samples("mt-bench", DataOptions(use_hub=False))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # found where the user said: no warning
        load_samples("gsm8k", DataOptions(data_dir=str(data_dir), use_hub=False))
        monkeypatch.delenv(datasets.DATA_DIR_ENV)
        load_samples("gsm8k", DataOptions(use_hub=False))  # no directory given: the bundled copy, no warning


def test_repeated_ids_get_suffixes_in_order_and_a_genuine_suffix_is_kept_apart():
    from dflash.bench.datasets import Sample, _distinct_ids

    samples = [Sample(i, ("q",)) for i in ["a", "a", "b", "a", "a (2)", "a"]]
    assert [s.id for s in _distinct_ids(samples)] == ["a", "a (2)", "b", "a (3)", "a (2) (2)", "a (4)"]
    many = _distinct_ids([Sample("same", ("q",))] * 20_000)  # each next suffix from the last (was: counted from 2)
    assert len({s.id for s in many}) == 20_000 and many[-1].id == "same (20000)"


def test_a_hub_that_refuses_the_token_is_said_to_and_the_cache_asked(refusing_hub, monkeypatch):
    """A 401 read as "not reachable" sent a user to download elsewhere; now it names the token, offers bench's own
    ways to give the data, and the local datasets cache still serves (asked offline)."""
    hf_datasets = pytest.importorskip("datasets")
    spec = datasets.DATASETS["gsm8k"]
    monkeypatch.setitem(datasets.DATASETS, "gsm8k", dataclasses.replace(
        spec, hub=dataclasses.replace(spec.hub, path="dflash-tests/private-set")))
    refusing_hub(401, None, "Invalid credentials in Authorization header")
    asked_offline = []

    def load_dataset(*args, **kwargs):
        asked_offline.append(hf_datasets.config.HF_HUB_OFFLINE)
        raise FileNotFoundError("not in the cache")

    monkeypatch.setattr(hf_datasets, "load_dataset", load_dataset)
    with pytest.raises(UserError, match=r"the Hugging Face hub refused the token sent for dflash-tests/private-set .*"
                                        r"or give the data with --data-file or --data-dir"):
        load_samples("gsm8k", DataOptions(extra_dirs=[]))
    assert asked_offline == [True]

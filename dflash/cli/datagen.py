"""`dflash datagen`: the target answers the prompts; the drafter is then trained on its own text."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash.cli.common import add_thinking_argument, add_trust_remote_code_argument
from dflash.training.datagen import DatagenConfig, Shard, read_prompts, run_datagen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model: directory or hub id (default: the embedded target)")
    parser.add_argument("--prompts", required=True,
                        help="JSONL with `prompt`, `turns`, `messages` or ShareGPT `conversations` per line, a "
                        "parquet, CSV or Arrow file, a dataset directory (data files or a save_to_disk copy), or a "
                        "Hugging Face dataset name (org/name)")
    parser.add_argument("--output", required=True,
                        help="output JSONL; re-running the same command resumes it (the generation settings are "
                             "kept next to it in OUTPUT.datagen.json, and a rerun with others is refused)")
    parser.add_argument("--max-new-tokens", type=int, default=512,
                        help="answer length limit (default %(default)s); answers also stop at the end of the target's "
                             "context")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default); above 0, each prompt is sampled with its own seed")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling at --temperature > 0 (default %(default)g = off)")
    parser.add_argument("--seed", type=int, default=0,
                        help="at --temperature > 0: prompt i is sampled with a seed hashed from SEED and i, so "
                        "runs with different seeds draw independent answers to every prompt (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default %(default)s)")
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--split", help="dataset split (datasets; default train)")  # None: not given (a file has none)
    parser.add_argument("--subset", help="dataset configuration, e.g. main for openai/gsm8k (datasets)")
    parser.add_argument("--prompt-field", help="dataset column holding the prompt (default: a record's messages, "
                                               "conversations or turns, else the first of its prompt, question, "
                                               "instruction (with an Alpaca input after it) and text)")
    parser.add_argument("--prompt-suffix", default="", help="text appended to every user turn")
    add_thinking_argument(parser)
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                        help="the target's weights (default auto: the checkpoint's own)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: this process's GPU when there is one; under "
                                         "torchrun, GPU LOCAL_RANK)")
    add_trust_remote_code_argument(parser)
    server = parser.add_argument_group("answering through a server (vLLM, SGLang, dflash serve) already serving the "
                                       "target; --target then gives its tokenizer and chat template")
    server.add_argument("--base-url", help="the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1; prompts are "
                                           "rendered here and sent as token ids to its /v1/completions, --batch-size "
                                           "at a time")
    server.add_argument("--model", help="the model's name on the server (default: the first it lists)")
    server.add_argument("--api-key", help="the server's key (default: $OPENAI_API_KEY, if set)")
    server.add_argument("--request-timeout", type=float, default=3600.0,
                        help="seconds one answer may take on the server before it is asked again (default "
                             "%(default)g; 0: no limit); long answers on a busy server need more")


def run(args: argparse.Namespace) -> int:
    from dflash.model.loading import check_target_dir, resolve_model_dir

    config = DatagenConfig(**{k: v for k, v in vars(args).items() if k in DatagenConfig.__dataclass_fields__})
    config.validate()
    prompts = read_prompts(config)  # once, and every record checked before the target loads
    if config.target is not None and config.base_url is None:  # found (or fetched) before the progress bar is drawn
        check_target_dir(resolve_model_dir(config.target))
    shard = Shard.of_torchrun()
    mine = len(prompts) if shard is None else sum(p.id % shard.world == shard.rank for p in prompts)
    bar = _Bar(mine, "datagen" if shard is None else f"datagen, rank 0 of {shard.world}")
    try:  # under torchrun rank 0 alone draws its share's bar and prints the summary
        result = run_datagen(config, progress=bar.advance if shard is None or shard.rank == 0 else None,
                             prompts=prompts)
    except KeyboardInterrupt:  # every answer is written whole and flushed: a rerun continues after the last one
        bar.stop()
        if shard is None:
            print(f"dflash datagen: stopped; the answers written to {config.output} are kept: rerun the same command "
                  "to resume", file=sys.stderr, flush=True)
        elif shard.rank == 0:  # once for the job: the answers are in the processes' part files
            print(f"dflash datagen: stopped; the answers written are kept in {Path(config.output).name}.part-*-of-"
                  f"{shard.world} beside {config.output}: rerun the same command (one process is enough) to join "
                  "them and resume", file=sys.stderr, flush=True)
        raise
    finally:
        bar.stop()
    if shard is not None and shard.rank != 0:
        return 0
    skipped = (f"; {result.skipped_count} skipped: too long for the target's context (named above; a rerun skips "
               "them again)" if result.skipped_count else "")
    skipped += (f"; {_count(result.cut, 'conversation')} {'ends' if result.cut == 1 else 'end'} early, a later "
                "turn too long for the context" if result.cut else "")
    skipped += (f"; {result.failed} failed: the target gave no token (named above; a rerun tries them again)"
                if result.failed else "")
    print(f"wrote {_count(result.written, 'new record')} to {config.output} ({_count(len(prompts), 'prompt')} in "
          f"all{skipped}; it holds {result.held})")
    return 0


class _Bar:
    """The progress bar, drawn from the first prompt accounted for: after the output and its settings are checked,
    so a refusal (another job's output, other settings) is not preceded by an empty bar."""

    def __init__(self, total: int, label: str = "datagen"):
        self.total, self.label, self.progress, self.task = total, label, None, None

    def advance(self, n: int) -> None:
        if self.progress is None:
            from rich.progress import Progress

            self.progress = Progress(transient=False)
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=self.total)
        self.progress.advance(self.task, n)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"

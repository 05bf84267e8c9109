"""Format GSM8K rows as chat conversations for the embedded target model.

user turn      = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
assistant turn = GSM8K solution with the <<calc>> annotations removed and the final
                 "#### N" line replaced by "The answer is \\boxed{N}."
"""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# GSM8K (MIT, OpenAI grade-school-math), copied into the repo: train here, test with the bench data
SPLITS = {"train": ROOT / "scripts" / "embedded" / "data" / "gsm8k_train.jsonl",
          "test": ROOT / "dflash" / "bench" / "data" / "gsm8k" / "test.jsonl"}
PROMPT_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_CALC = re.compile(r"<<[^<>]*>>")


def format_question(question: str) -> str:
    return question.strip() + PROMPT_SUFFIX


def format_answer(answer: str) -> str:
    text = _CALC.sub("", answer)
    body, sep, final = text.rpartition("####")
    if not sep:
        return text.strip()
    final = final.strip().replace(",", "")
    body = body.rstrip()
    return (body + "\n" if body else "") + f"The answer is \\boxed{{{final}}}."


def final_number(answer: str) -> str:
    return answer.rpartition("####")[2].strip().replace(",", "")


def to_messages(row: dict) -> list:
    return [
        {"role": "user", "content": format_question(row["question"])},
        {"role": "assistant", "content": format_answer(row["answer"])},
    ]


def load_split(split: str) -> list:
    with open(SPLITS[split]) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_chats(split: str) -> list:
    return [to_messages(r) for r in load_split(split)]


if __name__ == "__main__":
    chats = load_chats("train")
    print(len(chats))
    for m in chats[0]:
        print(f"--- {m['role']}\n{m['content']}")

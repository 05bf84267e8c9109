"""More GSM8K-style training problems for the embedded target, with arithmetic that is right.

The embedded target (7M parameters, trained on GSM8K train's 7,473 solutions) loops on 29% of the test
questions and cannot do the arithmetic (scripts/embedded/README.md). This script writes new problems from the
training set: a question's standalone integers of two or more digits get new values of as many digits (as
`perturb_questions.py` draws them; one-digit numbers and common implicit constants are kept), and its
solution is recomputed through the calculator annotations GSM8K solutions carry (`<<48/2=24>>24`): every
annotation is evaluated again with the new numbers, its result replaces the old one wherever the solution
uses it, and the final `#### N` follows. A problem is kept only when that is unambiguous and sound:

- every annotation of the original evaluates to its stated result (some GSM8K annotations do not);
- no number stands for two things (a question number equal to an intermediate result, say);
- results stay positive, and whole where the original was whole (no 3.5 people);
- the final answer is one of the recomputed numbers.

Held-out questions of the drafter's split can be skipped (`--holdout-from`), as in `perturb_questions.py`.
`--check` recomputes every solution with its own numbers and reports how many come back unchanged: the
recomputation is then an identity on them, which is what makes the new solutions trustworthy.

    python scripts/embedded/augment_gsm8k.py --copies 4 --seed 0 --out runs/embedded/gsm8k_train_augmented.jsonl
    python scripts/embedded/augment_gsm8k.py --check
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
import sys
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perturb_questions import INTEGER, new_number  # noqa: E402

QUESTIONS = Path(__file__).resolve().parent / "data" / "gsm8k_train.jsonl"
# an annotation, or a number in the text (digit groups with commas, decimals)
TOKEN = re.compile(r"<<([^<>=]*)=([^<>]*)>>|(?<![\w.,:])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)(?![\d:])")
NUMBER_IN_EXPR = re.compile(r"(?<![\d.])\d+(?:\.\d+)?")  # ".15" stays a constant: a rate, not a number
# Solutions bring numbers the question does not state (twice = 2, a week = 7 days, an hour = 60 minutes, a
# dozen = 12, percent = 100, ...). A question number equal to one of them could not be told apart from it, so
# only numbers of two or more digits that are not such constants get new values.
_IMPLICIT = {10, 12, 20, 24, 30, 31, 36, 48, 52, 60, 100, 360, 365, 1000}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class Rejected(Exception):
    """This problem cannot be recomputed soundly; it is left out."""


def evaluate(expr: str) -> Fraction:
    """Exact value of a calculator expression: numbers, + - * /, parentheses."""
    def walk(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise Rejected("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))
        raise Rejected(f"unsupported expression {expr!r}")

    try:
        return walk(ast.parse(expr.replace(",", "").strip(), mode="eval"))
    except (SyntaxError, ValueError, TypeError) as err:
        raise Rejected(f"unparsable expression {expr!r}: {err}") from None


def parse_number(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def format_number(value: Fraction, like: str) -> str:
    """`value` written as the original number `like` was: digit groups, decimals and a leading dot alike."""
    decimals = len(like.partition(".")[2])
    if value.denominator == 1 and not decimals:
        return f"{value.numerator:,}" if "," in like else str(value.numerator)
    text = f"{float(value):{',' if ',' in like else ''}.{max(decimals, 1)}f}"
    if Fraction(text.replace(",", "")) != value:  # 10/3 and the like: not something a GSM8K solution would write
        raise Rejected(f"{value} has no short decimal form")
    if like.startswith(".") and text.startswith("0."):
        text = text[1:]
    return text


class Renumbering:
    """old number (exact value) -> new number, extended as annotations are recomputed."""

    def __init__(self, mapping: dict[Fraction, Fraction]):
        self.mapping = dict(mapping)

    def get(self, old: Fraction) -> Fraction:
        return self.mapping.get(old, old)  # constants the solution brings (2, 60, 100, ...) stay

    def bind(self, old: Fraction, new: Fraction) -> None:
        if old in self.mapping and self.mapping[old] != new:
            raise Rejected(f"{old} would stand for both {self.mapping[old]} and {new}")
        self.mapping[old] = new


def check_recomputable(answer: str, renumbering: Renumbering) -> None:
    """Refuse solutions that compute where the calculator does not see it."""
    outside = re.sub(r"<<[^<>]*>>", "<<>>", answer)
    if re.search(r"=(?!\s*\$?\s*<<)", outside.rpartition("####")[0]):
        raise Rejected("a computation without an annotation")
    changed = {old for old, new in renumbering.mapping.items() if old != new}
    in_expressions = {parse_number(n) for expr in re.findall(r"<<([^<>=]*)=", answer)
                      for n in NUMBER_IN_EXPR.findall(expr)}
    if changed - in_expressions:  # worked on in text the calculator never saw (algebra, say)
        raise Rejected("a changed number is used outside the annotations")
    if re.search(r"\d \d{3}\b", answer):  # "14 400": a digit group the text cannot be matched on
        raise Rejected("a number written with spaces")


def recompute(answer: str, renumbering: Renumbering) -> str:
    """The solution with every annotation evaluated again (in order) and then every number renumbered."""
    check_recomputable(answer, renumbering)
    annotations = {}  # (start, end) -> the recomputed annotation text
    for match in re.finditer(r"<<([^<>=]*)=([^<>]*)>>", answer):
        expr, stated = match.group(1), match.group(2).strip()
        if not re.search(r"[-+*/]", expr.strip().lstrip("-")):
            raise Rejected("an annotation without arithmetic")
        old_value = evaluate(expr)
        try:
            stated_value = parse_number(stated)
        except (ValueError, ZeroDivisionError):
            raise Rejected(f"unparsable result {stated!r}") from None
        if old_value != stated_value:
            raise Rejected(f"the original annotation is wrong: {expr} = {old_value}, not {stated}")
        new_expr = NUMBER_IN_EXPR.sub(
            lambda m: format_number(renumbering.get(parse_number(m.group(0))), m.group(0)), expr)
        new_value = evaluate(new_expr)
        if new_value <= 0 < old_value or (old_value.denominator == 1) != (new_value.denominator == 1):
            raise Rejected(f"{new_expr} = {new_value}: not like the original's {old_value}")
        renumbering.bind(old_value, new_value)
        annotations[match.span()] = f"<<{new_expr}={format_number(new_value, stated)}>>"
    out, last = [], 0  # now every result is known: numbers written before their annotation follow too
    for match in TOKEN.finditer(answer):
        out.append(answer[last:match.start()])
        last = match.end()
        if match.span() in annotations:
            out.append(annotations[match.span()])
            continue
        number = match.group(3)
        new = renumbering.get(parse_number(number))
        if new <= 0 < parse_number(number):
            raise Rejected("a number became zero or negative")
        out.append(format_number(new, number))
    out.append(answer[last:])
    text = "".join(out)
    original_final = parse_number(answer.rpartition("####")[2].strip())
    if original_final not in renumbering.mapping:
        raise Rejected("the final answer is not one of the recomputed numbers")
    return text


def question_renumbering(question: str, rng: random.Random) -> tuple[str, Renumbering]:
    """New numbers for the question's standalone integers, and the renumbering they start."""
    mapping: dict[str, str] = {}

    def replace(match: re.Match) -> str:
        text = match.group(0)
        if text not in mapping:
            percent = re.match(r"\s*(%|percent)", question[match.end():]) is not None  # solutions use it as .15
            keep = text.startswith("0") or int(text) < 10 or int(text) in _IMPLICIT or percent
            mapping[text] = text if keep else str(new_number(int(text), rng))
        return mapping[text]

    new_question = INTEGER.sub(replace, question)
    if len(set(mapping.values())) < len(mapping):  # "40 out of the 40 games": two numbers became one
        raise Rejected("two numbers of the question became the same")
    renumbering = Renumbering({})
    for old, new in mapping.items():
        renumbering.bind(Fraction(old), Fraction(new))
    return new_question, renumbering


def augment(row: dict, rng: random.Random) -> dict:
    question, renumbering = question_renumbering(row["question"], rng)
    if question == row["question"]:
        raise Rejected("no number to change")
    return {"question": question, "answer": recompute(row["answer"], renumbering)}


def identity_check(rows: list[dict]) -> tuple[int, int]:
    """(recomputable, unchanged): solutions recomputed with their own numbers, and how many came back equal."""
    ok = same = 0
    for row in rows:
        try:
            text = recompute(row["answer"], Renumbering({}))
        except Rejected:
            continue
        ok += 1
        same += text == row["answer"]
    return ok, same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", default=str(QUESTIONS))
    p.add_argument("--out", help="JSONL of new {question, answer} rows (GSM8K format)")
    p.add_argument("--copies", type=int, default=1, help="new problems drawn per training problem")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--holdout-from", action="store_true",
                   help="skip the drafter's held-out questions (its config's seed 0, fraction 0.02)")
    p.add_argument("--check", action="store_true", help="recompute every solution with its own numbers")
    a = p.parse_args()
    rows = [json.loads(line) for line in open(a.questions) if line.strip()]
    if a.check:
        ok, same = identity_check(rows)
        print(f"{ok} of {len(rows)} solutions recompute; {same} of those come back unchanged")
        return
    if not a.out:
        p.error("--out is required (or --check)")
    skip: set[int] = set()
    if a.holdout_from:
        from dflash.training.data import split_examples

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        skip = set(split_examples(list(range(len(rows))), 0.02, 0)[1])
    rng = random.Random(a.seed)
    written, reasons = 0, {}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for _ in range(a.copies):
            for i, row in enumerate(rows):
                if i in skip:
                    continue
                try:
                    new = augment(row, rng)
                except Rejected as err:
                    kind = str(err).split(":")[0][:40]
                    reasons[kind] = reasons.get(kind, 0) + 1
                    continue
                f.write(json.dumps(new) + "\n")
                written += 1
    tried = a.copies * (len(rows) - len(skip))
    print(f"wrote {written} of {tried} problems to {a.out}; left out: "
          + ", ".join(f"{n} {k}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:6]))


if __name__ == "__main__":
    main()

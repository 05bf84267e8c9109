"""Prompts from outside GSM8K (code, writing, explanations), made from templates, none from a benchmark set.

Phase 6 of the target (unlikelihood against its own GSM8K loops) fell into one-token loops on code prompts it
had never been trained near; the target's own answers to these prompts, kept in its likelihood data, anchor its
behaviour there (scripts/embedded/README.md). A quarter of the draws are long prompts holding code, in the two
forms the bench gives code tasks (a fenced function stub with doctests, a task with assert lines), since the
collapse followed that form; the rest are short one-line requests, which repeat, so the code prompts are most of
the distinct ones (541 of 724 at --n 2000). One JSON object per line with a `prompt`, for `dflash datagen`.

    python scripts/embedded/ood_prompts.py --n 2000 --seed 0 --out runs/embedded/ood_prompts.jsonl
"""
import argparse
import json
import random

from dflash.bench.datasets import humaneval_prompt, mbpp_prompt

FUNCTIONS = ["sum", "maximum", "minimum", "average", "product", "number of even values", "second largest value",
             "sorted copy", "reverse", "number of distinct values", "running total", "median", "last element"]
STRING_TASKS = ["reverses a string", "counts the vowels in a string", "checks whether a string is a palindrome",
                "capitalizes every word of a sentence", "removes the spaces from a string",
                "returns the longest word of a sentence", "counts how often each character occurs"]
TOPICS = ["photosynthesis", "the water cycle", "how a bicycle works", "why the sky is blue", "compound interest",
          "the rules of chess", "how vaccines work", "the French revolution", "black holes", "recursion",
          "a hash table", "the stock market", "climate change", "the human heart", "machine learning"]
FORMS = ["a short poem", "a haiku", "a short story", "a product description", "an email to a colleague",
         "a tweet", "a limerick", "a short speech"]
HABITS = ["studying", "cooking", "running", "sleeping well", "saving money"]
SUBJECTS = ["the ocean", "a rainy day", "a new phone", "a lost dog", "a team meeting", "autumn", "a coffee shop",
            "a mountain hike", "a birthday", "a robot"]


# Long prompts that hold code, in the two forms the bench gives code tasks (a fenced function stub with doctests,
# and a task with assert lines); the functions are this file's own, with examples computed from random inputs.
TASKS = [  # (name, what it does, the function)
    ("sum_of_squares", "return the sum of the squares of the numbers in the list", lambda xs: sum(x * x for x in xs)),
    ("count_even", "count how many numbers in the list are even", lambda xs: sum(x % 2 == 0 for x in xs)),
    ("largest_gap", "return the largest difference between two neighbouring numbers",
     lambda xs: max(abs(a - b) for a, b in zip(xs, xs[1:]))),
    ("first_over_ten", "return the first number greater than ten, or -1 if there is none",
     lambda xs: next((x for x in xs if x > 10), -1)),
    ("double_all", "return a new list with every number doubled", lambda xs: [2 * x for x in xs]),
    ("remove_odd", "return the list without its odd numbers", lambda xs: [x for x in xs if x % 2 == 0]),
    ("running_max", "return the running maximum of the list", lambda xs: [max(xs[:i + 1]) for i in range(len(xs))]),
    ("alternate_sum", "add the numbers at even positions and subtract the ones at odd positions",
     lambda xs: sum(x if i % 2 == 0 else -x for i, x in enumerate(xs))),
    ("count_above_mean", "count the numbers that are above the mean of the list",
     lambda xs: sum(x > sum(xs) / len(xs) for x in xs)),
    ("unique_sorted", "return the distinct numbers of the list in increasing order", lambda xs: sorted(set(xs))),
]


def inputs(rng: random.Random) -> list[int]:
    return [rng.randint(0, 20) for _ in range(rng.randint(3, 7))]


def code_prompt(rng: random.Random) -> str:
    name, what, fn = rng.choice(TASKS)
    cases = [inputs(rng) for _ in range(rng.randint(2, 3))]
    if rng.random() < 0.5:  # a fenced stub with doctests
        doctests = "".join(f"    >>> {name}({xs})\n    {fn(xs)}\n" for xs in cases)
        stub = (f"from typing import List\n\n\ndef {name}(numbers: List[int]):\n    \"\"\" Given a list of "
                f"integers, {what}.\n{doctests}    \"\"\"\n")
        return humaneval_prompt(stub)
    return mbpp_prompt(f"Write a function to {what}.", [f"assert {name}({xs}) == {fn(xs)}" for xs in cases])


def prompt(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind >= 6:
        return code_prompt(rng)
    if kind == 0:
        return f"Write a Python function that returns the {rng.choice(FUNCTIONS)} of a list of numbers."
    if kind == 1:
        return f"Write a Python function that {rng.choice(STRING_TASKS)}. Include a few test cases."
    if kind == 2:
        return f"Explain {rng.choice(TOPICS)} in simple terms."
    if kind == 3:
        return f"Write {rng.choice(FORMS)} about {rng.choice(SUBJECTS)}."
    if kind == 4:
        return (f"def {rng.choice(['solve', 'helper', 'compute', 'check'])}(values):\n    \"\"\"Return the "
                f"{rng.choice(FUNCTIONS)} of values.\"\"\"\n\nComplete this function.")
    return f"What are {rng.randint(2, 5)} tips for {rng.choice(HABITS)}?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=800, help="prompts drawn; duplicates are dropped")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = sorted({prompt(rng) for _ in range(args.n)})
    with open(args.out, "w") as out:
        for text in prompts:
            out.write(json.dumps({"prompt": text}) + "\n")
    print(f"wrote {len(prompts)} distinct prompts to {args.out}")


if __name__ == "__main__":
    main()

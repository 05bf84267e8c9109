"""Prompts from outside GSM8K (code, writing, explanations), made from templates, none from a benchmark set.

Phase 6 of the target (unlikelihood against its own GSM8K loops) fell into one-token loops on code prompts it
had never been trained near; the target's own answers to these prompts, kept in its likelihood data, anchor its
behaviour there (scripts/embedded/README.md). One JSON object per line with a `prompt`, for `dflash datagen`.

    python scripts/embedded/ood_prompts.py --n 800 --seed 0 --out runs/embedded/ood_prompts.jsonl
"""
import argparse
import json
import random

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


def prompt(rng: random.Random) -> str:
    kind = rng.randrange(6)
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
    ap.add_argument("--n", type=int, default=800, help="prompts drawn; duplicates are dropped (the templates "
                    "make 187 distinct ones at --n 1500)")
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

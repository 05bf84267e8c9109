"""The loop criterion of the embedded target's evaluation: an n-gram of its answer occurring k or more times,
or no EOS (eval_target.py calibrates n and k on the human reference answers: N and K below)."""
from collections import Counter

N, K = 10, 3  # the calibrated criterion: a 10-gram 3+ times (eval_target.py's strict one is a 6-gram)


def repeats(body, n, k):
    """Whether some n-gram of `body` occurs k or more times."""
    grams = Counter(tuple(body[i : i + n]) for i in range(len(body) - n + 1))
    return bool(grams) and max(grams.values()) >= k


def is_loop(gen_ids, eos_id, n=N, k=K):
    """(whether a generated answer loops, why): it never reached EOS, or its text before EOS repeats an n-gram
    k+ times."""
    if eos_id not in gen_ids:
        return True, "no-eos"
    return repeats(gen_ids[: gen_ids.index(eos_id)], n, k), "ngram"


def looping_positions(body, n, k):
    """Indices of `body` covered by the k-th or a later occurrence of an n-gram: the text that makes
    `repeats(body, n, k)` true (empty when it is false)."""
    seen: Counter = Counter()
    covered = set()
    for i in range(len(body) - n + 1):
        gram = tuple(body[i : i + n])
        seen[gram] += 1
        if seen[gram] >= k:
            covered.update(range(i, i + n))
    return sorted(covered)

"""The loop criterion of the embedded target's evaluation: an n-gram of its answer occurring k or more times
(eval_target.py calibrates n and k on the human reference answers)."""
from collections import Counter


def repeats(body, n, k):
    """Whether some n-gram of `body` occurs k or more times."""
    grams = Counter(tuple(body[i : i + n]) for i in range(len(body) - n + 1))
    return bool(grams) and max(grams.values()) >= k


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

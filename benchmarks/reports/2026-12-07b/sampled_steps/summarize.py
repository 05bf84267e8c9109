"""Medians of `runs*.txt` (benchmarks/batched_step.py lines, each prefixed with old or new) by setting and shape."""
import collections
import json
import statistics as st
import sys

rows = collections.defaultdict(list)
for path in sys.argv[1:]:
    for line in open(path):
        if line.startswith("#"):
            continue
        name, js = line.split(" ", 1)
        r = json.loads(js)
        key = ("seeded" if r["seed"] is not None else "unseeded", r["rows"], r["block_size"])
        rows[(key, name)].append(r["step_ms"])
for key in sorted({k for k, _ in rows}):
    old, new = rows[(key, "old")], rows[(key, "new")]
    print(f"{key[0]:8s} rows {key[1]} block {key[2]:2d}: old {st.median(old):6.2f} ms {old}  "
          f"new {st.median(new):6.2f} ms {new}")

import collections
import gzip
import json
import statistics as st
import sys

opener = gzip.open if sys.argv[1].endswith(".gz") else open
rows = [json.loads(line) for line in opener(sys.argv[1], "rt")]
d = [r for r in rows if r["ev"] == "draft"]
t = [r for r in rows if r["ev"] == "time"]
print("drafted steps", len(d), "timed", len(t))
# threshold and break-even by running rows
by = collections.defaultdict(list)
for r in d:
    by[r["running"]].append(r)
print(
    "running | n | be mean [min..max] | thr mean [min..max] | k_be counts | drafted_cal plain_cal ms | xd xp ms | acc mean"  # noqa: E501
)
for n in sorted(by):
    g = by[n]
    be = [r["be"] for r in g]
    th = [r["thr"] for r in g]
    ks = collections.Counter(r["k_be"] for r in g)
    acc = [a for r in g for a in r["acc"]]
    xd = [r["xd"] for r in g if r["xd"] is not None]
    xp = [r["xp"] for r in g if r["xp"] is not None]
    print(
        f"{n:2d} | {len(g):5d} | {st.mean(be):.2f} [{min(be):.2f}..{max(be):.2f}] | {st.mean(th):.2f} [{min(th):.2f}..{max(th):.2f}] | {dict(ks)} | "  # noqa: E501
        f"{st.mean(r['drafted_cal'] for r in g) * 1e3:.1f} {st.mean(r['plain_cal'] for r in g) * 1e3:.1f} | "
        f"{st.mean(xd) * 1e3 if xd else float('nan'):.1f} {st.mean(xp) * 1e3 if xp else float('nan'):.1f} | {st.mean(acc):.2f}"  # noqa: E501
    )
# measured step time vs calibrated by (rows,k,ad)
bt = collections.defaultdict(list)
for r in t:
    bt[(r["rows"], r["k"], r["ad"])].append((r["s"], r["cal"]))
print("rows k ad | n | measured median ms | cal ms | extra median ms")
for key in sorted(bt):
    g = bt[key]
    if len(g) < 5:
        continue
    print(
        key,
        len(g),
        f"{st.median(s for s, _ in g) * 1e3:.1f} {g[0][1] * 1e3:.1f} {st.median(s - c for s, c in g) * 1e3:.1f}",
    )
# the threshold over drafted steps of 8 drafting rows (the README's "1.75 on average")
full = [r["thr"] for r in d if r["drows"] == 8]
if full:
    print(
        f"steps of 8 drafting rows: {len(full)}, threshold mean {st.mean(full):.2f} [{min(full):.2f}..{max(full):.2f}]"
    )

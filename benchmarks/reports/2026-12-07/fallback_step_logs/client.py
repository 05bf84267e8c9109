import asyncio
import json
import random
import sys
import time

import httpx

URL = "http://127.0.0.1:18431"
qs = [json.loads(line)["question"] for line in open("/tmp/review_fallback/dflash/bench/data/gsm8k/test.jsonl")]
PHASES = [(int(c), float(d)) for c, d in (p.split(":") for p in sys.argv[1].split(","))]  # conc:seconds
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
out = open(sys.argv[3] if len(sys.argv) > 3 else "/tmp/fbwork/phases.jsonl", "a", buffering=1)
T_start = time.time()


async def one(client, q, max_tokens=200):
    body = {
        "model": "dflash",
        "messages": [
            {"role": "user", "content": q + "\nPlease reason step by step, and put your final answer within \\boxed{}."}
        ],
        "max_tokens": max_tokens,
        "temperature": temp,
    }
    r = await client.post(URL + "/v1/chat/completions", json=body, timeout=600)
    return r.json()["usage"]["completion_tokens"]


async def metrics(client):
    txt = (await client.get(URL + "/metrics")).text
    return {
        line.split(" ")[0]: line.split(" ")[-1]
        for line in txt.splitlines()
        if line.startswith("dflash:fallback")
        or line.startswith("dflash:num_requests_running")
        or line.startswith("dflash:step_overhead")
    }


async def main():
    async with httpx.AsyncClient() as client:
        for conc, dur in PHASES:
            t0 = time.time()
            toks = 0
            n = 0
            end = t0 + dur

            async def worker():
                nonlocal toks, n
                while time.time() < end:  # noqa: B023 (awaited within the phase)
                    got = await one(client, random.choice(qs))
                    toks += got
                    n += 1

            tasks = [asyncio.create_task(worker()) for _ in range(conc)]
            while not all(t.done() for t in tasks):
                await asyncio.sleep(2)
                m = await metrics(client)
                out.write(json.dumps(dict(t=time.time() - T_start, conc=conc, m=m)) + "\n")
            dt = time.time() - t0
            print(f"conc {conc}: {n} requests {toks} tokens in {dt:.1f}s = {toks / dt:.1f} tok/s", flush=True)


asyncio.run(main())

#!/bin/bash
# usage: start.sh LOGNAME extra-args...
name=$1; shift
cd /tmp/fbwork
PYTHONPATH=/tmp/review_fallback OMP_NUM_THREADS=1 FBLOG=/tmp/fbwork/$name.jsonl nohup /work/venv/bin/python serve_logged.py serve --host 127.0.0.1 --port 18431 --log-level info "$@" > $name.log 2>&1 &
echo $! > server.pid
for i in $(seq 60); do sleep 2; grep -q "Uvicorn running" $name.log && break; done
grep "step times" $name.log | sed 's/.*measured/measured/'

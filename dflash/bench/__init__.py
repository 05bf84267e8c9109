"""`dflash bench`: speedup, acceptance and throughput of DFlash on the standard datasets.

    dflash bench --dataset gsm8k math500 --max-samples 20 --output-dir runs/bench     # local, in process
    dflash bench --base-url http://127.0.0.1:8000/v1 --concurrency 1,4,8               # any OpenAI server
"""

from dflash.bench.datasets import DATASETS, DataOptions, Sample, load_samples
from dflash.bench.metrics import BenchResult
from dflash.bench.runner import BenchConfig, run_bench

__all__ = ["DATASETS", "BenchConfig", "BenchResult", "DataOptions", "Sample", "load_samples", "run_bench"]

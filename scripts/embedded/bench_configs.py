"""Measure CPU forward cost of candidate target configs (torch threads = 2).

For each config: 1-token decode step and 16-token block step, both with a KV cache
holding ~200 tokens of context, plus a rough training throughput (fwd+bwd, fp32).
Usage: python scripts/embedded/bench_configs.py
"""
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(2)



def _cfg(layers, hidden, heads, mlp):
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=2, intermediate_size=mlp)


CANDIDATES = {
    "8x256": _cfg(8, 256, 4, 768),
    "12x256": _cfg(12, 256, 4, 768),
    "6x384": _cfg(6, 384, 6, 1152),
    "8x384": _cfg(8, 384, 6, 1152),
}


def make(cfg):
    c = Qwen3Config(vocab_size=4096, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True, **cfg)
    return Qwen3ForCausalLM(c).eval()


def time_step(model, n_new, ctx=200, reps=30):
    ids = torch.randint(5, 4096, (1, ctx))
    new = torch.randint(5, 4096, (1, n_new))
    ts = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        base = getattr(out, "cache", None) or out.past_key_values
        for _ in range(reps + 5):
            cache = base
            # crop back to ctx so every step sees the same context length
            t0 = time.perf_counter()
            model(new, cache=cache, use_cache=True)
            ts.append(time.perf_counter() - t0)
            cache.crop(-n_new)
    ts = sorted(ts[5:])
    return ts[len(ts) // 2] * 1000


def train_tps(model, bs=8, seq=256, reps=3):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(5, 4096, (bs, seq))
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ts.append(time.perf_counter() - t0)
    model.eval()
    return bs * seq / (sum(ts[1:]) / reps)


if __name__ == "__main__":
    for name, cfg in CANDIDATES.items():
        m = make(cfg)
        n = sum(p.numel() for p in m.parameters())
        t1 = time_step(m, 1)
        t16 = time_step(m, 16)
        tps = train_tps(m)
        print(f"{name}: params {n/1e6:.2f}M  1-tok {t1:.2f} ms  16-tok {t16:.2f} ms  "
              f"ratio {t16/t1:.2f}  train {tps:.0f} tok/s", flush=True)

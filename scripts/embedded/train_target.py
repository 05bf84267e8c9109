"""Train the embedded DFlash target (a tiny Qwen3ForCausalLM) from scratch on GSM8K chats.

Config choice (measured with scripts/embedded/bench_configs.py, torch threads = 2, ~200 ctx):
    8x256  7.35M params  1-tok 6.2 ms  16-tok 8.9 ms  (x1.43)  train ~2200 tok/s
    12x256 10.5M         1-tok 8.8 ms  16-tok 12.4 ms (x1.41)  train ~1570 tok/s
    6x384  11.9M         1-tok 7.2 ms  16-tok 11.0 ms (x1.52)  train ~1990 tok/s
    8x384  15.3M         1-tok 9.1 ms  16-tok 13.2 ms (x1.45)  train ~1390 tok/s
We use 8 layers x hidden 256 (4 heads x head_dim 64, 2 KV heads, MLP 768): it trains fastest
on 2 cores (needed for ~40 min convergence), and its decode step is dominated by per-layer
overhead (a 16-token verify block costs only ~1.4x a 1-token step), which is the regime where
block speculative decoding pays off. Deeper-narrow beats wider-shallow on that ratio.

Training: fp32, AdamW, linear warmup + cosine decay, length-bucketed batches, loss on all
non-pad tokens. The cosine horizon is either --steps (exactly reproducible), or, with
--steps 0, a wall-clock budget --time-budget (seconds of training compute): the cosine
progress is train_time / budget, so the schedule completes even if the shared CPU slows
down. The number of steps actually run is logged, so a rerun can use --steps.
Checkpoints (model + optimizer) go to --ckpt-dir every --save-every steps; --resume
continues from the latest one.

Usage (the exact phase-1 command sequence of the shipped target is in scripts/embedded/README.md):
    python scripts/embedded/train_target.py --time-budget 2400 --ckpt-dir runs/embedded/target_checkpoints \
        --out runs/embedded/target_export
"""
import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loops import K, N, looping_positions  # noqa: E402
from prepare_data import load_chats, to_messages  # noqa: E402
from train_tokenizer import save_portable  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ASSET_DIR = ROOT / "dflash" / "assets" / "target"

MODEL_CFG = dict(
    num_hidden_layers=8,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    attention_dropout=0.0,
)


def build_config(tok, layers: int = MODEL_CFG["num_hidden_layers"]):
    return Qwen3Config(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **{**MODEL_CFG, "num_hidden_layers": layers},
    )


def load_init_weights(model, source: str) -> None:
    """The weights of a checkpoint .pt written by this script or of an exported model directory; a model with
    fewer layers than the source takes its first layers (a draft model grown from the target's bottom)."""
    if Path(source).is_dir():  # an exported model (e.g. dflash/assets/target): its weights, in fp32
        state = Qwen3ForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    else:
        state = torch.load(source, weights_only=False)["model"]
    layers = model.config.num_hidden_layers
    state = {k: v for k, v in state.items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    model.load_state_dict(state)


def encode_chats(tok, chats, max_len):
    """Return list of (input_ids, labels) with labels = -100 outside assistant content if asst_only."""
    out = []
    for chat in chats:
        prompt = tok.apply_chat_template(chat[:-1], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(chat, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        assert ids[: len(p_ids)] == p_ids
        # drop the trailing "\n" after <|im_end|>: the sequence ends on EOS
        if ids[-1] != tok.eos_token_id:
            ids = ids[: ids.index(tok.eos_token_id, len(p_ids)) + 1]
        out.append((ids[:max_len], len(p_ids)))
    return out


def make_batches(examples, max_tokens, shuffle=True, rng=None):
    rng = rng or random.Random(0)
    idx = list(range(len(examples)))
    if shuffle:
        keys = {i: len(examples[i][0]) + rng.uniform(-8, 8) for i in idx}
        idx.sort(key=keys.get)
    else:
        idx.sort(key=lambda i: len(examples[i][0]))
    batches, cur, cur_max = [], [], 0
    for i in idx:
        L = len(examples[i][0])
        if cur and max(cur_max, L) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        batches.append(cur)
    if shuffle:
        rng.shuffle(batches)
    return batches


def pad(seqs, pad_id):
    """Right-padded ids (b, L) and their attention mask (b, L)."""
    L = max(len(seq) for seq in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for r, seq in enumerate(seqs):
        ids[r, : len(seq)] = torch.tensor(seq)
        attn[r, : len(seq)] = 1
    return ids, attn


def collate(examples, batch, pad_id, asst_only):
    ids, attn = pad([examples[i][0] for i in batch], pad_id)
    labels = torch.full_like(ids, -100)
    for r, i in enumerate(batch):
        seq, plen = examples[i]
        lab = torch.tensor(seq)
        if asst_only:
            lab[:plen] = -100
        labels[r, : len(seq)] = lab
    return ids, attn, labels


def encode_loops(rows, max_len, n=N, k=K):
    """(ids, penalized positions) for the target's own looping answers (`dflash datagen` rows): the positions
    of the k-th and later occurrences of a repeated n-gram, the text the loop criterion of eval_target.py
    counts. Rows without such a repeat are left out."""
    out = []
    for row in rows:
        prompt, response = row["prompt_ids"], row["response_ids"]
        loop = [len(prompt) + i for i in looping_positions(response, n, k)]
        ids = (prompt + response)[:max_len]
        loop = [i for i in loop if i < len(ids)]
        if loop:
            out.append((ids, loop))
    return out


def unlikelihood_loss(model, loops, batch, pad_id):
    """Mean of -log(1 - p(token)) over the penalized tokens of a batch of looping answers: pushes down the
    probability of continuing a loop, in the context the target itself produced (Welleck et al., 2019)."""
    ids, attn = pad([loops[i][0] for i in batch], pad_id)
    rows = [r for r, i in enumerate(batch) for _ in loops[i][1]]
    cols = [c for i in batch for c in loops[i][1]]
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    logits = model(input_ids=ids, attention_mask=attn).logits  # (b, L, vocab)
    logp = torch.log_softmax(logits[rows_t, cols_t - 1].float(), dim=-1)  # (n, vocab): predicts position col
    p = logp.gather(1, ids[rows_t, cols_t][:, None]).squeeze(1).exp()  # (n,)
    return -torch.log1p(-p.clamp(max=1 - 1e-5)).mean()


@torch.no_grad()
def eval_loss(model, examples, pad_id, max_tokens=8192):
    """Mean token loss on assistant tokens (answer + EOS)."""
    model.eval()
    tot, n = 0.0, 0
    for b in make_batches(examples, max_tokens, shuffle=False):
        ids, attn, labels = collate(examples, b, pad_id, asst_only=True)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        tgt = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=-100, reduction="sum"
        )
        tot += loss.item()
        n += (tgt != -100).sum().item()
    model.train()
    return tot / n


def lr_at(step, warmup, progress, peak, min_ratio=0.05):
    """Linear warmup over `warmup` steps, then cosine over `progress` in [0, 1]."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, max(0.0, progress))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def export(model, tok, out_dir, store_dtype=torch.float16):
    """Save fp16 weights with config dtype float32 (loads in fp32 on CPU)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to(store_dtype)
    m.config.dtype = "float32"
    m.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=300,
    )
    m.save_pretrained(out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_portable(tok, out_dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=str(ASSET_DIR))
    ap.add_argument("--ckpt-dir", default="runs/embedded/target_checkpoints")
    ap.add_argument("--out", default=str(ASSET_DIR))
    ap.add_argument("--steps", type=int, default=0, help="total steps (0 = derive from --time-budget)")
    ap.add_argument("--time-budget", type=float, default=2400.0)
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch incl. padding")
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--asst-only", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the forward (fp32 master weights); "
                    "~2x faster on CPUs with AVX512-BF16/AMX")
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1,
                    help="start thread count; --adaptive-threads probes 1 vs 2 (cores are shared)")
    ap.add_argument("--adaptive-threads", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-at-step", type=int, default=0,
                    help="save a checkpoint and exit at this step (no final eval / export); the phase-1 "
                    "recipe in scripts/embedded/README.md changes the batch size at such points")
    ap.add_argument("--extra-train", nargs="*", default=[],
                    help="more training rows: GSM8K format ({question, answer}; e.g. augment_gsm8k.py output) or "
                    "chats ({messages}; e.g. select_own_answers.py output)")
    ap.add_argument("--no-references", action="store_true",
                    help="train on --extra-train only, without the GSM8K reference solutions")
    ap.add_argument("--unlikely", nargs="*", default=[],
                    help="`dflash datagen` output of this target: its answers that loop (a 10-gram 3+ times) "
                    "add an unlikelihood term on the looping tokens (the others are ignored)")
    ap.add_argument("--unlikely-weight", type=float, default=1.0)
    ap.add_argument("--unlikely-every", type=int, default=2, help="add the unlikelihood term every N steps")
    ap.add_argument("--layers", type=int, default=MODEL_CFG["num_hidden_layers"],
                    help="decoder layers (fewer than 8 with --init-from the target: a draft model for classic "
                         "speculative decoding, grown from the target's first layers)")
    ap.add_argument("--init-from", default="", help="start a new phase (fresh optimizer and schedule) from "
                    "the weights of a checkpoint .pt written by this script or of an exported model directory")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    chats = [] if args.no_references else load_chats("train")
    for path in args.extra_train:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        chats += [row["messages"] if "messages" in row else to_messages(row) for row in rows]
    if not chats:
        sys.exit("no training chats: give --extra-train files, or drop --no-references")
    train = encode_chats(tok, chats, args.max_len)
    val = encode_chats(tok, load_chats("test"), args.max_len)
    loops = encode_loops([json.loads(line) for path in args.unlikely for line in open(path) if line.strip()],
                         args.max_len)
    if loops:
        print(f"unlikelihood on {len(loops)} looping answers, {sum(len(p) for _, p in loops)} tokens", flush=True)
    loop_batches = []
    val_sub = random.Random(1).sample(val, 200)
    n_tok = sum(len(s) for s, _ in train)
    print(f"train {len(train)} chats / {n_tok} tokens, val {len(val)}", flush=True)

    model = Qwen3ForCausalLM(build_config(tok, args.layers))
    model.train()
    print(f"params {sum(p.numel() for p in model.parameters())/1e6:.2f}M", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    step, total, epoch = 0, args.steps, 0
    warm_time = None
    seen_tokens, train_time = 0, 0.0
    if args.init_from and not (args.resume and (ckpt_dir / "last.pt").exists()):
        load_init_weights(model, args.init_from)
        print(f"initialised weights from {args.init_from}", flush=True)
    if args.resume and (ckpt_dir / "last.pt").exists():
        st = torch.load(ckpt_dir / "last.pt", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, total, epoch = st["step"], st["total"], st["epoch"]
        warm_time = st.get("warm_time")
        seen_tokens, train_time = st.get("seen_tokens", 0), st.get("train_time", 0.0)
        rng.setstate(st["rng"])
        print(f"resumed at step {step}/{total}", flush=True)

    def save():
        torch.save(
            dict(model=model.state_dict(), opt=opt.state_dict(), step=step, total=total, epoch=epoch,
                 seen_tokens=seen_tokens, train_time=train_time, warm_time=warm_time,
                 rng=rng.getstate(), args=vars(args)),
            ckpt_dir / "last.pt.tmp",
        )
        (ckpt_dir / "last.pt.tmp").replace(ckpt_dir / "last.pt")

    spt_ema = {}
    probe = {"every": 50, "next": step + 50, "last": -1}  # exponential back-off of 2-thread probes
    batches = []
    t_start = time.time()
    log_loss, log_n = 0.0, 0
    log_ul, log_ul_n = 0.0, 0
    while (step < total) if args.steps else (train_time < args.time_budget):
        if not batches:
            batches = make_batches(train, args.max_tokens, rng=rng)
            epoch += 1
        b = batches.pop()
        ids, attn, labels = collate(train, b, tok.pad_token_id, args.asst_only)
        if args.steps:
            progress = (step - args.warmup) / max(1, total - args.warmup)
        else:
            progress = (train_time - (warm_time or 0.0)) / max(1.0, args.time_budget - (warm_time or 0.0))
        lr = lr_at(step, args.warmup, progress, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            total_loss, step_tokens = loss, int(attn.sum())
            if loops and step % args.unlikely_every == 0:
                if not loop_batches:
                    loop_batches = make_batches(loops, args.max_tokens, rng=rng)
                loop_batch = loop_batches.pop()
                step_tokens += sum(len(loops[i][0]) for i in loop_batch)
                ul = unlikelihood_loss(model, loops, loop_batch, tok.pad_token_id)
                log_ul += ul.item()
                log_ul_n += 1
                total_loss = loss + args.unlikely_weight * ul
        total_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.time() - t0
        train_time += dt
        seen_tokens += int(attn.sum())
        if args.adaptive_threads:
            # On a shared 2-core box, 2 OpenMP threads are ~1.5x faster when the other core is
            # free but many times slower when it is busy (barrier stalls). Probe and switch.
            spt = dt / step_tokens  # per token forwarded, the unlikelihood batch's too
            cur = torch.get_num_threads()
            prev = spt_ema.get(cur)
            if cur == 2 and spt_ema.get(1) and spt > 0.9 * spt_ema[1]:
                torch.set_num_threads(1)
                probe["every"] = min(800, probe["every"] * 2) if probe["last"] == step else 50
                probe["next"] = step + probe["every"]
                print(f"step {step}: 2 threads slow ({spt*1e3:.2f} ms/tok) -> 1 thread, "
                      f"next probe in {probe['every']} steps", flush=True)
            elif cur == 1 and step >= probe["next"]:
                torch.set_num_threads(2)
                probe["last"] = step + 1
            elif cur == 2 and 1 not in spt_ema and step >= probe["next"]:
                torch.set_num_threads(1)  # started on 2 threads: measure 1 thread once to have a baseline
            spt_ema[cur] = spt if prev is None else 0.8 * prev + 0.2 * spt
        step += 1
        log_loss += loss.item()
        log_n += 1
        if step == args.warmup:
            warm_time = train_time
            if not args.steps:
                total = int(args.time_budget / (train_time / step))
                print(f"timing: {train_time/step:.3f} s/step -> ~{total} steps (time-based)", flush=True)
        if step % 20 == 0:
            el = time.time() - t_start
            print(f"step {step}/{total} ep {epoch} loss {log_loss/log_n:.4f} lr {lr:.2e} "
                  f"tok/s {seen_tokens/max(train_time,1e-9):.0f} elapsed {el:.0f}s"
                  + (f" unlikelihood {log_ul/log_ul_n:.4f}" if log_ul_n else ""), flush=True)
            log_loss, log_n = 0.0, 0
            log_ul, log_ul_n = 0.0, 0
        if step % args.eval_every == 0:
            print(f"step {step} val_loss(asst, 200 test) {eval_loss(model, val_sub, tok.pad_token_id):.4f}", flush=True)
        if step % args.save_every == 0:
            save()
        if args.stop_at_step and step >= args.stop_at_step:
            save()
            print(f"stopped at step {step} (train_time {train_time:.0f}s)", flush=True)
            return
    save()
    vl = eval_loss(model, val, tok.pad_token_id)
    print(f"done: {step} steps, {epoch} epochs, train_time {train_time:.0f}s, "
          f"{seen_tokens/train_time:.0f} tok/s, val_loss(asst, full test) {vl:.4f}", flush=True)
    export(model, tok, args.out)
    print(f"exported to {args.out}", flush=True)


if __name__ == "__main__":
    main()

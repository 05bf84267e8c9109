"""Evaluate the embedded DFlash target.

Reports
  (a) validation loss: mean cross-entropy over assistant tokens (answer + <|im_end|>) of all
      1,319 GSM8K test chats (formatted like training, teacher-forced);
  (b) loop share on the first N test questions, greedy-decoded (batch 1, chat template,
      max 300 new tokens), by two criteria. A response counts as a LOOP if
        - it emits no EOS (<|im_end|>) within the token limit, or
        - strict: any 6-gram of generated tokens occurs 3 or more times in it;
          calibrated: any 10-gram occurs 3 or more times.
      The strict one also flags 6.2% of the human GSM8K reference answers (formulaic phrases such as
      "find the total number of" recur in real solutions); the calibrated one flags 0.5% of them.
      Both rates on the references are printed too;
  (c) share of responses that end with a boxed answer ("...\\boxed{X}." then EOS), and the
      accuracy (boxed X equals the GSM8K reference number);
  (d) confidence: the mean probability the target gives each token of its own greedy answers, the
      figure a drafter's acceptance follows (a drafter can only match the choices the target is sure of);
  (e) repetition by criteria no training step uses (phase 6 trains against the calibrated one, so it
      needs a check it was not fitted to): an 8-gram 3+ times, a 15-gram twice, a line twice; each also
      on the references.
Prints 3 sample answers.

Usage: python scripts/embedded/eval_target.py [--model dflash/assets/target] [--n 100]
"""
import argparse
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loops import is_loop, repeats  # noqa: E402
from prepare_data import final_number, format_question, load_chats, load_split  # noqa: E402
from train_target import encode_chats, eval_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BOXED_END = re.compile(r"\\boxed\{([^{}]*)\}\.?\s*$")


def line_repeats(text):
    """Whether a non-empty line occurs twice (a restated step)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return len(set(lines)) < len(lines)


# (e): name -> (token ids of the answer before EOS, its text) -> bool
OTHER_CRITERIA = {
    "an 8-gram 3+ times": lambda ids, text: repeats(ids, 8, 3),
    "a 15-gram twice": lambda ids, text: repeats(ids, 15, 2),
    "a line twice": lambda ids, text: line_repeats(text),
}


def to_num(s):
    s = s.replace(",", "").replace("$", "").strip()
    try:
        return float(s)
    except ValueError:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "dflash" / "assets" / "target"))
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-loss", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    print(f"loaded {args.model}: dtype {next(model.parameters()).dtype}, "
          f"{sum(p.numel() for p in model.parameters())/1e6:.2f}M params", flush=True)
    eos = tok.eos_token_id
    test_chats = load_chats("test")

    if not args.skip_loss:
        val = encode_chats(tok, test_chats, 400)
        print(f"(a) val loss (assistant tokens, {len(val)} test chats): {eval_loss(model, val, tok.pad_token_id):.4f}",
              flush=True)

    rows = load_split("test")[: args.n]
    ref_texts = [chat[-1]["content"] for chat in test_chats]
    refs = [tok(text, add_special_tokens=False)["input_ids"] for text in ref_texts]
    for n_gram in (6, 10):
        flagged = sum(repeats(r, n_gram, 3) for r in refs)
        print(f"reference answers with a {n_gram}-gram 3+ times: {flagged}/{len(refs)} = {flagged/len(refs):.1%}")
    loops, why, boxed, correct, samples, n_tok = 0, Counter(), 0, 0, [], 0
    loops10, top1 = 0, 0.0
    other = Counter()
    t0 = time.time()
    for row in rows:
        msgs = [{"role": "user", "content": format_question(row["question"])}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**ids, do_sample=False, max_new_tokens=args.max_new_tokens,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id,
                                 output_scores=True, return_dict_in_generate=True)
        gen = out.sequences[0, ids["input_ids"].shape[1]:].tolist()
        top1 += sum(float(torch.softmax(step[0].float(), -1).max()) for step in out.scores)
        n_tok += len(gen)
        loop, reason = is_loop(gen, eos, n=6)  # strict
        loops10 += is_loop(gen, eos)[0]  # calibrated
        text = tok.decode(gen, skip_special_tokens=True)
        body = gen[: gen.index(eos)] if eos in gen else gen
        other.update(name for name, hit in OTHER_CRITERIA.items() if hit(body, text))
        m = BOXED_END.search(text)
        has_box = m is not None and (eos in gen)
        ok = False
        if has_box:
            boxed += 1
            a, b = to_num(m.group(1)), to_num(final_number(row["answer"]))
            ok = a is not None and b is not None and abs(a - b) < 1e-6
            correct += ok
        if loop:
            loops += 1
            why[reason] += 1
        if len(samples) < 3:
            samples.append((row["question"], text, final_number(row["answer"]), loop, ok))
    dt = time.time() - t0
    n = len(rows)
    print(f"(b) loop share, strict (6-gram): {loops}/{n} = {loops/n:.1%}  ({dict(why)})")
    print(f"(b) loop share, calibrated (10-gram): {loops10}/{n} = {loops10/n:.1%}")
    print(f"(c) ends with boxed answer + EOS: {boxed}/{n} = {boxed/n:.1%};  accuracy: {correct}/{n} = {correct/n:.1%}")
    print(f"(d) confidence: mean probability of its own greedy tokens {top1 / n_tok:.3f}")
    for name, hit in OTHER_CRITERIA.items():
        on_refs = sum(hit(ids, text) for ids, text in zip(refs, ref_texts))
        print(f"(e) {name}: {other[name]}/{n} = {other[name]/n:.1%}  (references: {on_refs/len(refs):.1%})")
    print(f"generation: {n_tok} tokens in {dt:.0f}s ({n_tok/dt:.1f} tok/s, HF generate, batch 1)")
    for q, a, ref, loop, ok in samples:
        print("=" * 70)
        print("Q:", q)
        print("-" * 70)
        print(a)
        print(f"-- ref {ref} | loop={loop} correct={ok}")


if __name__ == "__main__":
    main()

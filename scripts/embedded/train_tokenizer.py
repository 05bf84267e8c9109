"""Train the byte-level BPE tokenizer of the embedded target on GSM8K train text.

Usage: python scripts/embedded/train_tokenizer.py [--out dflash/assets/target] [--vocab 4096]
"""
import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash.model.loading import portable_tokenizer_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_data import load_chats  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|mask|>"]

# ChatML. Handles system / user / assistant roles, multi-turn, add_generation_prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def save_portable(tokenizer, out_dir) -> None:
    """`save_pretrained`, then the tokenizer_config.json in the form transformers 4.57 reads too (the package accepts
    transformers>=4.57; `dflash.model.loading.portable_tokenizer_config`)."""
    tokenizer.save_pretrained(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    config, _ = portable_tokenizer_config(json.loads(path.read_text()))
    path.write_text(json.dumps(config, indent=2) + "\n")


def corpus(chats):
    for chat in chats:
        for m in chat:
            yield m["content"]


def main():
    ap = argparse.ArgumentParser()
    root = Path(__file__).resolve().parents[2]
    ap.add_argument("--out", default=str(root / "dflash" / "assets" / "target"))
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    assert args.vocab % 64 == 0

    chats = load_chats("train")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(chats), trainer=trainer)
    print("vocab size", tok.get_vocab_size())

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<|pad|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    save_portable(fast, args.out)

    # sanity checks
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(args.out)
    ids = {s: t.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS}
    print("special ids", ids, "eos", t.eos_token_id, "pad", t.pad_token_id, "mask", t.mask_token_id)
    assert t.mask_token_id not in (t.pad_token_id, t.eos_token_id)
    assert t.eos_token_id == ids["<|im_end|>"]
    msgs = [{"role": "system", "content": "You are helpful."}, chats[0][0], chats[0][1],
            {"role": "user", "content": "And in June?"}]
    text = t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    print(text)
    enc = t(text, add_special_tokens=False)["input_ids"]
    assert t.decode(enc) == text, "round trip failed"
    for chat in chats[:500]:
        s = t.apply_chat_template(chat, tokenize=False)
        assert t.decode(t(s, add_special_tokens=False)["input_ids"]) == s
    lens = [len(t(t.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]) for c in chats]
    lens.sort()
    print("chat token lengths: max", lens[-1], "p99", lens[int(0.99 * len(lens))], "mean", sum(lens) / len(lens))


if __name__ == "__main__":
    main()

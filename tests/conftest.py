"""Tiny random targets of several families, drafters that fit them, and test proposers."""

from __future__ import annotations

import http.server
import json
import random
import socket
import threading
from pathlib import Path

import pytest
import torch

from dflash import hub
from dflash.decoding.engine import GenerationConfig, SpeculativeEngine
from dflash.decoding.proposer import DFlashProposer, Draft
from dflash.model.config import DFlash2Options, DrafterConfig, default_target_layer_ids
from dflash.model.drafter import DFlashDraftModel
from dflash.model.target import TargetModel

torch.set_num_threads(1)  # tiny models: one thread is fastest and never oversubscribes the machine

VOCAB = 128
HIDDEN = 64
LAYERS = 4
MASK_TOKEN_ID = VOCAB - 1
FAMILIES = ("qwen3", "llama", "qwen3_moe")  # the whole losslessness suite runs on each
# More families, each checked once for losslessness (tests/decoding/test_families.py): sliding windows narrower
# than the test sequences (alone, and alternating with full layers), soft-capping, absolute positions, partial
# rotary, NoPE layers, logit and residual scaling, multi-head latent attention (keys and values of other widths, or
# one compressed latent per token), attention sinks, mixtures of experts, learned positions.
MORE_FAMILIES = ("mistral", "qwen2", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt2", "gpt_neox", "granite",
                 "smollm3", "cohere2", "falcon", "bloom", "mpt", "gpt_neo", "deepseek_v3", "gpt_oss", "mixtral",
                 "gpt_bigcode", "opt", "phi")
# Families DFlash refuses up front: their layer state cannot be rolled back to the accepted tokens.
REFUSED_FAMILIES = ("qwen3_next", "lfm2", "llama4_text")
SLIDING_WINDOW = 8  # tokens; the test prompts and outputs are longer
_ALTERNATING = ["sliding_attention", "full_attention"]


def _family_fields(family: str, layers: int) -> dict:
    """Config fields of a tiny `family` model (transformers' model_type), on top of the shared ones."""
    window = dict(sliding_window=SLIDING_WINDOW)
    alternating = dict(layer_types=(_ALTERNATING * layers)[:layers], **window)
    return {
        "qwen3": {}, "llama": {}, "olmo2": {},
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                          mlp_only_layers=[]),
        "mistral": window,  # every layer slides
        "phi3": window,
        "qwen2": dict(use_sliding_window=True, max_window_layers=1, **window),  # full, then sliding layers
        "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                       **alternating),
        "gemma3_text": dict(final_logit_softcapping=30.0, query_pre_attn_scalar=16, **alternating),
        "cohere2": dict(logit_scale=0.5, **alternating),
        "gpt2": dict(n_inner=128),  # the shared fields reach its own names (n_embd, n_layer, ...)
        "gpt_neox": dict(rotary_pct=0.25),
        "granite": dict(embedding_multiplier=12.0, logits_scaling=0.5, residual_multiplier=0.22,
                        attention_multiplier=0.0625),
        "smollm3": dict(no_rope_layers=[int(i % 2 == 0) for i in range(layers)]),
        "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
        "bloom": {},  # ALiBi: positions come from the padding mask
        "mpt": dict(expansion_ratio=2),  # ALiBi by cache slot
        # local layers: windows of cache slots; num_layers, as transformers 4.57 checks the types against it first
        "gpt_neo": dict(attention_types=[[["global", "local"], layers // 2]] + [[["global"], 1]] * (layers % 2),
                        num_layers=layers, window_size=SLIDING_WINDOW),
        # multi-head latent attention: keys of 8 + 8 dims, values of 8; one latent of 16 per token (transformers 5)
        "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                            qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=64, first_k_dense_replace=1, n_group=1, topk_group=1),
        "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, **alternating),  # and attention sinks
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "gpt_bigcode": dict(n_inner=128, multi_query=True),  # one key/value head, absolute positions
        "opt": dict(ffn_dim=128, word_embed_proj_dim=HIDDEN),  # learned positions from the padding mask
        "phi": dict(partial_rotary_factor=0.5),  # attention and MLP side by side
        "qwen3_next": {},  # linear-attention layers
        "lfm2": dict(layer_types=(["conv", "full_attention"] * layers)[:layers]),
        "llama4_text": dict(attention_chunk_size=8, intermediate_size_mlp=128, num_local_experts=2,
                            layer_types=(["chunked_attention", "full_attention"] * layers)[:layers]),
    }[family]


def tiny_target_config(family: str = "qwen3", layers: int = LAYERS, vocab: int = VOCAB):
    """The config of a tiny random `family` model (transformers' model_type)."""
    from transformers import AutoConfig

    fields = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family in ("falcon", "bloom", "mpt", "deepseek_v3"):  # head_dim is derived
        del fields["head_dim"]
    fields.update(_family_fields(family, layers))
    return AutoConfig.for_model(family, **fields)


def tiny_target_model(family: str = "qwen3", seed: int = 0, layers: int = LAYERS, vocab: int = VOCAB):
    """A random causal LM with peaky logits (so float noise never flips an argmax)."""
    from transformers import AutoModelForCausalLM

    config = tiny_target_config(family, layers, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def tiny_drafter_config(target: TargetModel, layers: int = 1, block_size: int = 16) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=target.hidden_size, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=target.vocab_size, num_target_layers=target.num_layers,
        target_layer_ids=default_target_layer_ids(target.num_layers, layers), mask_token_id=MASK_TOKEN_ID,
        block_size=block_size, max_position_embeddings=1024,
    )


def tiny_drafter(target: TargetModel, layers: int = 1, block_size: int = 16, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(tiny_drafter_config(target, layers, block_size))
    drafter.init_weights()
    return drafter.eval()


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def target(family) -> TargetModel:
    return TargetModel(tiny_target_model(family))


def random_prompts(n: int, seed: int = 0, low: int = 3, high: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(low, high))] for _ in range(n)]


def hf_greedy(target, prompt: list[int], max_new: int) -> list[int]:
    """The target alone, decoded by transformers' own generate (an independent reference), on its device."""
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class OracleProposer(DFlashProposer):
    """Runs the real drafter (cache and all), then replaces its draft tokens with the target's own greedy
    continuation, kept correct for `correct(row)` tokens and corrupted after that.

    `references` maps a prompt (tuple) to the target-alone greedy output (prompt excluded).
    `correct`: None = every draft token right (whole blocks accepted); an int or a callable for partial.
    """

    def __init__(self, drafter, target, references: dict[tuple, list[int]], correct=None, seed: int = 0):
        super().__init__(drafter, target)
        self.references = references
        self.correct = correct
        self.rng = random.Random(seed)

    def with_block_size(self, block_size):
        clone = OracleProposer(self.drafter, self.target, self.references, self.correct)
        clone.rng = self.rng
        clone.block_size = block_size or self.block_size
        return clone

    def propose(self, state, anchors, anchor_positions, rows) -> Draft:
        draft = super().propose(state, anchors, anchor_positions, rows)
        k = draft.tokens.shape[1]
        for r, row in enumerate(rows):
            if tuple(row.prompt_ids) not in self.references:  # e.g. the dummy rows that time steps
                continue
            full = row.prompt_ids + self.references[tuple(row.prompt_ids)]
            start = int(anchor_positions[r]) + 1
            truth = (full[start:start + k] + [0] * k)[:k]
            if self.correct is None:
                n_right = k
            else:
                n_right = self.correct(self.rng) if callable(self.correct) else self.correct
            wrong = [(t + 1) % (VOCAB - 1) for t in truth]
            draft.tokens[r] = torch.tensor(truth[:n_right] + wrong[n_right:])
        return draft


def partial_oracle(target, references: dict[tuple, list[int]], block_size: int) -> OracleProposer:
    """A drafter (on the target's device) right for a random number of tokens per block: rows accept different
    numbers (ragged)."""
    return OracleProposer(tiny_drafter(target).to(target.device), target, references,
                          correct=lambda rng: rng.randint(0, block_size - 1), seed=block_size)


def check_triples_follow_the_target(model, params, prompt: list[int], counts: dict[tuple, int],
                                    min_cells: int = 1, adjust=None) -> None:
    """`counts` of the first three output tokens of many unseeded generations after `prompt` follow the target's
    own probabilities of each triple (`model` through transformers, after `adjust(ids, logits)` where given, then
    `params`): none the target cannot sample, and a chi-square over the triples expected 5+ times (the rest pooled
    into one cell)."""
    from scipy.stats import chisquare

    from dflash.decoding.sampling import to_probs

    @torch.no_grad()
    def next_probs(ids: list[int]) -> torch.Tensor:  # (vocab,)
        logits = model(torch.tensor([ids])).logits[0, -1]
        return to_probs(logits if adjust is None else adjust(ids, logits.clone()), params)

    exact: dict[tuple, float] = {}
    first = next_probs(prompt)
    for a in first.nonzero()[:, 0].tolist():
        second = next_probs(prompt + [a])
        for b in second.nonzero()[:, 0].tolist():
            third = next_probs(prompt + [a, b])
            for c in third.nonzero()[:, 0].tolist():
                exact[a, b, c] = float(first[a] * second[b] * third[c])
    assert set(counts) <= set(exact), "a triple the target cannot sample was drawn"
    draws = sum(counts.values())
    big = [t for t in exact if exact[t] * draws >= 5]
    observed = [counts.get(t, 0) for t in big] + [draws - sum(counts.get(t, 0) for t in big)]
    expected = [exact[t] * draws for t in big] + [draws - sum(exact[t] * draws for t in big)]
    assert len(big) >= min_cells
    assert chisquare(observed, expected).pvalue > 1e-3, sorted(zip(big, observed, expected))


def check_ragged_greedy(target, prompts: list[list[int]], max_new: int) -> None:
    """Greedy at block sizes 2, 8 and 16 in a ragged batch, with a drafter right for a random number of tokens per
    block, gives transformers' own greedy output; draft tokens are accepted, and rows accept different numbers."""
    from dflash.decoding import GenerationConfig, SpeculativeEngine

    greedy = [hf_greedy(target, p, max_new) for p in prompts]
    for block_size in (2, 8, 16):
        engine = SpeculativeEngine(target, partial_oracle(target, dict(zip(map(tuple, prompts), greedy)), block_size))
        outs = engine.generate(prompts, GenerationConfig(max_new_tokens=max_new, block_size=block_size,
                                                         ignore_eos=True))
        assert [o.output_ids for o in outs] == greedy, f"block size {block_size}"
        if block_size > 2:
            assert len({tuple(o.stats.acceptance_lengths) for o in outs}) > 1
            assert all(o.stats.mean_acceptance_length > 1.3 for o in outs)


class BranchOracle(OracleProposer):
    """The oracle's draft (right for `correct` tokens), sure of its right tokens and unsure of the first wrong
    one, with a branch there that is right for `branch_right` tokens."""

    def __init__(self, drafter, target, references, correct: int, branch_right: int):
        super().__init__(drafter, target, references, correct=correct)
        self.branch_right = branch_right

    def with_block_size(self, block_size):
        clone = BranchOracle(self.drafter, self.target, self.references, self.correct, self.branch_right)
        clone.block_size = block_size or self.block_size
        return clone

    def propose(self, state, anchors, anchor_positions, rows) -> Draft:
        draft = super().propose(state, anchors, anchor_positions, rows)
        k = draft.tokens.shape[1]
        confidence = torch.full(draft.tokens.shape, 0.99)
        confidence[:, min(self.correct, k - 1):] = 0.05
        truths = []
        for r, row in enumerate(rows):
            full = row.prompt_ids + self.references.get(tuple(row.prompt_ids), [])
            begin = int(anchor_positions[r]) + 1
            truths.append((full[begin:] + [0] * 2 * k)[: 2 * k])

        def branch_fn(start, length):
            out = []
            for truth, d in zip(truths, start.tolist()):
                right = truth[d: d + min(self.branch_right, length)]
                out.append(right + [(t + 1) % (VOCAB - 1) for t in truth[d + len(right): d + length]])
            return torch.tensor(out)

        return Draft(draft.tokens, draft.probs, confidence_fn=lambda: confidence, branch_fn=branch_fn)


def decode_with_branch_oracle(target, prompt_seed: int, correct: int, branch_right: int, block_size: int,
                               branch_length: int, max_new: int, rows: int = 2):
    """`rows` prompts decoded greedily as one batch with a `BranchOracle` and branches on: (outputs, references
    in order)."""
    prompts = random_prompts(rows, seed=prompt_seed)
    refs = {tuple(p): hf_greedy(target, p, max_new) for p in prompts}
    engine = SpeculativeEngine(target, BranchOracle(tiny_drafter(target), target, refs, correct=correct,
                                                    branch_right=branch_right))
    outs = engine.generate(prompts, GenerationConfig(max_new_tokens=max_new, block_size=block_size,
                                                     branch_length=branch_length, ignore_eos=True))
    return outs, [refs[tuple(p)] for p in prompts]


# ---- a tiny text pair on disk (target + tokenizer + drafter), for the CLI, bench and server ----------
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINKING_TEMPLATE = (  # the tiny tokenizer's ChatML, whose answers open with a mark when thinking is off
    "{% set off = enable_thinking is defined and not enable_thinking %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if off and m['role'] == 'assistant' %}<|mask|>\n"
    "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if off %}<|mask|>\n{% endif %}{% endif %}"
)
_CORPUS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Weng earns 12 dollars an hour for babysitting. "
    "Yesterday, she just did 50 minutes of babysitting. How much did she earn? The answer is 72. "
    "Please reason step by step, and put your final answer within boxed."
)


def make_tokenizer():
    """A ~128-token SentencePiece-style BPE with a ChatML template and a dedicated mask token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([_CORPUS] * 4, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<unk>", additional_special_tokens=["<|im_start|>", "<|mask|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def byte_fallback_tokenizer():
    """A Llama-style tokenizer: ASCII letters as tokens, every other character as its UTF-8 bytes (so a character
    can take several tokens), a leading space dropped when decoding."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def embedded_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "dflash" / "assets" / "target")


# the three ways tokenizers write text that is not ASCII
TOKENIZERS = {"byte-level (embedded)": embedded_tokenizer, "metaspace": make_tokenizer,
              "byte fallback": byte_fallback_tokenizer}


def save_tiny_pair(root, family: str = "qwen3", block_size: int = 8, drafter_layers: int = 1, tokenizer=None):
    """Write a tiny target (with tokenizer: `make_tokenizer`'s unless given) and a random drafter for it; returns
    (target_dir, draft_dir)."""
    from pathlib import Path

    root = Path(root)
    tokenizer = tokenizer or make_tokenizer()
    model = tiny_target_model(family, vocab=len(tokenizer))
    eos = tokenizer.eos_token_id
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    target = TargetModel(model, tokenizer)
    drafter = tiny_drafter(target, layers=drafter_layers, block_size=block_size)
    if "<|mask|>" in tokenizer.get_vocab():
        drafter.config.mask_token_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    drafter.save_pretrained(root / "draft")
    return root / "target", root / "draft"


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir) of a tiny Qwen3 pair with a real tokenizer and chat template."""
    return save_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


# ---- adaptive block size: a proposer stand-in and synthetic step costs -------------------------------------
class FakeProposer:
    kind = "DFlash"

    def __init__(self, block_size: int = 16):
        self.block_size = block_size

    def with_block_size(self, block_size):
        return FakeProposer(block_size)


def linear_step_costs(per_token_s: float, fixed_s: float = 0.01):
    """A step costs `fixed_s` plus `per_token_s` for every verified token (rows x k)."""
    from dflash.decoding.block_policy import StepCosts

    return StepCosts({(r, k): fixed_s + per_token_s * r * k for r in (1, 2, 4, 8) for k in (2, 4, 8, 16)})


# ---- DFlash2 ------------------------------------------------------------------------------------------------
DFLASH2_OPTIONS = DFlash2Options(selector_rank=8, selector_top_k=4)


def dflash2_drafter(target, layers: int = 2, block_size: int = 16, seed: int = 0, scale: float = 0.3):
    """A DFlash2 drafter whose convolutions and selector are far from their identity start."""
    from dflash.training.drafter_setup import to_dflash2

    drafter = tiny_drafter(target, layers=layers, block_size=block_size, seed=seed)
    to_dflash2(drafter, DFLASH2_OPTIONS)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                param.add_(torch.randn(param.shape, generator=generator) * scale)
        drafter.candidate_selector.predecessor_codebook.mul_(20)  # pair scores that overrule the top-1
    return drafter.eval()


def perturbed_copy(target: TargetModel, scale: float, seed: int = 0) -> TargetModel:
    """The target with noise on every weight: a draft model that agrees with it often, not always."""
    import copy

    model = copy.deepcopy(target.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.std().nan_to_num(0.02))
    return TargetModel(model, target.tokenizer)


@pytest.fixture(scope="session")
def draft_model_pair(tmp_path_factory):
    """(target_dir, draft_model_dir): the tiny text pair's target, and a causal LM that drafts for it (the
    target with noise, the same tokenizer), for classic speculative decoding."""
    root = tmp_path_factory.mktemp("draft_model")
    target_dir, _ = save_tiny_pair(root)
    target = TargetModel.from_pretrained(target_dir)
    draft = perturbed_copy(target, 0.3)
    draft.model.save_pretrained(root / "draft_model")
    target.tokenizer.save_pretrained(root / "draft_model")
    return target_dir, root / "draft_model"


# ---- a hub that never answers ----------------------------------------------------------------------------
def _accept_and_stay_silent(server: socket.socket) -> None:
    held = []
    try:
        while True:
            held.append(server.accept())
    except OSError:  # the test closed the socket
        pass


@pytest.fixture
def silent_hub(monkeypatch, tmp_path):
    """A hub endpoint that accepts connections and never answers (a network that swallows requests), an empty
    cache, and a short wait."""
    from huggingface_hub import constants

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    threading.Thread(target=_accept_and_stay_silent, args=(server,), daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 0.5)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # its own 3 s wait for the same endpoint
    monkeypatch.setattr(hub, "_unreachable", None)
    yield
    server.close()


class _RefusingHub(http.server.BaseHTTPRequestHandler):
    """The hub's answer to every request: `status` with the error code it gives (the class attributes)."""

    status, error_code, message = 404, "RepoNotFound", "Repository not found"

    def do_GET(self):
        self.send_response(self.status)
        if self.error_code:
            self.send_header("X-Error-Code", self.error_code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps({"error": self.message}).encode())

    def log_message(self, *args):
        pass


def _refusing_hub(monkeypatch, handler: type) -> http.server.ThreadingHTTPServer:
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(hub, "_unreachable", None)
    return server


@pytest.fixture
def empty_hub(monkeypatch, tmp_path):
    """A hub endpoint that answers, and has no repository at all."""
    server = _refusing_hub(monkeypatch, _RefusingHub)
    yield
    server.shutdown()


@pytest.fixture
def refusing_hub(monkeypatch, tmp_path):
    """refusing_hub(status, error_code, message): a hub endpoint that answers every request so (a gated repository,
    a token it does not take, ...), and an empty cache in tmp_path / "hub-cache"."""
    from huggingface_hub import constants

    servers = []

    def start(status: int, error_code: str | None, message: str) -> None:
        handler = type("Refusing", (_RefusingHub,), dict(status=status, error_code=error_code, message=message))
        servers.append(_refusing_hub(monkeypatch, handler))

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    yield start
    for server in servers:
        server.shutdown()


def blocks_wanted(acceptance_lengths: list[int], block_size: int, max_new: int) -> list[int]:
    """The block each drafted step of one row verifies: the block size, or what the row still wants when that is
    less (at least the anchor and a draft token). acceptance_lengths[0] is the prefill's token."""
    blocks, done = [], acceptance_lengths[0]
    for kept in acceptance_lengths[1:]:
        blocks.append(min(block_size, max(max_new - done, 2)))
        done += kept
    return blocks

"""A drafter to train: a new one shaped for the target (its mask token chosen and checked), or an existing one
grown in place (more feature layers, a wider MLP, more layers, DFlash2's modules), each growth starting out as the
same function.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.errors import UserError
from dflash.model import hf_compat
from dflash.model.config import DFlash2Options, DrafterConfig, default_target_layer_ids
from dflash.model.dflash2 import CandidateSelector, GroupedDynamicConv
from dflash.model.drafter import DFlashDecoderLayer, DFlashDraftModel, init_weights
from dflash.model.target import TargetModel, check_drafts_in_hidden_size
from dflash.training.config import DEFAULT_SELECTOR_RANK, DEFAULT_SELECTOR_TOP_K, TrainConfig
from dflash.training.data import Example


def choose_mask_token_id(config: TrainConfig, tokenizer, vocab_size: int) -> int | None:
    """--mask-token-id, else `free_mask_token_id`."""
    if config.mask_token_id is not None:
        return config.mask_token_id
    return free_mask_token_id(tokenizer, vocab_size)


def free_mask_token_id(tokenizer, vocab_size: int) -> int | None:
    """An id that is no real token: the tokenizer's `<|MASK|>`, its mask token, `<|mask|>`, or the first unused
    embedding row; None when there is none (GPT-2's layout: one special token, EOS, and every row a token).
    `<|MASK|>` first: SGLang refuses a drafter whose mask_token_id is not that token's id when the tokenizer has
    it."""
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        if "<|MASK|>" in vocab:
            return vocab["<|MASK|>"]
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return tokenizer.mask_token_id
        if "<|mask|>" in vocab:
            return vocab["<|mask|>"]
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
    return None


def mask_token_problem(mask_id: int, target: TargetModel) -> str | None:
    """Why `mask_id` cannot be the mask token, or None. A mask that aliases a real token (pad, eos, a token of
    text) trains a drafter that scores well and drafts badly (REFERENCE section 4)."""
    if not 0 <= mask_id < target.vocab_size:
        return f"it is outside the target's vocabulary (0..{target.vocab_size - 1})"
    if mask_id in target.eos_token_ids():
        return "it is an end-of-sequence token"
    if target.tokenizer is not None and mask_id == target.tokenizer.pad_token_id:
        return "it is the padding token"
    return text_token_problem(mask_id, target.tokenizer)


def text_token_problem(mask_id: int, tokenizer) -> str | None:
    """That `mask_id` is a token of ordinary text (not a special token, not an unused row), or None."""
    if tokenizer is None:
        return None
    added = getattr(tokenizer, "added_tokens_decoder", {})
    if mask_id < len(tokenizer) and not (mask_id in added and added[mask_id].special):
        return f"it is {tokenizer.convert_ids_to_tokens(mask_id)!r}, a token of ordinary text"
    return None


def unused_text_token(target: TargetModel, examples: list[Example]) -> int | None:
    """For a tokenizer with no free id (`free_mask_token_id` None): the last token of text none of the examples
    holds (a late BPE merge, the rarest kind), not eos or pad; None when the examples hold every one."""
    tokenizer = target.tokenizer
    held = {t for e in examples for t in e.input_ids}
    reserved = set(target.eos_token_ids()) | {tokenizer.pad_token_id}
    for mask_id in range(min(len(tokenizer), target.vocab_size) - 1, -1, -1):
        if mask_id not in held and mask_id not in reserved and text_token_problem(mask_id, tokenizer):
            return mask_id
    return None


def mask_token_uses(mask_id: int, examples: list[Example]) -> int:
    """How often the mask token is a response token of the data, where blocks start and are labelled."""
    return sum(e.response_tokens().count(mask_id) for e in examples)


def mask_token_advice(tokenizer, vocab_size: int) -> str:
    unused = (f"; rows {len(tokenizer)}..{vocab_size - 1} of the embedding are unused by the tokenizer, and the "
              "first of them is a safe choice" if tokenizer is not None and len(tokenizer) < vocab_size else "")
    return ("the mask token must never occur in text: use the tokenizer's mask token or a special token the data "
            f"never holds (not pad or eos){unused}")


def new_drafter_layer_ids(num_target_layers: int, draft_layers: int) -> list[int]:
    """The published formula's layers, each once: on a target of fewer than draft_layers + 3 layers the formula
    names a layer twice (4 layers, 2 draft layers: [1, 1]), which vLLM would feed the drafter once."""
    return list(dict.fromkeys(default_target_layer_ids(num_target_layers, draft_layers)))


def drafter_config_for(target: TargetModel, config: TrainConfig, mask_token_id: int) -> DrafterConfig:
    check_drafts_in_hidden_size(target)
    tc = target.config
    heads = tc.num_attention_heads
    layers = config.draft_layers or 1
    layer_ids = config.target_layer_ids or new_drafter_layer_ids(target.num_layers, layers)
    outside = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if outside:  # here, at setup: found at the first step, an --overwrite had already cleared the earlier run
        raise UserError(f"--target-layer-ids {outside} are outside the target's {target.num_layers} layers "
                        f"(0..{target.num_layers - 1})")
    return DrafterConfig(
        hidden_size=target.hidden_size,
        intermediate_size=config.intermediate_size or getattr(tc, "intermediate_size", 4 * target.hidden_size),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=hf_compat.head_dim(tc),
        vocab_size=target.vocab_size,
        num_target_layers=target.num_layers,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask_token_id,
        block_size=config.block_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        rope=hf_compat.rope_fields(tc),
        dflash2=dflash2_options(config) if config.dflash2 else None,
    )


def dflash2_options(config: TrainConfig) -> DFlash2Options:
    return DFlash2Options(selector_rank=config.selector_rank or DEFAULT_SELECTOR_RANK,
                          selector_top_k=config.selector_top_k or DEFAULT_SELECTOR_TOP_K)


def check_kept_options(config: TrainConfig, drafter_config: DrafterConfig, source: str) -> None:
    """A fine-tune keeps the drafter's mask token and selector: a flag that asks for others would be ignored, so it
    is refused, naming what the drafter has."""
    kept = "--init-from's drafter keeps its own; leave the flag out"
    if config.mask_token_id is not None and config.mask_token_id != drafter_config.mask_token_id:
        raise UserError(f"--mask-token-id {config.mask_token_id}: the drafter in {source} learnt with mask token "
                        f"{drafter_config.mask_token_id}, and {kept}")
    options = drafter_config.dflash2
    asked = {"--selector-rank": config.selector_rank, "--selector-top-k": config.selector_top_k}
    if options is None and not config.dflash2 and any(v is not None for v in asked.values()):
        raise UserError(f"{' and '.join(k for k, v in asked.items() if v is not None)} shape a DFlash2 drafter's "
                        f"selector, and the drafter in {source} is a DFlash drafter: add --dflash2 to grow one into "
                        "it, or leave them out")
    if options is not None:
        have = {"--selector-rank": options.selector_rank, "--selector-top-k": options.selector_top_k}
        for flag, value in asked.items():
            if value is not None and value != have[flag]:
                raise UserError(f"{flag} {value}: the DFlash2 drafter in {source} has {have[flag]}, and {kept}")


def to_dflash2(drafter: DFlashDraftModel, options: DFlash2Options) -> None:
    """Give a DFlash drafter DFlash2's modules: identity convolutions and a selector whose path is each position's
    top-1, so it drafts exactly as before until training moves them."""
    options.check(drafter.config.hidden_size, drafter.config.vocab_size)
    drafter.config.dflash2 = options
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    for layer in drafter.layers:
        layer.attention_conv = GroupedDynamicConv(drafter.config.hidden_size, options).to(device, dtype)
        layer.mlp_conv = GroupedDynamicConv(drafter.config.hidden_size, options).to(device, dtype)
    drafter.candidate_selector = CandidateSelector(drafter.config.hidden_size, drafter.config.vocab_size,
                                                   options).to(device, dtype)


def widen_features(drafter: DFlashDraftModel, layer_ids: list[int]) -> None:
    """Feed the drafter more target layers: `layer_ids` must keep every current id (as often as it occurs);
    the new ids' columns of `fc` start at zero, so the drafter's outputs are unchanged until training moves them."""
    old_ids = drafter.config.target_layer_ids
    slots: list[int] = []  # for each current id, its place in layer_ids
    for i, layer in enumerate(old_ids):
        places = [j for j, x in enumerate(layer_ids) if x == layer]
        occurrence = old_ids[:i].count(layer)
        if occurrence >= len(places):
            raise UserError(f"--target-layer-ids {layer_ids} must list each of the drafter's feature layers "
                            f"{old_ids} (it can add layers, not drop them)")
        slots.append(places[occurrence])
    h, old_fc = drafter.config.hidden_size, drafter.fc.weight.data  # (h, len(old_ids) * h)
    weight = old_fc.new_zeros(old_fc.shape[0], len(layer_ids) * h)
    for i, j in enumerate(slots):
        weight[:, j * h: (j + 1) * h] = old_fc[:, i * h: (i + 1) * h]
    drafter.fc.weight, drafter.fc.in_features = nn.Parameter(weight), weight.shape[1]
    drafter.config.target_layer_ids = list(layer_ids)


def widen_mlp(drafter: DFlashDraftModel, intermediate_size: int, std: float = 0.02) -> None:
    """Give every drafter layer a wider MLP: the new hidden units' gate and up rows start small and random, their
    down_proj columns at zero, so the drafter's outputs are unchanged until training moves them."""
    old = drafter.config.intermediate_size
    if intermediate_size == old:
        return
    if intermediate_size < old:
        raise UserError(f"--intermediate-size {intermediate_size} is below the drafter's {old}: fine-tuning can "
                        "widen its MLP, not narrow it")
    for layer in drafter.layers:
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj"):  # (intermediate, h): new rows
            linear = getattr(mlp, name)
            new_rows = linear.weight.data.new_empty(intermediate_size - old, linear.in_features).normal_(std=std)
            linear.weight = nn.Parameter(torch.cat([linear.weight.data, new_rows], dim=0))
            linear.out_features = intermediate_size
        down = mlp.down_proj  # (h, intermediate): new columns
        zeros = down.weight.data.new_zeros(down.out_features, intermediate_size - old)
        down.weight = nn.Parameter(torch.cat([down.weight.data, zeros], dim=1))
        down.in_features = intermediate_size
    drafter.config.intermediate_size = intermediate_size


def deepen(drafter: DFlashDraftModel, num_layers: int) -> None:
    """Append layers to the drafter, before its final norm: each new layer's `o_proj` and `down_proj` start at zero,
    so it adds nothing to the residual stream and the drafter's outputs are unchanged until training moves them."""
    config, old = drafter.config, len(drafter.layers)
    if num_layers < old:
        raise UserError(f"--draft-layers {num_layers} is below the drafter's {old}: fine-tuning can add layers, "
                        "not remove them")
    for _ in range(num_layers - old):
        layer = DFlashDecoderLayer(config).to(drafter.fc.weight.device, drafter.fc.weight.dtype)
        init_weights(layer)
        nn.init.zeros_(layer.self_attn.o_proj.weight)
        nn.init.zeros_(layer.mlp.down_proj.weight)
        drafter.layers.append(layer)
        config.layer_types.append(config.layer_types[-1])
    config.num_hidden_layers = num_layers

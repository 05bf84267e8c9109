"""Hand a pair to vLLM or SGLang: check it from its configs (no weights loaded), then launch the engine with
its DFlash speculative configuration (REFERENCE section 3), or print the command.

    vllm serve TARGET --speculative-config \
        '{"method": "dflash", "model": DRAFT, "num_speculative_tokens": B-1, "attention_backend": "FLASH_ATTN"}'
    python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \
        --speculative-draft-model-path DRAFT --speculative-num-draft-tokens B
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dflash.errors import UserError
from dflash.model.config import DrafterConfig, LayerAttention, is_causal_lm, is_dflash2, is_whole_number, untappable
from dflash.model.drafter import DFlashDraftModel
from dflash.model.loading import (
    CheckpointError,
    check_target_dir,
    drafter_weight_files,
    hub_file,
    is_hub_id,
    read_config,
    weight_shapes,
)
from dflash.model.target import check_compatible
from dflash.serve.limits import check_max_model_len
from dflash.serve.sampling_defaults import NEUTRAL_CHOICES
from dflash.serve.tools import hermes_template_problem

ENGINES = ("vllm", "sglang")
API_KEY_ENV = "DFLASH_API_KEY"  # where --dry-run's printed command reads the key, so it is never printed
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM reads its key from here too: off the command line, out of `ps`
# vLLM loads a drafter with both sliding-window and full layers only in its V2 model runner, which this turns on
VLLM_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
DRAFTER_ARCHITECTURE = "DFlashDraftModel"  # what both engines load for method "dflash" / DFLASH
# Per-layer and top-level weights a DFlash drafter checkpoint must hold (no embedding, no LM head).
_LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "input_layernorm.weight", "post_attention_layernorm.weight")
_TOP_KEYS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# The drafter's block attends both ways: FlashAttention is the vLLM attention backend that took that in every
# release with DFlash (FlexAttention and FlashInfer learnt it later; FlashInfer's gave near-zero acceptance on
# Blackwell until mid-2026). Since April 2026 (vLLM PR 39930) the drafter takes its backend from the speculative
# config's attention_backend alone, and chooses its own when that is unset, whatever --attention-backend gives the
# target; older releases refuse that key and give the drafter the target's --attention-backend.
VLLM_DRAFT_ATTENTION_BACKEND = "FLASH_ATTN"

log = logging.getLogger("dflash")


@dataclass
class HandoffOptions:
    """The `dflash serve` flags that carry over to the engine; None = the engine's default."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int | None = None
    served_model_name: str | None = None
    max_batch_size: int | None = None
    dtype: str | None = None
    chat_template_kwargs: dict | None = None  # --enable-thinking, --chat-template-kwargs: requests' defaults
    log_level: str | None = None  # debug, info, warning or error (vLLM: its HTTP server's, SGLang: its own)
    trust_remote_code: bool = False  # both engines take --trust-remote-code as dflash does
    generation_config: str = "auto"  # --generation-config: auto (both engines' default), vllm / openai, or a directory
    # --attention-backend: the target's backend (the engine's flag), "auto" for the engine's own choice, the vLLM
    # drafter's too; None: the engine's choice for the target (`vllm_attention_backends` says the vLLM drafter's)
    attention_backend: str | None = None
    # vLLM's drafter backend, in its speculative config (set by `engine_command`; None: none named there)
    draft_attention_backend: str | None = None
    # --shutdown-timeout: seconds in-flight requests get at SIGTERM (vLLM's flag of that name, >= 0.18); None: the
    # engine's default (vLLM: stop at once; SGLang: it finishes them by its own rules, with no flag for it)
    shutdown_timeout: float | None = None
    # vLLM's parser of the calls a model writes, for tool_choice auto (`with_tool_parser`); None: none named
    tool_call_parser: str | None = None


@dataclass
class EngineCommand:
    """The engine's argv and the variables to add to its environment (vLLM's API key, its V2 runner switch)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what --dry-run says beside it (the engine's version it needs)

    def shown(self) -> str:
        """The command as a shell line to copy, the API key read from $DFLASH_API_KEY rather than printed."""
        key = f'"${API_KEY_ENV}"'
        words = [key if before == "--api-key" else shlex.quote(arg)
                 for before, arg in zip(["", *self.argv], self.argv)]
        env = [f"{name}={key if name == VLLM_API_KEY_ENV else shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join(env + words)


@dataclass
class TargetFacts:
    """The target's shape as its config.json states it (duck-types `TargetModel` for `check_compatible`)."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    max_position_embeddings: int | None = None
    latent_attention: bool = False  # DeepSeek's multi-head latent attention (kv_lora_rank): its own vLLM backends
    model_type: str | None = None
    dtype: str | None = None  # the dtype its config.json names (torch_dtype, or transformers 5's dtype)


# ---- checking the pair ---------------------------------------------------------------------------------
def _read_config(path_or_id: str, what: str) -> dict:
    """config.json of a local checkpoint directory or, for a hub id, just that file from the hub."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return read_config(path, what)
    if path.exists():
        raise UserError(f"{path_or_id} is not a directory; give a checkpoint directory or a hub id like org/name")
    if str(path_or_id).startswith((".", "/", "~")):
        raise UserError(f"{path_or_id} does not exist; give a checkpoint directory or a hub id like org/name")
    if not is_hub_id(str(path_or_id)):
        raise UserError(f"{path_or_id} does not exist; give a checkpoint directory or a hub id like org/name")
    return read_config(hub_file(str(path_or_id), "config.json").parent, what)


# Heads of other tasks than generating text: a checkpoint declaring only these is no causal LM to serve
_NOT_GENERATIVE = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                   "ForMultipleChoice", "ForNextSentencePrediction", "ForPreTraining", "ForImageClassification")


def target_facts(target: str) -> TargetFacts:
    """The target's shape from its config.json; a local directory is checked as loading it would be (a causal LM,
    not a drafter, with a tokenizer), without its weights."""
    if Path(target).expanduser().is_dir():
        try:
            check_target_dir(Path(target).expanduser())
        except CheckpointError as err:
            raise UserError(str(err)) from None
    raw = _read_config(target, "a Hugging Face causal LM checkpoint")
    _check_generative(target, raw)
    text = raw.get("text_config") or raw  # multimodal configs keep the language model's fields there
    names = _own_names(text.get("model_type"))
    fields = {k: text.get(k, text.get(names.get(k, k))) for k in (
        "hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings")}
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if fields[k] is None]
    if missing:
        raise UserError(f"the target's config.json lacks {', '.join(missing)}; is {target} a causal LM checkpoint?")
    bad = [f"{k} {v!r}" for k, v in fields.items() if v is not None and not is_whole_number(v)]
    if bad:
        raise UserError(f"the target's config.json ({target}) gives {', '.join(bad)}: each must be a whole number "
                        ">= 1; restore the config.json that came with the weights")
    return TargetFacts(fields["hidden_size"], fields["num_hidden_layers"], fields["vocab_size"],
                       fields["max_position_embeddings"], latent_attention=bool(text.get("kv_lora_rank")),
                       model_type=text.get("model_type"), dtype=declared_dtype(raw))


def declared_dtype(raw: dict) -> str | None:
    """The dtype a config.json names: torch_dtype, or transformers 5's dtype (a multimodal one's text_config's)."""
    for config in (raw, raw.get("text_config") or {}):
        dtype = config.get("torch_dtype") or config.get("dtype")
        if isinstance(dtype, str):
            return dtype.removeprefix("torch.")
    return None


def _check_generative(target: str, raw: dict) -> None:
    """Refuse an encoder-decoder (T5, BART) or a checkpoint whose every head does another task (BERT's masked LM):
    DFlash drafts for a decoder-only causal LM, and the engines would refuse it only after their start-up."""
    architectures = [str(a) for a in raw.get("architectures") or []]
    if raw.get("is_encoder_decoder"):
        raise UserError(f"{target} is an encoder-decoder model ({', '.join(architectures) or raw.get('model_type')}); "
                        "DFlash drafts for a decoder-only causal LM")
    if architectures and all(a.endswith(_NOT_GENERATIVE) for a in architectures):
        raise UserError(f"{target} declares architectures {architectures}, heads for other tasks than generating "
                        "text: give a causal LM (a ...ForCausalLM checkpoint) as the target")


def _own_names(model_type: str | None) -> dict[str, str]:
    """transformers' names for a model type's own config fields (GPT-2: hidden_size is n_embd, num_hidden_layers
    n_layer); none for a type it does not know."""
    from transformers import CONFIG_MAPPING

    try:
        return dict(CONFIG_MAPPING[model_type].attribute_map)
    except KeyError:
        return {}


def _embedded_hint(draft: str) -> str:
    """For the embedded DFlash2 drafter: where its DFlash sibling, trained for the same target, lies."""
    from dflash.api import DEFAULT_DRAFT, HANDOFF_DRAFT

    if Path(draft).resolve() != DEFAULT_DRAFT.resolve():
        return ""
    return f"; the embedded target's DFlash drafter is {HANDOFF_DRAFT} (the default of --engine without --draft)"


@dataclass
class CheckedDrafter:
    """What the checks read of a drafter: its config.json as written and as parsed, its weight names (None for a
    hub id, whose weights the engine reads), and the block size to serve with."""

    raw: dict
    config: DrafterConfig
    weight_names: set[str] | None
    block_size: int


def drafter_config(draft: str) -> tuple[dict, DrafterConfig]:
    """The drafter's config.json as written and as parsed, refusing what the engines' DFlash method cannot load."""
    raw = _read_config(draft, "a DFlash drafter checkpoint")
    if is_dflash2(raw.get("architectures") or []):
        raise UserError(f"{draft} is a DFlash2 drafter (DFlash2DraftModel): the hand-off starts vLLM and SGLang with "
                        "their DFlash method, which has no place for DFlash2's convolutions and candidate selector; "
                        "serve it with `dflash serve` (without --engine), or train a DFlash drafter (dflash train "
                        f"without --dflash2) for the engines{_embedded_hint(draft)}")
    if is_causal_lm(raw.get("architectures") or []):
        raise UserError(f"{draft} is a causal LM, a draft model for classic speculative decoding: the hand-off starts "
                        "vLLM and SGLang with their DFlash method, which needs a DFlash drafter; serve it with "
                        "`dflash serve` (without --engine), or give the engine the draft model by its own "
                        "draft-model method")
    if DRAFTER_ARCHITECTURE not in (raw.get("architectures") or []):
        raise UserError(f"{draft} declares architectures {raw.get('architectures')}; vLLM and SGLang load DFlash "
                        f"drafters declared as {DRAFTER_ARCHITECTURE!r}")
    try:
        return raw, DrafterConfig.from_dict(raw)
    except UserError as err:
        raise UserError(f"{draft}: {err} (vLLM and SGLang read the drafter's settings, the mask token id "
                        "included, from its config.json only: fix the file rather than pass flags)") from None


def check_drafter_weights(draft: str, config: DrafterConfig) -> set[str] | None:
    """Read the safetensors headers of a local drafter (not the tensors) and check the key layout; returns the
    weight names as written (None for a hub id)."""
    directory = Path(draft).expanduser()
    if not directory.is_dir():
        return None  # a hub id: the configs were checked; weights are read by the engine
    shapes = weight_shapes(drafter_weight_files(directory))
    names = set(shapes)
    keys = {k.removeprefix("model."): shape for k, shape in shapes.items()}
    wanted = [*_TOP_KEYS, *(f"layers.{i}.{k}" for i in range(config.num_hidden_layers) for k in _LAYER_KEYS)]
    missing = [k for k in wanted if k not in keys]
    if missing:
        raise UserError(f"{directory} is not in the DFlash drafter format: missing weights {missing[:5]}"
                        f"{' ...' if len(missing) > 5 else ''}")
    if config.not_run_here():  # a layout dflash's drafter does not build (vLLM's loader reads it): names checked
        return names
    with torch.device("meta"):  # the shapes config.json builds, without memory
        expected = {k: list(v.shape) for k, v in DFlashDraftModel(config).state_dict().items() if "rotary" not in k}
    unexpected = sorted(k for k in keys if k not in expected)
    wrong = [f"{k}: file {shape}, config {expected[k]}" for k, shape in keys.items() if expected.get(k, shape) != shape]
    if unexpected or wrong:
        raise UserError(f"the weights in {directory} do not fit its config.json: "
                        + "; ".join(([f"unexpected {unexpected[:5]}"] if unexpected else []) + wrong[:4])
                        + "; fix config.json or use the weights it was saved with (dflash's own loader refuses "
                        "them too)")
    return names


def check_pair(target: TargetFacts, draft: str, block_size: int | None) -> CheckedDrafter:
    """Check format and compatibility from configs and headers, as both engines read them."""
    raw, config = drafter_config(draft)
    check_compatible(target, config)
    check_feature_layers(draft, config.target_layer_ids, target.num_layers)
    names = check_drafter_weights(draft, config)
    if block_size is not None and not 2 <= block_size <= config.block_size:
        raise UserError(f"--block-size {block_size} is not usable with this drafter: choose 2..{config.block_size}")
    return CheckedDrafter(raw, config, names, block_size or config.block_size)


def check_feature_layers(draft: str, layer_ids: list[int], num_target_layers: int) -> None:
    """Refuse target layers the engines cannot feed the drafter (`untappable`)."""
    problem = untappable(layer_ids, num_target_layers)
    if problem:
        raise UserError(f"{draft}: its target_layer_ids {layer_ids}: {problem}; serve it with `dflash serve` (without "
                        "--engine), or train a drafter on layers the engines tap")


def check_vllm_reads(draft: str, drafter: CheckedDrafter) -> None:
    """What vLLM alone needs of a drafter: the target layers and the mask token named in dflash_config (without
    layer ids it taps its model's own default layers, not the formula dflash and SGLang derive for a legacy
    drafter; its older releases read the mask token id there alone), each layer once (it takes each layer's output
    once), and weight names without a model. prefix (its loader adds one)."""
    dflash, config = drafter.raw.get("dflash_config") or {}, drafter.config
    unnamed = [name for name in ("target_layer_ids", "mask_token_id") if name not in dflash]
    if unnamed:
        fields = json.dumps({"dflash_config": {**dflash, "mask_token_id": config.mask_token_id,
                                               "target_layer_ids": config.target_layer_ids}})
        raise UserError(f"{draft}/config.json does not name {' and '.join(unnamed)} in its dflash_config, where vLLM "
                        "reads them (without layer ids vLLM feeds the drafter other target layers than it was "
                        f"trained on); write the values dflash uses into the file: {fields}")
    taps, needed = drafter.raw.get("eagle_aux_hidden_state_layer_ids"), [i + 1 for i in config.target_layer_ids]
    if taps is not None and not isinstance(taps, list):
        raise UserError(f"{draft}/config.json: eagle_aux_hidden_state_layer_ids must be a list of layer ids, got "
                        f"{taps!r}; remove that field (vLLM would tap those layers instead of target_layer_ids)")
    if taps and taps != needed:
        raise UserError(f"{draft}/config.json names eagle_aux_hidden_state_layer_ids {taps}, which vLLM taps instead "
                        f"of the drafter's target_layer_ids {config.target_layer_ids} (it would need {needed}, each "
                        "layer's output as the next one's input); remove that field from the file")
    if any(name.startswith("model.") for name in drafter.weight_names or ()):
        log.warning("%s names its weights model.*: vLLM's DFlash loader adds that prefix itself and may not find "
                    "them (SGLang reads both); save the drafter without the prefix (dflash train exports it so)",
                    draft)


# ---- the commands ----------------------------------------------------------------------------------------
def vllm_command(target: str, draft: str | None, block_size: int, options: HandoffOptions) -> EngineCommand:
    cmd = ["vllm", "serve", target]
    if draft is not None:
        spec = {"method": "dflash", "model": draft, "num_speculative_tokens": block_size - 1}
        if options.draft_attention_backend is not None:
            spec["attention_backend"] = options.draft_attention_backend
        cmd += ["--speculative-config", json.dumps(spec)]
    cmd += _backend(options)
    cmd += ["--host", options.host, "--port", str(options.port)]
    cmd += _optional({"--max-model-len": options.max_model_len, "--served-model-name": options.served_model_name,
                      "--max-num-seqs": options.max_batch_size, "--dtype": options.dtype,
                      "--uvicorn-log-level": options.log_level,
                      # whole seconds, rounded up: a fraction is no drain worth cutting short
                      "--shutdown-timeout": None if options.shutdown_timeout is None else
                      math.ceil(options.shutdown_timeout)})
    if options.chat_template_kwargs:
        cmd += ["--default-chat-template-kwargs", json.dumps(options.chat_template_kwargs)]
    if options.tool_call_parser is not None:  # tool_choice auto, as dflash serve reads it
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", options.tool_call_parser]
    cmd += ["--trust-remote-code"] if options.trust_remote_code else []
    if options.generation_config != "auto":
        neutral = options.generation_config in NEUTRAL_CHOICES
        # a directory as vLLM must find it from wherever the command runs: `~` and a relative path resolved here
        directory = "vllm" if neutral else str(Path(options.generation_config).expanduser().resolve())
        cmd += ["--generation-config", directory]
    env = {VLLM_API_KEY_ENV: options.api_key} if options.api_key is not None else {}
    return EngineCommand(cmd, env)


def mixes_sliding_and_full(config: DrafterConfig) -> bool:
    """Whether vLLM finds both sliding-window and full layers in the drafter (its V2 model runner alone loads it)."""
    return len(set(config.layer_types)) > 1 and "sliding_attention" in config.layer_types


def sglang_layer_attention(config: DrafterConfig, i: int) -> LayerAttention:
    """Draft layer i's attention as SGLang's DFlash model resolves it: a top-level `is_causal` for every layer, else a
    sliding layer causal within `sliding_window` and a full one both ways. It reads neither dflash_config's `causal`
    nor its `use_swa` / `swa_window_size`, which vLLM and dflash read."""
    sliding = config.layer_types[i] == "sliding_attention"
    causal = config.extra.get("is_causal")
    return LayerAttention(config.sliding_window if sliding else None, sliding if causal is None else causal)


def check_sglang_reads(draft: str, drafter: CheckedDrafter, target: TargetFacts) -> None:
    """Refuse a drafter whose layers SGLang would run with other attention than they were trained with, or whose
    target layers it would refuse: without a top-level num_target_layers it takes the drafter's own depth for the
    target's, and a layer id past that is out of range."""
    config = drafter.config
    if drafter.raw.get("num_target_layers") is None and max(config.target_layer_ids) >= config.num_hidden_layers:
        raise UserError(f"{draft}/config.json does not give num_target_layers, and SGLang then counts the target's "
                        f"layers as the drafter's {config.num_hidden_layers}, so it refuses target layer "
                        f"{max(config.target_layer_ids)}; add \"num_target_layers\": {target.num_layers} to the file")
    for i in range(config.num_hidden_layers):
        ours, theirs = config.layer_attention(i), sglang_layer_attention(config, i)
        if ours != theirs:
            raise UserError(f"{draft}: SGLang would run draft layer {i} {_described(theirs)}, and it was trained "
                            f"{_described(ours)} (SGLang reads neither dflash_config's causal nor its use_swa and "
                            "swa_window_size); state it in the fields SGLang reads (is_causal, or layer_types with "
                            "sliding_window and use_sliding_window true), or hand it to vLLM (--engine vllm)")


def sglang_dtype(options: HandoffOptions, target: TargetFacts, drafter: CheckedDrafter) -> HandoffOptions:
    """SGLang loads each model in the dtype its config.json names, and a float32 one in float16, then hands the
    drafter the target's hidden states as they are: a drafter exported in float32 (dflash train's default) beside a
    bfloat16 target fails at its first draft on the dtypes. --dtype, which SGLang gives both, is the target's then,
    unless it is given."""
    draft_dtype = str(drafter.config.dtype).removeprefix("torch.")  # as its config.json names it (torch_dtype, dtype)
    if options.dtype is None and target.dtype in ("bfloat16", "float16") and draft_dtype != target.dtype:
        return replace(options, dtype=target.dtype)
    return options


def _described(attention: LayerAttention) -> str:
    window = f" within a window of {attention.window}" if attention.window else ""
    return f"{'causally' if attention.causal else 'both ways'}{window}"


def sglang_command(target: str, draft: str | None, block_size: int, options: HandoffOptions) -> EngineCommand:
    """SGLang takes its API key on the command line only (it reads no environment variable for it)."""
    if options.chat_template_kwargs:
        raise UserError("--enable-thinking / --no-enable-thinking and --chat-template-kwargs have no SGLang server "
                        "flag here: drop them, and send \"chat_template_kwargs\": {\"enable_thinking\": ...} with "
                        "each chat request instead")
    if options.generation_config not in ("auto", *NEUTRAL_CHOICES):
        raise UserError(f"--generation-config {options.generation_config}: SGLang reads sampling defaults from the "
                        "target's own generation_config.json only; copy that file into the target's directory, or "
                        "give auto or vllm")
    if options.shutdown_timeout is not None:
        raise UserError("--shutdown-timeout has no SGLang server flag: SGLang finishes the requests in flight at "
                        "SIGTERM by its own rules (bound it with your process manager's grace period); drop it")
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", target]
    if draft is not None:
        cmd += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft,
                "--speculative-num-draft-tokens", str(block_size)]
    cmd += _backend(options)
    cmd += ["--host", options.host, "--port", str(options.port)]
    cmd += _optional({"--api-key": options.api_key, "--context-length": options.max_model_len,
                      "--served-model-name": options.served_model_name,
                      "--max-running-requests": options.max_batch_size, "--dtype": options.dtype,
                      "--log-level": options.log_level})
    cmd += ["--trust-remote-code"] if options.trust_remote_code else []
    cmd += ["--sampling-defaults", "openai"] if options.generation_config in NEUTRAL_CHOICES else []
    return EngineCommand(cmd)


def _backend(options: HandoffOptions) -> list[str]:
    backend = options.attention_backend
    return [] if backend in (None, "auto") else ["--attention-backend", backend]


def _optional(flags: dict[str, object]) -> list[str]:
    out: list[str] = []
    for flag, value in flags.items():
        if value is not None:
            out += [flag, str(value)]
    return out


def engine_command(engine: str, target: str, draft: str | None, block_size: int | None,
                   options: HandoffOptions) -> EngineCommand:
    """Check the pair and --max-model-len, then build the engine's command."""
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    facts = target_facts(target)
    if options.max_model_len is not None:
        check_max_model_len(options.max_model_len, facts.max_position_embeddings)
    notes = []  # what a dry run says beside the command
    if draft is not None:
        drafter = check_pair(facts, draft, block_size)
        if engine == "vllm":
            check_vllm_reads(draft, drafter)
            vllm_here = vllm_takes_draft_attention_backend()
            options = vllm_attention_backends(options, facts, vllm_here)
            if options.draft_attention_backend is not None and vllm_here is None:
                notes.append("vLLM is not installed here: the command is for vLLM since April 2026 (PR 39930), "
                             "whose drafter takes its attention backend from --speculative-config alone; an older "
                             "vLLM refuses attention_backend there: drop it and add --attention-backend flash_attn")
        else:
            check_sglang_reads(draft, drafter, facts)
            options = sglang_dtype(options, facts, drafter)
            if str(facts.model_type).startswith("gemma3"):  # its embedding module scales (Gemma, Gemma 2: the forward)
                log.warning("SGLang embeds a Gemma 3 target's tokens times sqrt(hidden size) for the drafter too, and "
                            "a drafter trained by dflash drafts from the embedding table's rows as vLLM does: expect "
                            "fewer accepted tokens on SGLang, or hand it to vLLM (--engine vllm)")
        block_size = drafter.block_size
    elif block_size is not None:
        raise UserError("--block-size sets the drafter's block, and --no-draft hands over the target alone: drop "
                        "one or the other")
    options, tool_note = with_tool_parser(engine, target, options)
    notes += [tool_note] if tool_note else []
    build = vllm_command if engine == "vllm" else sglang_command
    command = build(target, draft, block_size or 0, options)
    if engine == "vllm" and draft is not None and mixes_sliding_and_full(drafter.config):
        command.env[VLLM_V2_RUNNER_ENV] = "1"
    command.notes.extend(notes)
    return command


def with_tool_parser(engine: str, target: str, options: HandoffOptions) -> tuple[HandoffOptions, str | None]:
    """vLLM reads a model's tool calls as dflash serve does (tool_choice auto, Hermes' JSON blocks) with its hermes
    parser, which it runs only when told: the options with it where the target's chat template teaches that form,
    and a note where this cannot tell (a hub id) or where the engine is SGLang (its parser is named per model)."""
    template = local_chat_template(target)
    if template is None or hermes_template_problem(template) is not None:
        hub = template is None and not Path(target).expanduser().is_dir()
        return options, ("tool calls with tool_choice auto: for a model whose chat template writes Hermes' <tool_call> "
                         "JSON blocks (Qwen's), add --enable-auto-tool-choice --tool-call-parser hermes (vLLM) or "
                         "--tool-call-parser qwen25 (SGLang)") if hub else None
    if engine == "sglang":
        return options, ("tool calls with tool_choice auto: this target's chat template writes Hermes' <tool_call> "
                         "JSON blocks; add SGLang's parser for its family (--tool-call-parser qwen25 for Qwen 2.5 "
                         "and 3)")
    return replace(options, tool_call_parser="hermes"), None


def local_chat_template(target: str) -> str | None:
    """The chat template of a local checkpoint directory (chat_template.jinja, else tokenizer_config.json's); None for
    a hub id or a directory without one."""
    path = Path(target).expanduser()
    if not path.is_dir():
        return None
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(errors="replace")
    try:
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return None if template is None else str(template)  # a list of named templates: any of them may teach calls


def vllm_attention_backends(options: HandoffOptions, facts: TargetFacts, vllm_here: bool | None) -> HandoffOptions:
    """The drafter's attention backend (VLLM_DRAFT_ATTENTION_BACKEND) in the speculative config, the target's left to
    --attention-backend (`auto`: both left to vLLM). An older vLLM installed here (`vllm_here` False: it reads no such
    key) gets it as --attention-backend, which it gives the drafter too (but not for a latent-attention target,
    whose backends are its own)."""
    if options.attention_backend == "auto":
        return options
    if vllm_here is False:
        if options.attention_backend is None and not facts.latent_attention:
            return replace(options, attention_backend=VLLM_DRAFT_ATTENTION_BACKEND.lower())
        return options
    return replace(options, draft_attention_backend=VLLM_DRAFT_ATTENTION_BACKEND)


def vllm_takes_draft_attention_backend() -> bool | None:
    """Whether the vLLM installed here reads attention_backend in its speculative config (None: no vLLM here).
    Read from its source, not imported: importing vLLM takes seconds and may want a GPU."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        source = Path(root) / "config" / "speculative.py"
        if source.is_file():
            return "attention_backend" in source.read_text(errors="replace")
    return False


def ensure_installed(engine: str) -> None:
    installed = shutil.which("vllm") is not None if engine == "vllm" else importlib.util.find_spec("sglang") is not None
    if not installed:
        name = "vLLM (pip install vllm)" if engine == "vllm" else "SGLang (pip install 'sglang[all]')"
        raise UserError(f"{name} is not installed in this environment; install it on a machine with a GPU it "
                        "supports, or add --dry-run to print the command and run it there")


ENGINE_STOP_S = 30.0  # how long a terminated engine gets to exit, beyond its --shutdown-timeout, before it is killed


def launch(engine: str, command: EngineCommand, shutdown_timeout: float | None = None) -> int:
    """Run the engine in the foreground and return its exit status. At Ctrl-C or SIGTERM the engine gets its
    `shutdown_timeout` (the drain it was given) and ENGINE_STOP_S more to exit before it is killed."""
    ensure_installed(engine)
    argv = command.argv
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    shown = EngineCommand(argv, command.env).shown()
    print(f"dflash serve: launching {shown}", file=sys.stderr, flush=True)
    engine_process = subprocess.Popen(argv, env={**os.environ, **command.env})
    try:
        return engine_process.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the engine too; SIGTERM (ours, as Terminated) did not: pass it on
        engine_process.terminate()
        try:
            engine_process.wait(timeout=(shutdown_timeout or 0.0) + ENGINE_STOP_S)
        except subprocess.TimeoutExpired:
            engine_process.kill()
        raise

"""What a request gets for a sampling field it leaves out (`dflash serve --generation-config`).

vLLM (`--generation-config auto`, its default) and SGLang (`--sampling-defaults model`, its default) take these
from the target's generation_config.json, where a model's authors put the settings they recommend (Qwen3: temperature
0.6, top_p 0.95, top_k 20). `dflash serve` does the same by default, so that a client moving between this server and
its hand-off gets the same sampling:

- `auto`: the values the target's generation_config.json sets (those `GenerationConfig.to_diff_dict` keeps, as vLLM
  reads them) for temperature, top_p, top_k, min_p and repetition_penalty; its max_new_tokens caps every request's
  max_tokens, as vLLM does (SGLang does not read it);
- `vllm` (or `openai`): OpenAI's defaults (temperature 1, top_p 1, no top-k, no cap), the values of vLLM's
  `--generation-config vllm` and SGLang's `--sampling-defaults openai`;
- a directory: the generation_config.json in it, read like `auto`.

A field the request sends, null aside, always wins. The file's `do_sample` is not read (vLLM does not read it either).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.decoding.penalties import Penalties
from dflash.decoding.sampling import SamplingParams
from dflash.errors import UserError
from dflash.model.target import unapplied_generation_options

NEUTRAL_CHOICES = ("vllm", "openai")  # OpenAI's defaults: vLLM's word for them, and SGLang's
CHOICES_HELP = "auto, vllm (or openai), or a directory holding a generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling values of a request that leaves them out; `max_tokens` caps every request when set."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0  # 0: no min-p
    repetition_penalty: float = 1.0  # 1: none
    max_tokens: int | None = None
    source: str = "OpenAI's defaults"  # where they come from, for the log
    unapplied: tuple[str, ...] = ()  # the file's other logit options ('name=value'), which DFlash does not apply

    def changed(self) -> dict[str, float | int]:
        """The values that differ from OpenAI's defaults (the cap aside)."""
        neutral = SamplingDefaults()
        return {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                if getattr(self, name) != getattr(neutral, name)}

    def describe(self) -> str:
        """One line for the server's log: what a request that leaves its sampling fields out decodes with."""
        changed = self.changed()
        parts = []
        if changed:
            values = ", ".join(f"{name}={value}" for name, value in changed.items())
            parts.append(f"requests that leave them out decode with {values} from {self.source} (as vLLM and SGLang "
                         "do)")
        if self.max_tokens is not None:
            parts.append(f"every request's max_tokens is capped at {self.max_tokens} (max_new_tokens in "
                         f"{self.source}, as vLLM does; SGLang does not cap)")
        if not parts:
            return (f"requests that leave out temperature, top_p, top_k, min_p or repetition_penalty decode with "
                    f"{self.source}")
        return "; ".join(parts) + "; --generation-config vllm gives OpenAI's defaults instead"

    def unapplied_warning(self) -> str | None:
        if not self.unapplied:
            return None
        return (f"{self.source} also sets {', '.join(self.unapplied)}, which this server does not apply (nor do vLLM "
                "and SGLang)")


def sampling_defaults(choice: str, target_generation_config=None) -> SamplingDefaults:
    """The defaults of `--generation-config CHOICE`; `auto` reads the loaded target's generation config."""
    if choice in NEUTRAL_CHOICES:
        return SamplingDefaults()
    if choice == "auto":
        if target_generation_config is None:
            return SamplingDefaults()
        return from_generation_config(target_generation_config, "the target's generation_config.json")
    return from_generation_config(read_generation_config(choice), f"{Path(choice) / 'generation_config.json'}")


def read_generation_config(directory: str):
    """The generation config in a directory given to --generation-config."""
    from transformers import GenerationConfig

    path = Path(directory).expanduser()
    if not (path / "generation_config.json").is_file():
        what = "no directory" if not path.is_dir() else "a directory without a generation_config.json"
        raise UserError(f"--generation-config {directory}: {what}; give {CHOICES_HELP}")
    try:
        return GenerationConfig.from_pretrained(path)
    except (OSError, ValueError) as err:  # not JSON, or values transformers refuses
        raise UserError(f"--generation-config {directory}: its generation_config.json cannot be read ({err}); fix "
                        "it, or give --generation-config auto or vllm") from None


def from_generation_config(config, source: str) -> SamplingDefaults:
    """The sampling values a generation config sets, checked as a request's are (`SamplingParams`)."""
    values = {k: v for k, v in config.to_diff_dict().items() if v is not None}
    neutral = SamplingDefaults()
    try:
        params = SamplingParams(values.get("temperature", neutral.temperature), values.get("top_p", neutral.top_p),
                                values.get("top_k", neutral.top_k), values.get("min_p", neutral.min_p))
        repetition = Penalties(repetition=values.get("repetition_penalty", neutral.repetition_penalty)).repetition
    except (ValueError, TypeError) as err:
        raise UserError(f"{source}: {err}; fix the file, or serve with --generation-config vllm (OpenAI's "
                        "defaults)") from None
    cap = values.get("max_new_tokens")
    if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1):
        raise UserError(f"{source}: max_new_tokens must be an integer >= 1, got {cap!r}; fix the file, or serve with "
                        "--generation-config vllm (OpenAI's defaults)")
    return SamplingDefaults(temperature=float(params.temperature), top_p=float(params.top_p), top_k=int(params.top_k),
                            min_p=float(params.min_p), repetition_penalty=float(repetition), max_tokens=cap,
                            source=source, unapplied=tuple(o for o in unapplied_generation_options(
                                config, sampling_defaults=False) if not o.startswith("repetition_penalty=")))

"""Every setting of an engine and what loading its model takes, in one dataclass with vLLM's field
names, so that a new engine option is added in one place and reaches every way of starting one:

- `LLM(model, **fields)` takes the fields as keyword arguments (its signature is made from them);
- `pagedrl serve` and `pagedrl generate` make their engine flags from them (`add_engine_arguments`:
  the field's name with dashes, its type, default and help, grouped as in vLLM's `--help`);
- a trainer's rollout engine is described by one (`train/rl/online.py`), and the trainer configs'
  engine fields take their defaults and help from here (`engine_field`).

`tests/test_engine_args.py` checks the three against each other and against the pages of `docs/`
that list them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Union, get_args, get_origin, get_type_hints

import torch

from pagedrl.engine.engine_config import EngineConfig, setting
from pagedrl.engine.pooling_runner import RUNNERS
from pagedrl.model.precision import ACTIVATIONS, DTYPE_CHOICES, DTYPE_HELP, QUANTIZATIONS

# `--help`'s sections, in order: the fields' `group`s.
GROUPS = {
    "model": "the model",
    "cache": "the KV cache",
    "scheduler": "scheduling",
    "execution": "execution",
    "lora": "LoRA adapters chosen per request (by the request's model field)",
}


@dataclass
class EngineArgs(EngineConfig):
    """An engine's settings (`EngineConfig`) and its model's: the name, where it is read from and the
    precision its weights are loaded in."""

    model: str | None = setting(
        None, "Hugging Face folder or Hub id, .gguf file or 'smollm2-135m-instruct' (default)", "model")
    revision: str | None = setting(None, "the branch, tag or commit of a Hub id model", "model")
    adapter: str | None = setting(
        None, "a LoRA adapter folder or Hub id (PEFT's format, e.g. a trainer's final/ with use_peft) folded into "
              "the model's weights at load; without a model, the base the adapter names", "model", metavar="PATH")
    runner: str = setting(
        "auto", "generate: sample tokens from a causal LM; pooling: read a sequence classifier's (a reward model's) "
                "scores, LLM.classify / LLM.reward and POST /classify (docs/serving.md); auto: pooling for a "
                "*ForSequenceClassification folder or a SEQ_CLS adapter, else generate (vLLM's --runner)", "model",
        choices=RUNNERS)
    generation_config: str = setting(
        "auto", "auto: the model's generation_config.json gives the temperature, top_p, top_k, min_p, "
                "repetition_penalty and max_tokens (max_new_tokens) of requests that leave them unset, as vLLM "
                "does; vllm: SamplingParams' own defaults; a folder: its generation_config.json gives them (and its "
                "max_new_tokens caps every served request)", "model", metavar="{auto,vllm,FOLDER}")
    override_generation_config: dict[str, Any] | None = setting(
        None, "JSON object of generation-config keys over those generation_config gives, e.g. "
              "'{\"temperature\": 0.5}'; its max_new_tokens caps every served request (vLLM's)", "model",
        metavar="JSON")
    device: str | None = setting(None, "cpu, cuda, cuda:1, ... (default: cuda if available)", "model")
    dtype: torch.dtype | str = setting("auto", DTYPE_HELP, "model", choices=DTYPE_CHOICES)
    quantization: str | None = setting(
        None, "gguf: a .gguf model's quantized weights stay quantized in memory (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
              "Q4_K, Q5_K, Q6_K, MXFP4; float32 on a CPU, the same tokens as the file dequantized; on CUDA dequantized per product in "
              "the model's dtype); int8 / int4: weight-only quantization made at load of a model that is not "
              "quantized (int8 one scale per output channel, int4 groups of 32 with a scale and a minimum; the "
              "same tokens as the float32 model of the dequantized weights); mxfp4: a gpt-oss checkpoint's MXFP4 experts "
              "stay quantized (about 4.25 bits a weight); gptq, awq, compressed-tensors: a pre-quantized folder's "
              "packed int4 / int8 weights stay quantized (read from its config.json without this flag; naming it, "
              "it must agree); default: none (a GGUF dequantized at load)", "model", choices=QUANTIZATIONS)
    activations: str = setting(
        "float32", "with quantization (or a pre-quantized folder) on a CPU, what the Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, "
                   "Q5_K and Q6_K weights (gguf; int8, int4 and gptq / awq / compressed-tensors are laid out so) multiply: float32, the float32 model's numbers; int8, each row "
                   "quantized to 8 bits per 32 values (per 256 for the K-quants) and integer dot products, as llama.cpp "
                   "computes them (faster, 1.6-2x per product; the tokens are "
                   "no longer the float32 model's)", "model", choices=ACTIVATIONS)

    trust_remote_code: bool = setting(
        False, "vLLM's flag, accepted: pagedrl runs no code from a checkpoint, so it changes nothing (an "
               "architecture pagedrl does not implement is refused either way)", "model")
    tensor_parallel_size: int = setting(
        1, "devices one model is split over: 1 (several processes train with torchrun; serving is one device)",
        "model")

    def engine_config(self) -> EngineConfig:
        """The engine's part (what `LLMEngine` takes), without the model's; ValueError for a model setting
        this engine does not have."""
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size}: one model is served on one device "
                             "here; tensor parallelism is not built")
        return EngineConfig(**self.config_kwargs())

    def config_kwargs(self) -> dict[str, Any]:
        """The engine's settings by name, without the model's: what `LLM.from_module` takes beside a
        module that is the model."""
        return {f.name: getattr(self, f.name) for f in fields(EngineConfig)}

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> EngineArgs:
        """The fields `add_engine_arguments(parser, skip)` put on the parser, read back from the parsed
        flags (the others keep their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in cli_fields() if f.name not in skip})


def ordered_fields() -> list[dataclasses.Field]:
    """EngineArgs' fields group by group (`GROUPS`), the model's own first in the model's group."""
    own = [f for f in fields(EngineArgs) if f.name not in {g.name for g in fields(EngineConfig)}]
    rest = [f for f in fields(EngineArgs) if f not in own]
    return sorted(own + rest, key=lambda f: list(GROUPS).index(f.metadata["group"]))


def cli_fields() -> list[dataclasses.Field]:
    """The fields that are flags (the others take Python objects or are a trainer's to choose)."""
    return [f for f in ordered_fields() if f.metadata["cli"]]


def flag(name: str) -> str:
    """A field's flag: vLLM's spelling, dashes for underscores."""
    return "--" + name.replace("_", "-")


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (vLLM's form for its dict-valued settings)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text}")
    return value


def _scalar_type(hint: Any) -> Callable[[str], Any]:
    """int, float or str from a field's type (`int | None` is int); a dict is read as a JSON object."""
    if get_origin(hint) in (Union, types.UnionType):
        arms = [a for a in get_args(hint) if a is not type(None)]
        return _scalar_type(arms[0]) if len(arms) == 1 else str
    if hint is dict or get_origin(hint) is dict:
        return json_object
    return hint if hint in (int, float, str) else str


def add_engine_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()
                         ) -> dict[str, argparse._ArgumentGroup]:
    """Add a flag per field of `cli_fields()` but those in `skip` (`model` is the positional MODEL);
    returns the groups by name, for a command to add its own flags beside them."""
    hints = get_type_hints(EngineArgs)
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    for f in cli_fields():
        if f.name in skip:
            continue
        meta, group = f.metadata, groups[f.metadata["group"]]
        if f.name == "model":
            group.add_argument("model", nargs="?", default=f.default, help=meta["help"])
            continue
        kind = hints[f.name]
        if kind is bool:  # on by default: vLLM's --no-... form turns it off
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(flag(f.name), action=action, default=f.default,
                               help=meta["help"] + (" (default: on)" if f.default else ""))
            continue
        help_text = meta["help"]
        if f.default is not None and "default" not in help_text:
            help_text += f" (default: {f.default})"
        group.add_argument(flag(f.name), type=_scalar_type(kind), default=f.default, choices=meta["choices"],
                           metavar=meta["metavar"], help=help_text)
    return groups


def engine_field(name: str, **changes: Any) -> Any:
    """A dataclass field that repeats EngineArgs' `name` (its default and help, with `changes`): a
    trainer config's engine setting, declared where its meaning is kept."""
    original = next(f for f in fields(EngineArgs) if f.name == name)
    metadata = {**original.metadata, **{k: v for k, v in changes.items() if k != "default"}}
    return dataclasses.field(default=changes.get("default", original.default), metadata=metadata)

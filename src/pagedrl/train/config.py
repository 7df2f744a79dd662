"""Trainer configs: typed dataclasses with TRL's field names, loaded from YAML plus `key=value` overrides.

One dataclass per algorithm (`offline_config.py`: SFT, reward model, DPO; `rl/config.py`: GRPO, PPO),
all sharing `TrainConfig` here (the optimizer, schedule, data and bookkeeping fields of transformers'
TrainingArguments that one trainer loop needs). Names follow
TRL so a TRL recipe reads the same here; defaults follow TRL except where a CPU-first trainer
needs otherwise (noted at the field).

Loading checks every value against the field's type hint before the dataclass is built, so a typo
or a wrong type fails at start-up with the key, where it came from and what was expected — not
as a TypeError twenty minutes into a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_type_hints

import torch
import yaml

from pagedrl.model.bnb_quant import QUANT_TYPES
from pagedrl.model.lora import ALL_LINEAR
from pagedrl.model.precision import choose_precision
from pagedrl.model.projections import LAYER_PROJECTIONS
from pagedrl.model.quantized_linear import QuantizedBase
from pagedrl.train.config_values import MISSING, coerce, describe, load_yaml
from pagedrl.train.schedules import ScheduleError, check_schedule
from pagedrl.train.trl_names import NULL_IS_UNSET, RATIO_STEPS, fixed_value, not_here, trl_form
from pagedrl.train.trl_trainer_args import CHECKED, STRATEGY_FIELDS, check_against

REPORTERS: tuple[str, ...] = ("none", "jsonl", "tensorboard")
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # bnb_4bit_compute_dtype
# transformers' TrainingArguments `fsdp` options understood here; `auto_wrap` (one unit per decoder
# layer) is what sharding always does, so it may be named or left out.
FSDP_OPTIONS: tuple[str, ...] = ("full_shard", "shard_grad_op", "auto_wrap")


class TrainConfigError(ValueError):
    """A config value that is well-typed but unusable; `key` names the field."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise TrainConfigError(key, message)


@dataclass
class TrainConfig:
    """Fields every trainer shares."""

    # TRL / transformers keys (not fields) whose accepted values hang on the fields: checked on the built config.
    trl_checked: ClassVar[tuple[str, ...]] = CHECKED

    # What to train, on what, and where to write it.
    model: str = "smollm2-135m-instruct"  # the default's name, a Hugging Face folder or Hub id, or a .gguf file
    revision: str | None = None  # of `model`, when it is a Hub id: a branch, tag or commit
    dataset: str | None = None  # JSONL, JSON, Parquet or Arrow file, a folder of them, or a built-in dataset name
    eval_dataset: str | None = None
    # TRL's: the split read from a folder of splits (Parquet shards, a save_to_disk DatasetDict), and the
    # configuration, of those a downloaded Hub dataset's README.md declares (None: its default).
    dataset_train_split: str = "train"  # of `dataset`
    dataset_test_split: str = "test"  # of `eval_dataset`
    dataset_config: str | None = None
    output_dir: str = "trainer_output"

    # Optimizer and schedule. optim: transformers' names of torch's AdamW (adamw_torch_fused its fused
    # kernel, transformers 5's default; the same update, rounded differently) and plain SGD.
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd"] = "adamw_torch"
    learning_rate: float = 5e-5
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_steps: int = -1  # -1: derive from num_train_epochs
    num_train_epochs: float = 3.0
    # transformers' SchedulerType names that need no metric (train/schedules.py), and their options as
    # transformers' lr_scheduler_kwargs (e.g. cosine_with_min_lr: {min_lr_rate: 0.1}).
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = 0  # wins over warmup_ratio when > 0
    warmup_ratio: float = 0.0
    # True: transformers' warm-up, whose first step trains at learning rate 0. False: step s of a
    # w-step warm-up trains at (s+1)/(w+1) of the peak, for runs of a few costly steps (a demo's
    # GRPO step is a rollout of seconds to a minute) where a step that only fills Adam's moments is
    # a step lost, while a first step at the full rate is Adam's sign step on one noisy batch.
    warmup_starts_at_zero: bool = True
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping

    # Data: rows longer than max_length are cut ("truncate", keeping the start as TRL's
    # keep_start; SFT's and DPO's truncation_mode: keep_end keeps the end), dropped ("skip") or refused ("error").
    max_length: int | None = 1024
    truncation: Literal["truncate", "skip", "error"] = "truncate"
    # A malformed row (bad JSON, missing field, wrong type, empty completion) stops the run with its
    # file and line ("error"), or is skipped and counted in the start summary ("skip").
    on_bad_row: Literal["error", "skip"] = "error"

    # Bookkeeping.
    # Every N steps; a float below 1 is a ratio of the total steps (transformers 5's reading).
    logging_steps: int | float = 10
    eval_steps: int | float | None = None  # None: no periodic evaluation
    eval_on_start: bool = True  # with eval_steps: evaluate the starting model too (step 0)
    save_steps: int | float | None = 500  # None: no checkpoints (transformers' save_strategy "no"), final/ only
    save_total_limit: int | None = None
    # Stop cleanly (a last evaluation, then `final/`) once training, evaluations excluded, has run
    # this long: equal wall-clock budgets for runs whose steps cost different amounts.
    max_train_minutes: float | None = None
    seed: int = 42
    resume_from_checkpoint: str | bool | None = None  # a checkpoint directory, or true: latest in output_dir
    report_to: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])

    # Hardware. TRL turns gradient checkpointing on by default; on a CPU with a small model it
    # only costs time, so it is off here.
    gradient_checkpointing: bool = False
    bf16: bool | None = None  # None: where the device computes bf16 natively (CUDA; CPUs with AVX512-BF16, AMX, Arm BF16)
    # bf16 runs: offset the float32 masters once by under half a bf16 step, so that the bf16 copies
    # every forward computes with move with the masters (train/dither.py). False: plain autocast, as TRL.
    bf16_dither: bool = True
    use_cpu: bool = False
    # Under torchrun: shard parameters, gradients and optimizer state with FSDP2 instead of
    # replicating them with DDP. transformers' spelling: "full_shard" (ZeRO-3) or "shard_grad_op"
    # (ZeRO-2: layers stay gathered between forward and backward), optionally "... auto_wrap".
    fsdp: str | None = None

    # LoRA (TRL's ModelConfig names): train low-rank adapters on the frozen base, not every weight.
    # Adapters usually want a larger learning_rate than full fine-tuning (1e-4 to 1e-3).
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] | None = None  # None: q_proj, v_proj (PEFT's default); [all-linear]: every projection
    # A mixture of experts' stacked weights (PEFT's target_parameters: "mlp.experts.gate_up_proj",
    # "mlp.experts.down_proj"); with lora_target_modules unset, only those. Needs lora_dropout: 0, as PEFT.
    lora_target_parameters: list[str] | None = None
    # QLoRA (TRL's ModelConfig names, with use_peft): the frozen base's decoder projections held in
    # bitsandbytes' 4-bit blocks (nf4, or fp4) or LLM.int8's int8 rows; the adapters train in float32.
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    # None: nf4, except that a GGUF model's projections already in at most 4 bits (8 with load_in_8bit) keep
    # the file's own blocks (no second rounding); nf4 or fp4: every projection quantized to it
    bnb_4bit_quant_type: str | None = None
    use_bnb_nested_quant: bool = False  # double quantization of the 4-bit block maxima
    bnb_4bit_compute_dtype: str | None = None  # None: the run's precision (bf16 autocast or float32)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Range checks a type hint cannot express; raises TrainConfigError naming the field."""
        for f in dataclasses.fields(self):  # YAML reads .inf and .nan as floats: no field has a use for them
            value = getattr(self, f.name)
            items = value if isinstance(value, (list, tuple)) else [value]
            _require(not any(isinstance(v, float) and not math.isfinite(v) for v in items), f.name,
                     f"must be finite, got {value}")
        for key in ("model", "output_dir"):
            _require(bool(str(getattr(self, key)).strip()), key, "is empty")
        _require(self.learning_rate >= 0, "learning_rate", f"must be >= 0, got {self.learning_rate}")
        for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        for key in RATIO_STEPS:
            v = getattr(self, key)
            _require(v is not None or key != "logging_steps", key, "must be set (>= 1, or a ratio below 1)")
            _require(v is None or (v >= 1 and v == int(v)) or 0 < v < 1, key,
                     f"must be an integer >= 1 or a ratio of the total steps in (0, 1), got {v}")
        _require(self.max_steps == -1 or self.max_steps >= 1, "max_steps", f"must be -1 or >= 1, got {self.max_steps}")
        _require(self.num_train_epochs > 0, "num_train_epochs", f"must be > 0, got {self.num_train_epochs}")
        _require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(0.0 <= self.warmup_ratio <= 1.0, "warmup_ratio", f"must lie in [0, 1], got {self.warmup_ratio}")
        try:
            check_schedule(self.lr_scheduler_type, self.lr_scheduler_kwargs, self.learning_rate,
                           self.warmup_steps > 0 or self.warmup_ratio > 0, self.warmup_starts_at_zero)
        except ScheduleError as e:
            raise TrainConfigError(e.key, e.message) from None
        _require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        for key in ("adam_beta1", "adam_beta2"):
            _require(0.0 <= getattr(self, key) < 1.0, key, f"must lie in [0, 1), got {getattr(self, key)}")
        _require(self.adam_epsilon > 0, "adam_epsilon", f"must be > 0, got {self.adam_epsilon}")
        _require(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0 (0 disables), got {self.max_grad_norm}")
        for key in ("max_length", "save_total_limit"):
            value = getattr(self, key)
            _require(value is None or value >= 1, key, f"must be null or >= 1, got {value}")
        _require(self.max_train_minutes is None or self.max_train_minutes > 0, "max_train_minutes",
                 f"must be null or > 0, got {self.max_train_minutes}")
        out = Path(self.output_dir)
        blocking = next((p for p in (out, *out.parents) if p.is_file()), None)
        _require(blocking is None, "output_dir", f"{blocking} is a file, not a folder")
        options = (self.fsdp or "").split()
        _require(all(o in FSDP_OPTIONS for o in options), "fsdp",
                 f"unknown option in {self.fsdp!r}; expected full_shard or shard_grad_op, optionally with auto_wrap")
        _require(not options or sum(o in ("full_shard", "shard_grad_op") for o in options) == 1, "fsdp",
                 f"{self.fsdp!r} needs exactly one of full_shard or shard_grad_op")
        _require(self.lora_r >= 1, "lora_r", f"must be >= 1, got {self.lora_r}")
        _require(self.lora_alpha > 0, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        _require(0.0 <= self.lora_dropout < 1.0, "lora_dropout", f"must lie in [0, 1), got {self.lora_dropout}")
        if self.lora_target_modules is not None:
            bad = [t for t in self.lora_target_modules if t not in (*LAYER_PROJECTIONS, ALL_LINEAR)]
            _require(not bad and bool(self.lora_target_modules), "lora_target_modules",
                     f"{bad or 'empty'}: expected decoder projections ({', '.join(LAYER_PROJECTIONS)}) or {ALL_LINEAR}")
        _require(self.lora_target_parameters is None or bool(self.lora_target_parameters), "lora_target_parameters",
                 "empty; name expert weights (mlp.experts.gate_up_proj, mlp.experts.down_proj) or leave it unset")
        _require(not (self.lora_target_parameters and self.lora_dropout), "lora_dropout",
                 f"must be 0 with lora_target_parameters, got {self.lora_dropout} (as in PEFT, a dropped input "
                 "cannot be folded into an expert weight's update)")
        quantized = "load_in_4bit" if self.load_in_4bit else "load_in_8bit" if self.load_in_8bit else None
        _require(not (self.load_in_4bit and self.load_in_8bit), "load_in_4bit",
                 "load_in_4bit and load_in_8bit are both true; choose one")
        _require(quantized is None or self.use_peft, str(quantized),
                 "a quantized base only trains adapters; set use_peft: true (QLoRA)")
        _require(quantized is None or not options, str(quantized),
                 f"a quantized base under FSDP (fsdp={self.fsdp!r}) is not supported; use DDP (leave fsdp unset)")
        _require(self.bnb_4bit_quant_type in (None, *QUANT_TYPES), "bnb_4bit_quant_type",
                 f"unknown {self.bnb_4bit_quant_type!r}; expected null or one of {', '.join(QUANT_TYPES)}")
        _require(self.bnb_4bit_compute_dtype in (None, *COMPUTE_DTYPES), "bnb_4bit_compute_dtype",
                 f"unknown {self.bnb_4bit_compute_dtype!r}; expected null or one of {', '.join(COMPUTE_DTYPES)}")
        _require(not (self.use_peft and options), "fsdp",
                 "LoRA (use_peft) under FSDP2 is not supported; use DDP (leave fsdp unset) with use_peft")
        unknown = [r for r in self.report_to if r not in REPORTERS]
        _require(not unknown, "report_to", f"unknown {unknown}; expected some of {', '.join(REPORTERS)}")

    @property
    def quantized_base(self) -> QuantizedBase | None:
        """How the frozen base is held under load_in_4bit / load_in_8bit; None for a float base."""
        if not (self.load_in_4bit or self.load_in_8bit):
            return None
        dtype = getattr(torch, self.bnb_4bit_compute_dtype) if self.bnb_4bit_compute_dtype else None
        return QuantizedBase(4 if self.load_in_4bit else 8, self.bnb_4bit_quant_type, self.use_bnb_nested_quant, dtype)

    def use_bf16(self, device: str | Any) -> bool:
        """Whether to compute in bfloat16 on `device` (a torch.device or its string): `bf16` when
        set, else where the device computes it natively (CUDA, a CPU with bf16 instructions)."""
        if self.bf16 is not None:
            return self.bf16
        return choose_precision(str(device)).dtype == torch.bfloat16

    def precision_reason(self, device: str | Any) -> str:
        """Why `use_bf16` says what it says, for the start-up line."""
        if self.bf16 is not None:
            return f"bf16={str(self.bf16).lower()}"
        return choose_precision(str(device)).reason

    @property
    def fsdp_reshard_after_forward(self) -> bool | None:
        """None: no sharding (DDP); else whether layers reshard after forward (full_shard)."""
        options = (self.fsdp or "").split()
        return ("full_shard" in options) if options else None

    def num_warmup_steps(self, total_steps: int) -> int:
        """Warm-up length: `warmup_steps` if set, else ceil(`warmup_ratio` × total), as transformers."""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * total_steps)


def validate_router_coef(coef: float | None) -> None:
    """`router_aux_loss_coef` of SFT, DPO and GRPO: the model's (None) or a number (0: off)."""
    _require(coef is None or math.isfinite(coef), "router_aux_loss_coef", f"must be null or a finite number, got {coef}")


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

C = TypeVar("C", bound=TrainConfig)
COMMAND_LINE = "command line"
def _unknown_key(cls: type, key: Any, source: str, names: Sequence[str], field: str | None = None) -> ValueError:
    if field is not None:  # TRL's spelling of a field this config lacks (another algorithm's)
        return ValueError(f"{source}: {key!r} is TRL's name for {field!r}, which {cls.__name__} does not have")
    why = not_here(str(key))
    if why is not None:  # a TRL / transformers option: say so, not a near miss of another field
        return ValueError(f"{source}: {key!r} is a TRL / transformers option {cls.__name__} does not have: {why}")
    guess = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean {guess[0]!r}?" if guess else f"; see {cls.__name__} for the fields"
    return ValueError(f"{source}: unknown key {key!r} for {cls.__name__}{hint}")


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ValueError(f"yaml_path: {path} is a folder; expected a YAML config file")
    if not path.is_file():
        raise ValueError(f"yaml_path: config file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"config file {path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                         f"column {column}); save it as UTF-8") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping of key: value, got {type(data).__name__}")
    return data


def _parse_override(item: str) -> tuple[str, str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{COMMAND_LINE}: override {item!r} is not of the form key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML (an unbalanced bracket, say): the text itself
    return key, raw, value


def load_config(cls: type[C], yaml_path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """Build `cls` from its defaults, then the YAML file, then `key=value` overrides (last wins).

    Override values are read as YAML scalars (`beta=0.2` is a float, `bf16=null` is None,
    `reward_funcs=[accuracy, format]` a list); a field that wants text keeps the raw text
    (`output_dir=2024`). Unknown keys, wrong types and out-of-range values are ValueErrors that
    name the key, where the value came from and what was expected.
    """
    if isinstance(overrides, str):
        raise ValueError("overrides: expected a list of 'key=value' strings, got one string")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    spellings: dict[tuple[str, str], dict[Any, Any]] = {}  # (source, field) -> each spelling given there: its value
    checks: dict[str, tuple[Any, str]] = {}  # a `trl_checked` key -> its last value and where it came from

    def put(key: Any, value: Any, source: str, raw: str | None = None) -> None:
        given = key
        if value is None and key in NULL_IS_UNSET:
            return
        if isinstance(key, str):
            key, value = trl_form(key, value)  # TRL's spellings of pagedrl's fields and of their values
            if key not in names and key in cls.trl_checked:  # e.g. save_strategy: steps needs save_steps
                checks[key] = (value, source)
                return
            if key not in names and fixed_value(key, value, source):  # a TRL option set to what pagedrl does
                return
        if key not in names:
            raise _unknown_key(cls, given, source, names, field=key if key != given else None)
        out = coerce(value, hints[key])
        if out is MISSING and raw is not None and value is not None:
            out = coerce(raw, hints[key])  # e.g. a str field given `2024` or `yes`
        if out is MISSING:
            named = key if given == key else f"{key} (as {given})"
            raise ValueError(f"{source}: {named}: expected {describe(hints[key])}, got {value!r}")
        # Two spellings of one field in one place (pagedrl's and TRL's, or two of TRL's) must agree: which one
        # wins would otherwise hang on their order. A later place (an override after the file) still wins.
        seen = spellings.setdefault((source, key), {})
        for other, before in seen.items():
            if other != given and before != out:
                raise ValueError(f"{source}: {other} and {given} both set {key}, to {before!r} and {out!r}; keep one")
        seen[given] = out
        values[key], sources[key] = out, source if given == key else f"{source}, as {given}"

    if yaml_path is not None:
        path = Path(yaml_path)
        for key, value in _read_yaml(path).items():
            put(key, value, f"config file {path}")
    for item in overrides:
        key, raw, value = _parse_override(item)
        put(key, value, COMMAND_LINE, raw)
    for key, (value, source) in checks.items():  # a strategy "no": none, unless the command line sets the steps
        steps = STRATEGY_FIELDS.get(key)
        if value == "no" and steps and not (source != COMMAND_LINE and sources.get(steps, "") == COMMAND_LINE):
            values[steps], sources[steps] = None, f"{source}, as {key}"
    try:
        config = cls(**values)
    except TrainConfigError as e:
        source = sources.get(e.key.split(".")[0], "defaults")  # lr_scheduler_kwargs.<key>: the mapping's
        raise TrainConfigError(e.key, f"{e.message} (from {source})") from None
    for key, (value, source) in checks.items():
        problem = check_against(key, value, config)
        if problem is not None:
            raise ValueError(f"{source}: {key}: {problem}")
    return config


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """Plain dict of every field, for `config.yaml` beside a checkpoint; `load_config` reads it back."""
    return dataclasses.asdict(config)

"""On-policy knowledge distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models"),
as TRL 1.16's DistillationTrainer does it, on the one trainer loop.

Each step the paged engine, running on the student's own tensors, samples one completion for each of the
step's prompts (GRPO's prompts and rollouts, without verifiers); the frozen teacher reads the same packed
tokens; at every completion position the student's next-token distribution is pulled toward the teacher's
over the whole vocabulary by `losses.generalized_jsd` (beta 0: forward KL, 1: reverse KL, between: the
generalized JSD; both softened by `temperature`, which also sets the sampling), the heads run in chunks
(`logprobs.divergence_from_hidden`). The loss is the sum over the step's completion tokens divided by their
number over all micro-batches and ranks, TRL's `num_items_in_batch`.

Metrics under TRL's names: `entropy` (the student's, at `temperature`: each micro-batch's per-token mean,
averaged over the micro-batches of the logging window as TRL does; across processes the processes' means are
averaged, where TRL pools each micro-batch's tokens over processes first), `num_tokens`,
`completions/mean_length`, `/min_length`, `/max_length`, `/clipped_ratio`, `/mean_terminated_length`,
`/min_terminated_length`, `/max_terminated_length` (over the step's completions on every rank; those of
the completions that ended with EOS, 0 when none did).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithms.dpo import frozen, load_frozen
from pagedrl.train.config import _require
from pagedrl.train.distributed import DistInfo, gather_objects
from pagedrl.train.logprobs import divergence_from_hidden
from pagedrl.train.losses import aggregate
from pagedrl.train.metrics import Metric
from pagedrl.train.rl.config import OnlineConfig
from pagedrl.train.rl.online import OnlineAlgorithm
from pagedrl.train.rl.packing import PackedBatch, pack, split_units
from pagedrl.train.rl.rollout import Rollout, sample
from pagedrl.train.trl_trainer_args import CHECKED


@dataclass
class DistillationConfig(OnlineConfig):
    """TRL's DistillationConfig: `per_device_train_batch_size` counts prompts, each answered once, so a step
    trains on per_device × accumulation × world completions. `reward_funcs`, if given, only score the held-out
    evaluation (the arithmetic task's own verifier by default)."""

    trl_checked: ClassVar[tuple[str, ...]] = CHECKED

    num_generations: int = 1  # pagedrl's own key (TRL's DistillationConfig has none): only 1 is accepted
    log_completions: bool = False  # TRL's default
    num_completions_to_print: int | None = None
    teacher_model_name_or_path: str | None = None  # a model folder, GGUF file or Hub id of the student's vocabulary
    teacher_model_revision: str | None = None
    beta: float = 1.0  # 0: forward KL, 0.5: JSD, 1: reverse KL (TRL's default)
    teacher_model_init_kwargs: dict[str, Any] | None = None  # only `dtype`: bfloat16, float16 or float32

    def validate(self) -> None:
        super().validate()
        _require(0.0 <= self.beta <= 1.0, "beta", f"must be in [0.0, 1.0], got {self.beta}")
        kwargs = self.teacher_model_init_kwargs or {}
        _require(isinstance(kwargs, dict) and set(kwargs) <= {"dtype"}, "teacher_model_init_kwargs",
                 f"only `dtype` is read (the teacher is loaded by teacher_model_name_or_path and "
                 f"teacher_model_revision), got {kwargs!r}")
        _require(kwargs.get("dtype") in tuple(TEACHER_DTYPES), "teacher_model_init_kwargs",
                 f"dtype must be one of {sorted(k for k in TEACHER_DTYPES if k)} or unset (the precision the run "
                 f"computes in), got {kwargs.get('dtype')!r}; 'auto' is not read from the checkpoint")
        _require(self.num_generations == 1, "num_generations", f"TRL's DistillationTrainer samples one completion "
                 f"per prompt (per_device_train_batch_size sets how many prompts), got {self.num_generations}")


TEACHER_DTYPES = {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def teacher_dtype(config: DistillationConfig, device: torch.device) -> torch.dtype:
    """`teacher_model_init_kwargs`' dtype, else the precision the run computes in (bfloat16 under `bf16`, else
    float32): a frozen model's forwards run in that precision anyway, so its float32 copy would only cost memory."""
    named = TEACHER_DTYPES[(config.teacher_model_init_kwargs or {}).get("dtype")]
    return named or (torch.bfloat16 if config.use_bf16(device) else torch.float32)


class Distillation(OnlineAlgorithm):
    name = "distill"
    normaliser = "completion tokens"
    config: DistillationConfig

    def __init__(self, config: DistillationConfig, model: torch.nn.Module, tokenizer: Tokenizer, dist: DistInfo,
                 teacher: torch.nn.Module, eos_token_ids: list[int] | None = None,
                 generation_config: dict[str, Any] | None = None) -> None:
        ours, theirs = model.config.vocab_size, teacher.config.vocab_size
        if ours != theirs:
            raise ValueError(f"teacher_model_name_or_path: the teacher's vocabulary has {theirs} tokens, the "
                             f"student's {ours}; distillation compares the two next-token distributions token by "
                             "token, so the teacher must share the student's vocabulary")
        self.prompts_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps  # per rank
        self.examples_per_step = self.prompts_per_step * dist.world_size
        super().__init__(config, model, tokenizer, dist, self.prompts_per_step, eos_token_ids,
                         generation_config=generation_config, needs_reward_funcs=False)
        self.model = model
        device = next(model.parameters()).device
        self.teacher = frozen(teacher.to(device=device))  # in the dtype it was loaded in (`teacher_dtype`)
        self.rollout: Rollout | None = None
        self.batches: list[PackedBatch] = []

    def step_batches(self, step: int) -> list[PackedBatch]:
        """Each step its own rollout: this rank's share of the step's prompts, one completion each."""
        with self.full_weights():
            rows, seeds = self.next_prompts(self.examples_per_step)
            self.rollout = sample(self.llm, rows, self.sampling, seeds)
            self.llm.sleep()  # the optimizer runs next: the KV cache gives its memory back until the next rollout
        device = next(self.model.parameters()).device
        units = split_units(self.rollout, self.config.gradient_accumulation_steps)
        self.batches = [pack(self.rollout, u, device) for u in units]
        return self.batches

    def count(self, batch: PackedBatch) -> float:
        return float(batch.mask.sum())

    def loss(self, model: Any, b: PackedBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        c = self.config
        hidden = model(b.input_ids, positions=b.positions, meta=b.meta)
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, b.predict_at)
        with torch.no_grad():
            t_hidden = self.teacher(b.input_ids, positions=b.positions, meta=b.meta)
            t_rows = t_hidden.reshape(-1, t_hidden.shape[-1]).index_select(0, b.predict_at)
        div, entropy = divergence_from_hidden(partial(model.logits, float32_out=True), rows,
                                              partial(self.teacher.logits, float32_out=True), t_rows, c.beta,
                                              c.temperature)
        loss = aggregate(b.to_padded(div), b.mask, "token_mean", normaliser=global_count)
        n_tok = b.mask.sum()
        # TRL logs each micro-batch's mean (0 without tokens) and averages those over the logging window
        return loss, {"entropy": Metric.mean(entropy.sum() / n_tok.clamp(min=1)),
                      "num_tokens": Metric.cumulative(float(b.input_ids.numel()))}

    def step_metrics(self, step: int) -> dict[str, Any]:
        """TRL's completion statistics over every rank's completions (TRL gathers them before it logs)."""
        assert self.rollout is not None
        parts = gather_objects((self.rollout.lengths, self.rollout.truncated), self.dist)
        lengths = torch.cat([p[0] for p in parts]).to(torch.float64)
        truncated = torch.cat([p[1] for p in parts])
        ended = lengths[~truncated] if bool((~truncated).any()) else lengths.new_zeros(1)
        values = {"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                  "completions/max_length": lengths.max(),
                  "completions/clipped_ratio": truncated.to(torch.float64).mean(),
                  "completions/mean_terminated_length": ended.mean(),
                  "completions/min_terminated_length": ended.min(),
                  "completions/max_terminated_length": ended.max()}
        # every rank holds the same values: a mean over ranks is each one, over a logging window TRL's mean
        return {name: Metric.mean(float(v)) for name, v in values.items()}

    def sample_completions(self, step: int) -> list[dict[str, Any]]:
        if not self.config.log_completions or self.rollout is None:
            return []
        k = self.config.num_completions_to_print
        return self.rollout.sample_rows(len(self.rollout) if k is None else k, [])

    def summary_lines(self) -> list[str]:
        c = self.config
        kind = {0.0: "forward KL", 1.0: "reverse KL"}.get(c.beta, f"generalized JSD (beta={c.beta})")
        return [
            f"distill: {self.prompts_per_step} prompts per rank per step, one completion each, "
            f"{c.max_completion_length} tokens max, temperature {c.temperature}",
            f"distill: teacher {c.teacher_model_name_or_path} (frozen, "
            f"{str(next(self.teacher.parameters()).dtype).removeprefix('torch.')}), {kind} over the whole vocabulary at "
            f"each completion token; {len(self.eval_rows)} held-out prompts",
            f"distill: {self.rollout_line()}",
        ]


def run_distill(config: DistillationConfig, progress: bool = True) -> Path:
    """Distil `config.teacher_model_name_or_path` into `config.model`; returns `output_dir/final`."""
    from pagedrl.train.start import start_run
    from pagedrl.train.trainer import Trainer

    if config.teacher_model_name_or_path is None:  # (TRL's config has none either; its trainer takes one)
        raise ValueError("teacher_model_name_or_path: distillation needs a teacher: a model folder, GGUF file or Hub "
                         "id with the student's vocabulary")
    check_teacher_folder(config.teacher_model_name_or_path)
    dist, loaded = start_run(config, "distillation needs")
    teacher = load_frozen(config.teacher_model_name_or_path, dist.device, teacher_dtype(config, dist.device),
                          config.teacher_model_revision)
    algorithm = Distillation(config, loaded.model, loaded.tokenizer, dist, teacher,
                             eos_token_ids=loaded.eos_token_ids, generation_config=loaded.generation_config or None)
    return Trainer(config, algorithm, dist, progress=progress).train()


def check_teacher_folder(teacher: str) -> None:
    """A local teacher path (not a Hub id: two slashes or more, or rooted) must exist, before the student loads;
    a run's `<output_dir>/final` whose config is under examples/ is named with the command that writes it."""
    path = Path(teacher).expanduser()
    if path.exists() or not (teacher.count("/") >= 2 or teacher.startswith(("/", ".", "~"))):
        return
    run = path.parent.name if path.name == "final" else ""
    example = Path("examples") / f"{run}.yaml"
    how = (f"`pagedrl {run.split('_')[0]} {example}` writes it" if run and example.is_file()
           else "train the teacher first or name another")
    raise ValueError(f"teacher_model_name_or_path: {teacher} is not a folder or file; {how}")

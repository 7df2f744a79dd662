"""The one trainer loop every algorithm runs on (SFT, reward model, DPO, GRPO, PPO).

Per optimizer step: ask the algorithm for this rank's micro-batches, sum their normaliser counts
and all-reduce the sum (before any forward pass), then run each micro-batch's loss — divided by
that global count — and backward, clip, step the optimizer and the schedule (`train/optim.py` builds
them), log, evaluate, save.

Why the gradient does not depend on the split: every micro-batch's loss is its sum divided by the
step's global count, so the contributions of all micro-batches on all ranks add up to the loss of
the whole step. DDP averages gradients over ranks, so each rank multiplies its loss by the world
size before backward to turn that average back into the sum (FSDP2's reduce-scatter averages
too). Micro-batches before the last run without gradient sync, so gradients cross the network
once per step. Replicated (DDP) or sharded (FSDP2, `fsdp: full_shard`): see `train/parallel.py`.

Each logged row holds `step`, `epoch`, `learning_rate`, `loss` (mean since the last row), `grad_norm`
(before clipping), the algorithm's metrics, `wall_time` and `train_time` (without evaluations), and
evaluations are rows of their own (`eval/<name>`, at step 0 and every `eval_steps`).

Precision: float32 parameters and optimizer state; the forward and backward run under bfloat16
autocast where the device computes bf16 natively (CUDA, a CPU with AVX512-BF16, AMX or Arm BF16:
`model/precision.py`), in float32 elsewhere; config `bf16` forces either.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedrl.train import adapters
from pagedrl.train import checkpointing as ckpt
from pagedrl.train.algorithm import Algorithm
from pagedrl.train.config import TrainConfig, config_to_dict
from pagedrl.train.distributed import (
    DistInfo,
    all_reduce_op,
    all_reduce_sum,
    barrier,
    broadcast_object,
    gather_objects,
)
from pagedrl.train.interrupt import StopFlag, TrainingInterrupted
from pagedrl.train.logging import RunLogger
from pagedrl.train.metrics import Metric, MetricTotals, as_metric
from pagedrl.train.optim import build_optimizer, check_same_optim, total_steps
from pagedrl.train.parallel import Parallel
from pagedrl.train.trl_names import RATIO_STEPS, steps_of


class ModelHandle:
    """What `Algorithm.loss` receives as `model`: calling it runs the (DDP/FSDP) forward, any
    other attribute (`logits`, `config`, ...) is the plain module's. Call it once per micro-batch."""

    def __init__(self, wrapped: nn.Module, module: nn.Module) -> None:
        self._wrapped, self._module = wrapped, module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@dataclass
class StepResult:
    loss: float  # the step's loss: Σ of every micro-batch's contribution on every rank
    metrics: MetricTotals  # reduced over micro-batches and ranks
    global_count: float
    num_micro_batches: int


class Trainer:
    def __init__(self, config: TrainConfig, algorithm: Algorithm, dist: DistInfo | None = None,
                 progress: bool = True) -> None:
        self.config, self.algorithm = config, algorithm
        if config.eval_steps and not algorithm.evaluates:  # as transformers' Trainer refuses it
            raise ValueError(f"eval_steps: {config.eval_steps} asks for evaluations, but there is nothing to "
                             "evaluate: give an eval_dataset, or leave eval_steps unset")
        self.dist = dist or DistInfo(device=next(algorithm.model.parameters()).device)
        self.module = algorithm.model
        if any(p.dtype != torch.float32 for p in self.module.parameters()):
            self.module.float()  # master weights and optimizer state in float32; autocast does bf16
        self.module.train()
        if config.gradient_checkpointing:
            for m in self.module.modules():
                if hasattr(m, "gradient_checkpointing"):
                    m.gradient_checkpointing = True
        self.parallel = Parallel(self.module, self.dist, config.fsdp_reshard_after_forward,
                                 algorithm.find_unused_parameters)
        self.wrapped: nn.Module = self.parallel.wrapped
        algorithm.full_weights = self.parallel.full_weights  # rollouts see whole weights when sharded
        self.handle = ModelHandle(self.wrapped, self.module)
        self.bf16 = config.use_bf16(self.dist.device)
        self.total_steps = total_steps(config, algorithm)
        self.warmup_steps = config.num_warmup_steps(self.total_steps)
        # Below 1: ratios of the total steps, as transformers 5 reads them.
        self.logging_steps, self.eval_steps, self.save_steps = (
            steps_of(getattr(config, key), self.total_steps) for key in RATIO_STEPS)
        self.optimizer, self.lr_scheduler = build_optimizer(self.module, config, self.warmup_steps, self.total_steps)
        self.output_dir = Path(config.output_dir)
        self.progress = progress
        self.step = 0
        self.weight_version = 0
        self.window = MetricTotals()  # metrics of the steps since the last logged row
        self.running: dict[str, float] = {}  # totals of `cumulative` metrics since the start
        self.time_offset = 0.0  # wall seconds of the run before a resume
        self._start = time.perf_counter()  # perf_counter at the (virtual) start of the run
        self.eval_seconds = 0.0
        self.log_history: list[dict[str, Any]] = []  # transformers' TrainerState.log_history
        self.logger: RunLogger | None = None
        self.stop = StopFlag()  # set by SIGINT/SIGTERM while `train` runs
        self.last_checkpoint: tuple[int, Path] | None = None  # (step, folder) of the newest save or resume

    # -- one step ---------------------------------------------------------------------------

    def accumulate(self, step: int) -> StepResult:
        """Forward and backward over this rank's micro-batches for `step`; gradients are left in
        `.grad` (summed over ranks), the optimizer is not stepped."""
        batches = list(self.algorithm.step_batches(step))
        count = float(all_reduce_sum([sum(float(self.algorithm.count(b)) for b in batches)], self.dist)[0])
        if self.dist.distributed:
            hi, neg_lo = all_reduce_op([len(batches), -len(batches)], self.dist, "max").tolist()
            if hi != -neg_lo:
                raise RuntimeError(f"step {step}: ranks produced between {-neg_lo:.0f} and {hi:.0f} micro-batches; "
                                   f"{self.parallel.kind} needs the same number on every rank")
        global_count = torch.tensor(count, dtype=torch.float32, device=self.dist.device)
        totals = MetricTotals()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        scale = float(self.dist.world_size)
        for i, batch in enumerate(batches):
            with self.parallel.sync(last=i == len(batches) - 1):
                with torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss, metrics = self.algorithm.loss(self.handle, batch, global_count)
                (loss * scale).backward()
            loss_sum += loss.detach().to(torch.float64)
            for name, m in metrics.items():
                totals.add(name, as_metric(m))
        for name, m in self.algorithm.step_metrics(step).items():
            totals.add(name, as_metric(m))
        step_loss = float(all_reduce_sum([float(loss_sum)], self.dist)[0])
        return StepResult(step_loss, totals.all_reduce(self.dist), count, len(batches))

    def optimizer_step(self) -> float:
        """Clip (max_grad_norm; 0 = no clipping), step the optimizer and the schedule; returns the norm."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        norm = self.parallel.clip_grad_norm(params, max_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # -- the run ----------------------------------------------------------------------------

    def train(self) -> Path:
        """Run to `total_steps` (resuming if configured); returns the `final/` folder. On SIGINT or
        SIGTERM it finishes the step, saves a checkpoint and raises `TrainingInterrupted`."""
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ValueError(f"output_dir: {self.output_dir} is a file, not a folder")
        resume, removed = None, []
        if self.dist.is_main:
            resume = ckpt.resolve_resume(self.config.resume_from_checkpoint, self.output_dir)
            removed = ckpt.remove_leftovers(self.output_dir)
        resume = broadcast_object(None if resume is None else str(resume), self.dist)
        if resume is not None:
            self.load(Path(resume))
        else:
            ckpt.seed_everything(self.config.seed)
        self.logger = RunLogger(self.output_dir, self.config.report_to, enabled=self.dist.is_main,
                                total_steps=self.total_steps, initial_step=self.step,
                                resume_step=self.step if resume is not None else None,
                                progress=self.progress)
        self.print_summary(resume, removed)
        self.logger.start_progress()
        self._start = time.perf_counter() - self.time_offset
        finished = False
        try:
            with self.stop.installed():
                if self.eval_steps and self.config.eval_on_start and self.step == 0:
                    self.evaluate()
                while self.step < self.total_steps and not self.out_of_time():
                    self.stop_if_asked()
                    self.run_step()
                self.stop_if_asked()  # a signal during the last step stops the caller too (a pipeline's next stage)
                just_saved = self.last_checkpoint is not None and self.last_checkpoint[0] == self.step
                if self.save_steps and self.step > 0 and not just_saved:
                    self.save_checkpoint()  # as transformers' Trainer saves its last step: a run extends from it
                final = self.save_final()
            finished = True
        finally:
            self.algorithm.close()
            self.logger.close(plot=self.dist.is_main and finished)
        return final

    def stop_if_asked(self) -> None:
        """Between steps: if any rank got SIGINT/SIGTERM, save this step (unless just saved) and
        raise TrainingInterrupted on every rank."""
        signum = self.stop.signum or 0
        if self.dist.distributed:  # every rank must stop at the same step, or DDP would hang
            signum = int(all_reduce_op([signum], self.dist, "max")[0])
        if not signum:
            return
        checkpoint = None
        if self.last_checkpoint is not None and self.last_checkpoint[0] == self.step:
            checkpoint = self.last_checkpoint[1]
        elif self.step > 0:
            checkpoint = self.save_checkpoint()
        stopped = TrainingInterrupted(signum, self.step, checkpoint)
        self.logger.write(f"pagedrl {self.algorithm.name}: {stopped}")
        raise stopped

    def run_step(self) -> None:
        step = self.step + 1
        self.stop.step = step
        started = time.perf_counter()
        result = self.accumulate(step)
        lr = self.lr_scheduler.get_last_lr()[0]
        grad_norm = self.optimizer_step()
        self.step, self.weight_version = step, self.weight_version + 1
        self.algorithm.after_optimizer_step(step)
        # Seconds per step, averaged over the logging window: batches (rollouts), passes, update.
        self.window.add("step_time", Metric.mean(time.perf_counter() - started))
        self.window.add("loss", result.loss)
        self.window.merge(result.metrics)
        for name, (reduce, total, _) in result.metrics.items.items():
            if reduce == "cumulative":
                self.running[name] = self.running.get(name, 0.0) + total
        self.logger.advance()
        if step % self.logging_steps == 0 or step == self.total_steps:
            row = {"step": step, "epoch": self.algorithm.epoch, "learning_rate": lr}
            values = self.window.values(self.running)
            row["loss"] = values.pop("loss")
            row["grad_norm"] = grad_norm
            row.update(values)
            self.log(row)
            self.logger.log_completions(step, self.algorithm.sample_completions(step))
            self.window = MetricTotals()
        if self.eval_steps and step % self.eval_steps == 0:
            self.evaluate()
        if self.save_steps and step % self.save_steps == 0:
            self.save_checkpoint()

    def out_of_time(self) -> bool:
        """`max_train_minutes` spent (evaluations excluded; every rank takes rank 0's word): the
        run ends here, evaluated unless this step just was."""
        limit = self.config.max_train_minutes
        spent = time.perf_counter() - self._start - self.eval_seconds
        if not broadcast_object(limit is not None and self.step > 0 and spent >= 60 * limit, self.dist):
            return False
        self.logger.write(f"max_train_minutes={limit:g} reached after step {self.step} ({spent / 60:.2f} min)")
        if self.eval_steps and self.step % self.eval_steps:
            self.evaluate()
        return True

    def log(self, row: dict[str, Any]) -> None:
        wall = time.perf_counter() - self._start
        row["wall_time"] = wall
        row["train_time"] = wall - self.eval_seconds
        self.log_history.append(ckpt.transformers_log_row(row))
        self.logger.log(row)

    def evaluate(self) -> None:
        t0 = time.perf_counter()
        with self.parallel.full_weights(), \
                torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            metrics = self.algorithm.evaluate(self.step)
        self.eval_seconds += time.perf_counter() - t0
        if metrics:
            outcomes = metrics.pop("outcomes", None)
            if outcomes is not None:
                self.logger.log_eval_outcomes(self.step, outcomes)
            row = {"step": self.step, "epoch": self.algorithm.epoch}
            row.update({k if k.startswith("eval/") else f"eval/{k}": v for k, v in metrics.items()})
            self.log(row)

    # -- checkpoints ------------------------------------------------------------------------

    def trainer_state(self, optimizer: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "step": self.step,
            "weight_version": self.weight_version,
            "optimizer": optimizer if optimizer is not None else self.optimizer.state_dict(),
            "scheduler": self.lr_scheduler.state_dict(),
            "algorithm": self.algorithm.state_dict(),
            "window": self.window.state_dict(),
            "running": dict(self.running),
            "log_history": list(self.log_history),
            "wall_time": time.perf_counter() - self._start,
            "eval_seconds": self.eval_seconds,
            "world_size": self.dist.world_size,
            "algorithm_name": self.algorithm.name,
            "base_storage": adapters.base_storage(self.module),
        }

    def save_checkpoint(self) -> Path:
        folder = self.output_dir / f"{ckpt.CHECKPOINT_PREFIX}{self.step}"
        rngs = gather_objects(ckpt.rng_state(), self.dist)
        # Sharded: every rank joins the gathers of whole tensors, rank 0 writes them.
        model_state, optimizer = self.parallel.model_state(), self.parallel.optimizer_state(self.optimizer)
        if self.dist.is_main:
            state = self.trainer_state(optimizer)
            state["rng"] = rngs
            a, c = self.algorithm, self.config
            ours = {"step": self.step, "epoch": a.epoch, "weight_version": self.weight_version,
                    "total_steps": self.total_steps, "world_size": self.dist.world_size,
                    "examples_per_step": a.examples_per_step, "config": config_to_dict(c)}
            summary = ckpt.transformers_trainer_state(
                self.step, a.epoch, self.total_steps, self.logging_steps, self.eval_steps, self.save_steps,
                c.per_device_train_batch_size, self.log_history,
                math.ceil(self.total_steps * a.examples_per_step / a.num_examples) if a.num_examples else 0,
                int(self.running.get("num_tokens", 0)))
            size = ckpt.tensor_bytes(model_state or self.module.state_dict()) + ckpt.tensor_bytes(state)
            ckpt.write_checkpoint(folder, self.model_writer(model_state), state, summary, size_hint=size,
                                  own_summary=ours)
            ckpt.rotate_checkpoints(self.output_dir, self.config.save_total_limit, keep=folder)
        barrier(self.dist)
        self.last_checkpoint = (self.step, folder)
        return folder

    def save_final(self) -> Path:
        folder = self.output_dir / ckpt.FINAL_DIR
        model_state = self.parallel.model_state()
        if self.dist.is_main:
            ckpt.write_checkpoint(folder, self.model_writer(model_state),
                                  size_hint=ckpt.tensor_bytes(model_state or self.module.state_dict()))
            self.logger.write(f"saved {folder}")
        barrier(self.dist)
        return folder

    def model_writer(self, state: dict[str, torch.Tensor] | None) -> Any:
        """The algorithm's `save_model`, given the whole tensors gathered from the shards if any."""
        if state is None:
            return self.algorithm.save_model
        return lambda folder: self.algorithm.save_model(folder, state)

    def load(self, folder: Path) -> None:
        """Restore everything `save_checkpoint` wrote, so the next step is the one an
        uninterrupted run would have taken."""
        state = ckpt.load_trainer_state(folder)
        written_by = state.get("algorithm_name", self.algorithm.name)  # (older checkpoints do not say)
        if written_by != self.algorithm.name:
            raise ValueError(f"resume_from_checkpoint: {folder} was written by {written_by}, this run is "
                             f"{self.algorithm.name}; start {self.algorithm.name} from its model instead "
                             f"(model={folder})")
        check_same_optim(self.config.optim, state["optimizer"], folder)
        adapters.check_same_base(state.get("base_storage"), self.module, folder)
        with self.parallel.loading():
            self.algorithm.load_model(folder)
        self.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["scheduler"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.window.load_state_dict(state["window"])
        self.running = dict(state["running"])
        self.log_history = list(state.get("log_history", []))  # (older checkpoints kept none)
        self.step, self.weight_version = int(state["step"]), int(state["weight_version"])
        self.time_offset, self.eval_seconds = float(state["wall_time"]), float(state["eval_seconds"])
        rngs = state["rng"]
        ckpt.set_rng_state(rngs[self.dist.rank] if self.dist.rank < len(rngs) else rngs[0])
        self.last_checkpoint = (self.step, folder)

    # -- start summary ----------------------------------------------------------------------

    def print_summary(self, resume: str | None, removed: list[str] | None = None) -> None:
        c, a, d = self.config, self.algorithm, self.dist
        params = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        lines = [
            f"pagedrl {a.name}: {params / 1e6:.2f}M trainable parameters on {d.device} "
            f"({'bfloat16 autocast' if self.bf16 else 'float32'}: {c.precision_reason(d.device)}"
            f"{', dithered masters' if self.bf16 and c.bf16_dither else ''}"
            f"{', activation checkpointing' if c.gradient_checkpointing else ''})",
            f"  examples per step   {a.examples_per_step} = {c.per_device_train_batch_size} per micro-batch "
            f"x {c.gradient_accumulation_steps} accumulation steps x {d.world_size} process(es)",
            f"  total steps         {self.total_steps}"
            + (" (max_steps)" if c.max_steps > 0 else f" ({c.num_train_epochs:g} epochs)")
            + (f" = {self.total_steps * a.examples_per_step / a.num_examples:.2f} epochs of {a.num_examples} rows"
               if a.num_examples else ""),
            f"  learning rate       {c.learning_rate:g} ({c.optim}), {c.lr_scheduler_type}"
            f"{' ' + str(c.lr_scheduler_kwargs) if c.lr_scheduler_kwargs else ''} after {self.warmup_steps} warm-up "
            f"steps; max_grad_norm {c.max_grad_norm:g}",
            f"  loss normalised by  {a.normaliser} over the whole step (all micro-batches, all processes)",
        ]
        if d.distributed:
            lines.append(f"  parallelism         {self.parallel.kind} over {d.world_size} processes")
        elif c.fsdp:
            lines.append(f"  parallelism         one process: fsdp={c.fsdp!r} shards only under torchrun")
        if resume is not None:
            lines.append(f"  resuming from       {resume} (step {self.step})")
        for note in self.logger.notes if self.logger is not None else []:
            lines.append(f"  {note}")
        for what in removed or []:
            lines.append(f"  removed leftover    {what}")
        lines += ["  " + line for line in adapters.summary(self.module) + a.summary_lines()]
        if self.logger is not None:
            self.logger.write("\n".join(lines))

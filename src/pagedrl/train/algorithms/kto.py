"""Kahneman-Tversky optimisation on the one trainer loop: DPO's frozen reference and implicit reward, learnt
from unpaired feedback (each completion labelled desirable or undesirable on its own), as TRL 1.16's
KTOTrainer trains it.

KTO is DPO's machinery with another batch row and loss, so it is DPO's class grown: the reference (the
starting policy, `ref_model`, or under LoRA the base with its adapters off; TR-DPO's `sync_ref_model`;
`precompute_ref_log_probs`), the log-probs of answers after a shared prompt and the checkpoint state are
DPO's. A row `[prompt, completion, KL completion]` (`pair_batch`, the KL completion in the rejected
answer's place) gives in one forward the completion's summed log-probs and those of the mismatched pair
(prompt, a neighbour's completion: `unpaired.pair_kl`) whose mean over the micro-batch, policy less
reference, is KTO's KL reference point (`kto_losses.kl_estimate`; averaged over the ranks in training, as
TRL gathers it; without gradient, so its tokens add nothing to the backward). Then `kto_losses.kto_loss`
summed over the completions and divided by the completions of the whole step, so accumulation and DDP
give the gradient of TRL's mean. The KL term needs the rows in dataset order (TRL's sequential sampler), and
each micro-batch is exactly the block its KL completions were drawn from (`block_stream.BlockStream`): every
epoch ends with its short block and starts again at block 0, in training and in evaluation, under any
number of processes.

A mixture of experts adds the router load-balancing loss over the prompt and completion tokens (TRL's
forward of the batch; the KL sequences are a second forward there, without it), as DPO does.

Metrics under TRL's names: `kl`, `rewards/chosen` and `rewards/rejected` (β·log-ratio, mean over the
desirable and the undesirable completions), `rewards/margins`, `logps/chosen`, `logps/rejected`,
`logits/chosen`, `logits/rejected` (the vocabulary-mean logit, mean over each side's completion tokens),
`entropy` (mean over completion tokens), `num_tokens` (prompt + completion tokens since the start). Each but
`num_tokens` is one value per micro-batch (its rows pooled over the ranks in training) counting 1 in the logged
mean, as TRL appends one per micro-batch and its `log()` averages them (`kto_losses.kto_metrics`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.moe import collect_router_logits
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithm import OfflineAlgorithm
from pagedrl.train.algorithms.dpo import DPO, Dataset, ReferencedPair, answer_logps, run_with_reference
from pagedrl.train.algorithms.pair_batch import PairBatch
from pagedrl.train.block_stream import BlockStream, blocks_of
from pagedrl.train.data import load_train_and_eval
from pagedrl.train.distributed import all_reduce_sum
from pagedrl.train.examples import Preference
from pagedrl.train.kto_losses import kl_estimate, kto_loss, kto_metrics, uses_kl, weight_advice
from pagedrl.train.metrics import Metric
from pagedrl.train.offline_config import KTOConfig
from pagedrl.train.unpaired import Unpaired, UnpairedRows, pair_kl, unpair

# Metrics of a side (or both) a micro-batch may lack: TRL logs nothing for it then, not a 0.
ONE_SIDED = ("rewards/chosen", "logps/chosen", "logits/chosen", "rewards/rejected", "logps/rejected", "logits/rejected",
             "rewards/margins")


class KTO(DPO):
    name = "kto"
    normaliser = "completions"
    config: KTOConfig

    def read_examples(self, config: Any, tokenizer: Tokenizer, dataset: Dataset | None,
                      eval_dataset: Dataset | None) -> tuple[list[Any], Any, list[Any] | None]:
        """The rows, and with a KL loss each row's KL completion from its block of per_device_train_batch_size
        rows (the evaluation rows' too, as TRL's), before any reference log-prob is computed."""
        convert = UnpairedRows(tokenizer, config.max_length, config.truncation)
        items, report, eval_items = load_train_and_eval(
            config, dataset, eval_dataset, convert, "KTO needs a dataset of {prompt, completion, label} rows "
            "(or {prompt, chosen, rejected} pairs)")
        examples = unpair(items, "dataset")
        eval_examples = None if eval_items is None else unpair(eval_items, "eval_dataset")
        if uses_kl(config.loss_type):
            for rows in (examples, eval_examples or []):
                pair_kl(rows, config.per_device_train_batch_size, config.max_length)
        return examples, report, eval_examples

    def __init__(self, config: KTOConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.blocks: BlockStream | None = None
        if uses_kl(config.loss_type):  # each micro-batch one block of rows, as pair_kl drew the KL completions
            self.blocks = BlockStream(self.num_examples, self.per_device, self.accumulation, self.dist.world_size)
            self.stream = self.blocks  # type: ignore[assignment]  # what the checkpoint stores and `epoch` reads
            self.steps_per_epoch = self.blocks.steps_per_epoch

    def step_batches(self, step: int) -> list[Any]:
        if self.blocks is None:
            return super().step_batches(step)
        return [self.collate([self.examples[i] for i in rows]) for rows in self.blocks.take(self.dist.rank)]

    def eval_shares(self) -> list[list[Any]]:
        """With a KL term, the eval rows' blocks (as pair_kl drew them) dealt out to the ranks in turn."""
        if self.blocks is None or self.eval_examples is None:
            return super().eval_shares()
        blocks = blocks_of(len(self.eval_examples), self.per_device)[self.dist.rank::self.dist.world_size]
        return [[self.eval_examples[i] for i in rows] for rows in blocks]

    def shuffled(self, config: Any) -> bool:
        return config.train_sampling_strategy == "random"

    @property
    def ld_alpha(self) -> float | None:
        return None

    def collate(self, examples: Sequence[Unpaired | ReferencedPair]) -> PairBatch:
        rows: list[Unpaired] = [e.pair if isinstance(e, ReferencedPair) else e for e in examples]  # type: ignore[misc]
        as_pairs = [Preference(r.prompt_ids, r.completion_ids, r.kl_completion_ids, r.where) for r in rows]
        batch = super().collate([ReferencedPair(p, e.ref_chosen, e.ref_rejected) if isinstance(e, ReferencedPair)
                                 else p for p, e in zip(as_pairs, examples, strict=True)])
        batch.desirable = torch.tensor([r.desirable for r in rows], dtype=torch.bool, device=self.device)
        batch.num_tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)  # TRL's: no KL tokens
        if batch.token_weights is not None:  # the router loss over TRL's one row per completion
            weights = batch.token_weights.clamp(max=1.0)
            for b, r in enumerate(rows):
                start = len(r.prompt_ids) + len(r.completion_ids)
                weights[b, start:start + len(r.kl_completion_ids)] = 0.0
            batch.token_weights = weights
        return batch

    def mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        total = all_reduce_sum([float(value)], self.dist)[0].item()
        return value.new_tensor(total / self.dist.world_size)

    def sum_over_ranks(self, totals: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(totals, self.dist).reshape(totals.shape).to(totals.device)

    def loss(self, model: Any, batch: PairBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        c, n = self.config, batch.num_pairs
        assert batch.desirable is not None and batch.answer_of is not None
        balance = self.router_coef != 0.0
        with collect_router_logits() if balance else contextlib.nullcontext() as router_logits:
            policy = answer_logps(model, batch, with_logits=True, entropy=True)
        ref = self.reference_logps(batch).to(policy.logps.dtype)
        logps = policy.logps[:n]
        if uses_kl(c.loss_type):  # every rank runs as many training micro-batches; evaluation's may differ
            over_ranks = self.mean_over_ranks if self.dist.distributed and self.model.training else None
            kl = kl_estimate(policy.logps[n:], ref[n:], over_ranks)
        else:
            kl = logps.new_zeros(())
        out = kto_loss(logps, ref[:n], batch.desirable, kl, c.beta, c.loss_type, c.desirable_weight,
                       c.undesirable_weight)
        loss = out.losses.sum() / global_count
        with torch.no_grad():
            completion = batch.answer_of < n
            good = completion & batch.desirable[batch.answer_of.clamp(max=n - 1)]
            assert policy.entropy is not None
            more = {f"logits/{side}": (policy.mean_logits[mask].sum(), mask.sum())
                    for side, mask in (("chosen", good), ("rejected", completion & ~good))}
            more["entropy"] = (policy.entropy[completion].sum(), completion.sum())
            # Training: each micro-batch's totals over all ranks, as TRL gathers them (every rank runs as many).
            pool = self.sum_over_ranks if self.dist.distributed and self.model.training else None
            metrics: dict[str, Any] = dict(kto_metrics(out, logps, batch.desirable, kl, more, pool))
            if self.dist.distributed:  # every rank reports the same names: a side it lacks weighs 0
                metrics.update({k: Metric.mean(0.0, 0.0) for k in ONE_SIDED if k not in metrics})
            metrics["num_tokens"] = Metric.cumulative(batch.num_tokens)
        if balance and router_logits:
            loss = self.add_router_loss(loss, router_logits, batch.token_weights, metrics)
        return loss, metrics

    def summary_lines(self) -> list[str]:
        c = self.config
        ref = (f"reference log-probs precomputed from {self.reference_source} (one model in memory)"
               if c.precompute_ref_log_probs else f"reference: {self.reference_source}")
        if c.sync_ref_model:
            ref += f", mixed toward the policy (alpha {c.ref_model_mixup_alpha:g}) every {c.ref_model_sync_steps} steps"
        kl = (f"KL term from each block of {c.per_device_train_batch_size} rows' completions shifted by one, rows "
              "in dataset order" if uses_kl(c.loss_type) else "no KL term")
        desirable = sum(1 for e in self.examples if (e.pair if isinstance(e, ReferencedPair) else e).desirable)
        undesirable = len(self.examples) - desirable
        advice = weight_advice(desirable, undesirable, c.desirable_weight, c.undesirable_weight)
        return OfflineAlgorithm.summary_lines(self) + [
            f"kto: loss {c.loss_type}, beta {c.beta:g}, desirable_weight {c.desirable_weight:g}, undesirable_weight "
            f"{c.undesirable_weight:g}; {desirable} desirable and {undesirable} undesirable rows; {kl}; {ref}"] + \
            ([f"kto: {advice}"] if advice else [])


def run_kto(config: KTOConfig, dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
            progress: bool = True) -> Path:
    """Train `config.model` with KTO on `dataset` (default: `config.dataset`); returns `output_dir/final`."""
    return run_with_reference(KTO, config, dataset, eval_dataset, progress)

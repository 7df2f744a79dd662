"""Supervised fine-tuning: cross-entropy on completion tokens, on the one trainer loop.

A micro-batch is either padded (rows of equal length, right padding, a causal mask per row) or,
with `padding_free` (and `packing`, whose dataset rows are TRL's packed rows: `sft_packing.py`; its
`wrapped` rows are plain sequences, padded unless `padding_free`, as TRL trains them), one row
holding every example back to back with a block-diagonal causal mask and positions restarting per
example, so no compute goes into padding. Either way the LM head runs
only on the positions that predict a label token (`CausalLM.logits` of the selected hidden
states), since the vocabulary projection is the largest matmul of a small model.

The loss (`loss_type: nll`) is Σ -log p(label) over the micro-batch's label tokens divided by the label tokens of
the whole step (all micro-batches, all ranks), as transformers' `num_items_in_batch` does, so
accumulation and DDP give the gradient of one big batch; `dft` (Dynamic Fine-Tuning) weights each token's
term by its probability, detached, as TRL's. Metrics, under TRL's names: `loss`,
`mean_token_accuracy` (token-weighted), `num_tokens` (tokens seen since the start, prompt
included), `entropy` (mean over label positions).

The label tokens are the completion's (`completion_only_loss`), or every token; with `assistant_only_loss`,
of those only the ones the chat template's `{% generation %}` blocks wrote (`PromptCompletion.assistant_mask`),
as TRL's labels need every mask. `chat_template_path` swaps the template in first (`train/sft_template.py`).

A mixture of experts with a router load-balancing loss (Mixtral, Qwen3-MoE, gpt-oss) adds it in
training, as TRL's SFT trainer does: times `router_aux_loss_coef` (unset: the model config's; 0: not
added), over the micro-batch's real tokens, whatever the model config's `output_router_logits`
(`train/router_loss.py`); each micro-batch's counts for one over the step's micro-batches (all
ranks), and it is logged as `aux_loss`. The eval loss holds it too, each eval
micro-batch's counting for one over the eval set's micro-batches, as TRL's eval loss is the mean of its
batches' losses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedrl.model.attention import DenseAttention
from pagedrl.model.chat_turns import NotPrefixPreserving
from pagedrl.model.decoder import default_positions
from pagedrl.model.moe import collect_router_logits
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithm import OfflineAlgorithm
from pagedrl.train.algorithms.sft_packing import PackedRow, pack, unpack
from pagedrl.train.data import load_train_and_eval
from pagedrl.train.distributed import DistInfo
from pagedrl.train.examples import PromptCompletion, PromptCompletionRows, label_mask
from pagedrl.train.logprobs import target_logprobs
from pagedrl.train.losses import dft_loss, sft_loss
from pagedrl.train.metrics import Metric
from pagedrl.train.offline_config import SFTConfig
from pagedrl.train.router_loss import load_balancing_loss, router_loss_coef
from pagedrl.train.sft_template import (
    FROM_GENERATION_BLOCKS,
    assistant_mask_source,
    stop_token_trained,
    use_chat_template_path,
)


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    meta: DenseAttention
    predict_at: torch.Tensor  # [N] flat indices into [B*T] of positions whose next token is a label
    targets: torch.Tensor  # [N]
    num_tokens: int  # real (non-padding) tokens
    token_mask: torch.Tensor | None = None  # [B, T] real tokens of a padded batch (None: no padding)


def collate_sft(examples: Sequence[PromptCompletion], pad_id: int, device: torch.device,
                completion_only: bool = True, packing: bool = False) -> SFTBatch:
    """Examples → tensors; position t predicts token t + 1 where that token carries a label."""
    if packing:
        ids = [i for ex in examples for i in ex.input_ids]
        seg = [s for s, ex in enumerate(examples) for _ in ex.input_ids]
        pos = [p for ex in examples for p in range(len(ex.input_ids))]
        keep = [m for ex in examples for m in label_mask(ex, completion_only)]
        # A label at flat index j is predicted from j - 1, within the same example only.
        predict = [j - 1 for j in range(1, len(ids)) if keep[j] and seg[j] == seg[j - 1]]
        input_ids = torch.tensor([ids], dtype=torch.long)
        meta = DenseAttention.segments(torch.tensor([seg], device=device))
        positions = torch.tensor([pos], dtype=torch.long)
        targets = [ids[j + 1] for j in predict]
    else:
        width = max(len(ex.input_ids) for ex in examples)
        rows, attn, predict, targets = [], [], [], []
        for b, ex in enumerate(examples):
            n, keep = len(ex.input_ids), label_mask(ex, completion_only)
            rows.append(ex.input_ids + [pad_id] * (width - n))
            attn.append([1] * n + [0] * (width - n))
            for t in range(1, n):
                if keep[t]:
                    predict.append(b * width + t - 1)
                    targets.append(ex.input_ids[t])
        input_ids = torch.tensor(rows, dtype=torch.long)
        mask = torch.tensor(attn, dtype=torch.long)
        positions = default_positions(input_ids, mask)
        padded = bool((mask == 0).any())
        meta = DenseAttention.causal(mask.to(device)) if padded else DenseAttention(None)
        token_mask = mask.bool().to(device) if padded else None
    return SFTBatch(input_ids.to(device), positions.to(device), meta,
                    torch.tensor(predict, dtype=torch.long, device=device),
                    torch.tensor(targets, dtype=torch.long, device=device),
                    sum(len(ex.input_ids) for ex in examples), token_mask if not packing else None)


class SFT(OfflineAlgorithm):
    name = "sft"
    normaliser = "label (completion) tokens"

    def __init__(self, config: SFTConfig, model: torch.nn.Module, tokenizer: Tokenizer, dist: DistInfo,
                 dataset: str | Path | Sequence[Mapping[str, Any]] | None = None,
                 eval_dataset: str | Path | Sequence[Mapping[str, Any]] | None = None,
                 generation_config: dict[str, Any] | None = None) -> None:
        if config.chat_template_path is not None:
            use_chat_template_path(config.chat_template_path, tokenizer, model.config, generation_config)
        self.stops_trained, self.mask_source, self.probe_refused = True, FROM_GENERATION_BLOCKS, False
        if config.assistant_only_loss:
            self.mask_source = assistant_mask_source(tokenizer)
            try:
                self.stops_trained = stop_token_trained(tokenizer)
            except NotPrefixPreserving:  # rows with a turn after an assistant's are refused, one by one
                self.probe_refused = True
        eval_packing = config.packing if config.eval_packing is None else config.eval_packing

        def convert(packed: bool) -> PromptCompletionRows:
            # TRL's bfd_split and wrapped packing cut no example (they split or wrap it), so a row they pack is
            # read whole; bfd keeps each example's start, as it is cut here (TRL's packer cuts it so).
            # keep_end applies to a set not packed only (TRL's packer ignores it: bfd keeps the start).
            whole = packed and config.packing_strategy != "bfd"
            return PromptCompletionRows(tokenizer, None if whole else config.max_length, config.truncation,
                                        config.dataset_text_field, config.assistant_only_loss,
                                        keep_end=config.truncation_mode == "keep_end" and not packed)

        examples, report, eval_examples = load_train_and_eval(config, dataset, eval_dataset, convert(config.packing),
                                                              "SFT needs a dataset", convert(eval_packing))
        completion_only = config.completion_only_loss is not False
        if config.packing:
            assert config.max_length is not None  # SFTConfig.validate
            if config.shuffle_dataset:  # as datasets' `shuffle(seed)`, which TRL runs before packing
                examples = [examples[i] for i in np.random.default_rng(config.seed).permutation(len(examples))]
            examples = pack(examples, config.max_length, config.packing_strategy, completion_only)
        if eval_examples and eval_packing:
            assert config.max_length is not None
            eval_examples = pack(eval_examples, config.max_length, config.packing_strategy, completion_only)
        super().__init__(examples, report, config.per_device_train_batch_size, config.gradient_accumulation_steps,
                         dist, config.seed, eval_examples)
        self.model, self.tokenizer, self.generation_config = model, tokenizer, generation_config
        pad = tokenizer.pad_token_id
        self.pad_id = 0 if pad is None else pad
        self.completion_only = completion_only
        self.assistant_only = config.assistant_only_loss
        # As TRL's SFTTrainer: bfd's rows train padding-free; wrapped rows are plain sequences, padded unless asked
        self.packing, self.strategy = config.packing, config.packing_strategy
        self.padding_free = config.padding_free or (config.packing and config.packing_strategy != "wrapped")
        self.loss_type = config.loss_type
        self.device = next(model.parameters()).device
        self.router_coef = router_loss_coef(config.router_aux_loss_coef, model.config)
        if model.config.load_balancing_loss:
            # As TRL's SFT trainer, the saved config says whether the loss ran and with what weight.
            model.config.output_router_logits = self.router_coef != 0.0
            model.config.router_aux_loss_coef = self.router_coef

    def collate(self, examples: Sequence[PromptCompletion | PackedRow]) -> SFTBatch:
        packed = any(isinstance(e, PackedRow) for e in examples)  # packed rows train padding-free, as TRL's
        return collate_sft(unpack(examples), self.pad_id, self.device, self.completion_only,
                           self.padding_free or packed)

    def count(self, batch: SFTBatch) -> float:
        return float(batch.targets.numel())

    def loss(self, model: Any, batch: SFTBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = self.model.config
        balance = self.router_coef != 0.0
        with collect_router_logits() if balance else contextlib.nullcontext() as router_logits:
            out = target_logprobs(model, batch.input_ids, batch.positions, batch.meta, batch.predict_at,
                                  batch.targets, entropy=True, correct=True)
        n = batch.targets.numel()
        token_loss = dft_loss if self.loss_type == "dft" else sft_loss
        loss = token_loss(out.logps[None], torch.ones(1, n, dtype=torch.bool, device=out.logps.device),
                          num_items_in_batch=global_count)
        assert out.correct is not None and out.entropy is not None
        correct, entropy = out.correct.sum(), out.entropy.sum()
        metrics: dict[str, Any] = {
            "mean_token_accuracy": Metric.mean(correct, n),
            "entropy": Metric.mean(entropy, n),
            "num_tokens": Metric.cumulative(batch.num_tokens),
        }
        if balance and router_logits:
            aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok, batch.token_mask)
            loss = loss + self.router_coef * aux * self.micro_batch_share()
            metrics["aux_loss"] = Metric.mean(aux.detach())
        return loss, metrics

    def summary_lines(self) -> list[str]:
        layout = "back to back in one row per micro-batch" if self.padding_free else "padded"
        mode = (f"packed ({self.strategy}) into {self.num_examples} rows of at most max_length tokens"
                + (f", trained {layout}" if self.strategy == "wrapped" else "") if self.packing else layout)
        target = "completion tokens" if self.completion_only else "every token"
        if self.assistant_only:
            target = f"the assistant's tokens ({self.mask_source})"
        lines = [f"sft: {self.loss_type} loss on {target}; sequences {mode}"]
        if self.probe_refused:
            lines.append("sft: the chat template renders an assistant turn otherwise once a user message follows it "
                         "(not prefix-preserving), so rows with a message after an assistant's will be refused; "
                         "set chat_template_path to a template with {% generation %} blocks to train on them")
        if not self.stops_trained:
            lines.append("sft: the chat template leaves the assistant's end-of-turn token outside the assistant's "
                         "tokens, so the model may not learn to stop (TRL warns of the same)")
        return super().summary_lines() + lines


def run_sft(config: SFTConfig, dataset: str | Path | Sequence[Mapping[str, Any]] | None = None,
            eval_dataset: str | Path | Sequence[Mapping[str, Any]] | None = None,
            progress: bool = True) -> Path:
    """Fine-tune `config.model` on `dataset` (default: `config.dataset`); returns `output_dir/final`."""
    from pagedrl.train.start import start_run
    from pagedrl.train.trainer import Trainer

    dist, loaded = start_run(config, "SFT needs")
    algorithm = SFT(config, loaded.model, loaded.tokenizer, dist, dataset, eval_dataset,
                    loaded.generation_config or None)
    return Trainer(config, algorithm, dist, progress=progress).train()

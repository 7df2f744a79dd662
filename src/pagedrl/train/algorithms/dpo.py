"""Direct preference optimisation on the one trainer loop: the reward is implicit in how much more
the policy than a frozen reference likes the chosen answer over the rejected one.

Per micro-batch: one forward of the policy over rows `[prompt, chosen, rejected]`
(`pagedrl.train.algorithms.pair_batch`), the LM head only on the positions that predict an answer token, the
log-probs summed per answer (`answer_sums`: LD-DPO's `ld_alpha` weighs the verbose tokens; WPO's weights
come from the same head pass); the same for the reference without gradients, or its log-probs read
from a table computed before training; then `dpo_losses.dpo_loss` (TRL's loss types, one or a weighted
list; sigmoid with label smoothing = conservative DPO; f-DPO's scores) summed over pairs and divided by
the pairs of the whole step (all micro-batches, all ranks), so accumulation and DDP give the gradient of one big batch
(but for the terms TRL computes over one micro-batch: `sft`'s token mean, `aot`'s sort).

The reference is the starting policy (a frozen deep copy), `ref_model`, or with LoRA (`use_peft`)
the base model itself: the policy with its adapters switched off, no copy. With `sync_ref_model`
(TR-DPO) the copy or `ref_model` moves toward the policy every `ref_model_sync_steps` steps. With
`precompute_ref_log_probs` one pass over the train and eval sets computes its log-probs before
the first step and the reference is dropped: one model in memory. When the reference is the
starting policy that pass runs on the policy itself, before it changes, and no copy is ever made.

A mixture of experts with a router load-balancing loss (Mixtral, Qwen3-MoE, gpt-oss) adds it in
training, as TRL's DPO trainer does: times `router_aux_loss_coef` (unset: the model config's; 0: not
added), over the policy's forward only, each micro-batch's counting for one over the step's
micro-batches (all ranks), logged as `aux_loss`. TRL runs each answer with its own copy of the
prompt; here the prompt is computed once and its tokens count twice (`PairBatch.token_weights`),
which gives TRL's value. The eval loss holds it too, each eval
micro-batch's counting for one over the eval set's micro-batches, as TRL's eval loss is the mean of its
batches' losses.

Metrics under TRL's names: `rewards/chosen`, `rewards/rejected` (β·log-ratio, mean over pairs),
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected` (summed log-probs, mean
over pairs), `logits/chosen`, `logits/rejected` (the vocabulary-mean logit at each answer token,
mean over tokens), `num_tokens` (prompt + chosen + prompt + rejected tokens since the start).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedrl.model.decoder import CausalLM
from pagedrl.model.lora import disable_adapter
from pagedrl.model.moe import collect_router_logits
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.adapters import reference_forward, uses_lora
from pagedrl.train.algorithm import OfflineAlgorithm
from pagedrl.train.algorithms.pair_batch import PairBatch, collate_pairs
from pagedrl.train.data import load_train_and_eval
from pagedrl.train.distributed import DistInfo, all_reduce_sum
from pagedrl.train.dpo_losses import dpo_loss, loss_types_of, trl_differences, trl_warnings
from pagedrl.train.examples import Preference, PreferenceRows
from pagedrl.train.logprobs import target_logprobs
from pagedrl.train.metrics import Metric
from pagedrl.train.offline_config import DPOConfig
from pagedrl.train.router_loss import load_balancing_loss, router_loss_coef

Dataset = str | Path | Sequence[Mapping[str, Any]]


# `padding_free: true`: TRL 1.16's DPOTrainer warns and pads as with false; here too the pair rows are padded
# (to the micro-batch's longest pair) and padding never reaches the loss, so true and false train the same.
PADDING_FREE_LINE = ("padding_free: each pair is one row, its prompt once and both answers after it, padded to "
                     "the micro-batch's longest pair, as with false (TRL 1.16's DPOTrainer too falls back to "
                     "padding); padding never changes the loss")


@dataclass
class ReferencedPair:
    """A pair with the reference's summed log-probs of its two answers."""

    pair: Preference
    ref_chosen: float
    ref_rejected: float


@dataclass
class AnswerLogps:
    logps: torch.Tensor  # [2B] summed log-probs (LD-DPO's weighted sums with ld_alpha): chosen of pairs 0..B-1, then rejected
    mean_logits: torch.Tensor  # [N] vocabulary-mean logit at each answer token (no gradient)
    full: torch.Tensor  # [2B] the plain sums (`logps` itself without ld_alpha): the sft loss's NLL reads them
    weights: torch.Tensor | None = None  # [2B] WPO's weights (`wpo_weights`), when asked for
    entropy: torch.Tensor | None = None  # [N] entropy of the distribution at each answer token, when asked for


def answer_sums(token_logps: torch.Tensor, batch: PairBatch, ld_alpha: float | None = None) -> torch.Tensor:
    """Each answer's summed token log-probs [2B]. With LD-DPO's `ld_alpha` (Liu et al. 2024) a pair's answers
    count their first min(chosen, rejected) scored tokens (the public part) once and the longer one's rest (the
    verbose part) α times, so that a length difference weighs less in the margin: TRL 1.16's shared + α·tail.
    An answer's tokens are contiguous in `answer_of`, in order."""
    n = 2 * batch.num_pairs
    answer_of = batch.answer_of
    assert answer_of is not None
    sums = token_logps.new_zeros(n)
    if ld_alpha is None:
        return sums.index_add(0, answer_of, token_logps)
    counts = scored_tokens(batch)
    shared = torch.minimum(*counts.chunk(2)).repeat(2)
    index = torch.arange(answer_of.numel(), device=answer_of.device)
    first = torch.full((n,), answer_of.numel(), dtype=torch.long, device=answer_of.device)
    first = first.scatter_reduce(0, answer_of, index, "amin")
    tail = index - first[answer_of] >= shared[answer_of]
    public = sums.index_add(0, answer_of, token_logps.masked_fill(tail, 0.0))
    return public + ld_alpha * sums.index_add(0, answer_of, token_logps.masked_fill(~tail, 0.0))


def scored_tokens(batch: PairBatch) -> torch.Tensor:
    """Each answer's tokens that have a log-prob [2B]: all but the first where the prompt is empty."""
    assert batch.answer_of is not None
    return torch.bincount(batch.answer_of, minlength=2 * batch.num_pairs)


def wpo_weights(token_logps: torch.Tensor, log_sum_sq: torch.Tensor, batch: PairBatch) -> torch.Tensor:
    """WPO's weight of each answer [2B] (Zhou et al. 2024, Eq. 2, as TRL 1.16 computes it): exp of the mean over
    its scored tokens of log p - log Σ_v p_v², the token's probability against the distribution's own expected
    probability, so that an answer the policy would itself produce weighs near 1 and an off-policy one less;
    no gradient (all plain sums, ld_alpha or not)."""
    with torch.no_grad():
        aligned = answer_sums(token_logps.detach() - log_sum_sq, batch)
        return torch.exp(aligned / scored_tokens(batch).clamp(min=1))


def answer_logps(model: Any, batch: PairBatch, with_logits: bool = False, ld_alpha: float | None = None,
                 weights: bool = False, entropy: bool = False) -> AnswerLogps:
    """Σ log p(answer token | prompt, earlier answer tokens) per answer (`answer_sums`), from one forward, and
    on request WPO's `weights` and each answer token's `entropy`. `model` is the policy (through the loop's
    handle) or a plain CausalLM (the reference)."""
    out = target_logprobs(model, batch.input_ids, batch.positions, batch.meta, batch.predict_at, batch.targets,
                          mean_logit=with_logits, log_sum_sq=weights, entropy=entropy)
    logps = answer_sums(out.logps, batch, ld_alpha)
    full = logps if ld_alpha is None else answer_sums(out.logps, batch)
    wpo = None if out.log_sum_sq is None else wpo_weights(out.logps, out.log_sum_sq, batch)
    return AnswerLogps(logps, out.mean_logit if with_logits else out.logps.new_zeros(0), full, wpo, out.entropy)


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.requires_grad_(False)
    return model.eval()


def load_frozen(path: str, device: torch.device, dtype: torch.dtype = torch.float32,
                revision: str | None = None) -> torch.nn.Module:
    """A frozen model beside the trained one (DPO's and KTO's `ref_model`, distillation's teacher), in `dtype`,
    whole on every process: under FSDP2 too, since only the trained model is sharded (a frozen one has no
    gradients or optimizer state to split, and runs its forwards outside the sharded module's)."""
    from pagedrl.model.loader import load_model

    return frozen(load_model(path, device=device, dtype=dtype, load_tokenizer=False, revision=revision).model)


class DPO(OfflineAlgorithm):
    name = "dpo"
    normaliser = "preference pairs"

    def __init__(self, config: DPOConfig, model: CausalLM, tokenizer: Tokenizer, dist: DistInfo,
                 dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
                 generation_config: dict[str, Any] | None = None, ref_model: CausalLM | None = None) -> None:
        examples, report, eval_examples = self.read_examples(config, tokenizer, dataset, eval_dataset)
        super().__init__(examples, report, config.per_device_train_batch_size, config.gradient_accumulation_steps,
                         dist, config.seed, eval_examples, shuffle=self.shuffled(config))
        self.model, self.tokenizer, self.generation_config = model, tokenizer, generation_config
        self.config = config
        pad = tokenizer.pad_token_id
        self.pad_id = 0 if pad is None else pad
        self.device = next(model.parameters()).device
        self.router_coef = router_loss_coef(config.router_aux_loss_coef, model.config)
        reference = ref_model
        if reference is not None and reference.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"ref_model: its vocabulary has {reference.config.vocab_size} tokens, the policy's "
                             f"{model.config.vocab_size}; the reference must share the policy's tokenizer")
        if reference is not None:
            reference = frozen(reference.to(device=self.device, dtype=torch.float32))
        # With LoRA the reference is the base: the policy with its adapters switched off, no copy.
        self.base_is_reference = reference is None and uses_lora(model)
        self.reference_source = config.ref_model or ("the base model (adapters off)" if self.base_is_reference
                                                      else "a frozen copy of the starting policy")
        if config.precompute_ref_log_probs:
            # The starting policy is its own reference until the first update: no copy needed.
            source = reference if reference is not None else model
            self.examples = self.precompute(source, self.examples)
            if self.eval_examples is not None:
                self.eval_examples = self.precompute(source, self.eval_examples)
            self.reference = None
        elif self.base_is_reference:
            self.reference = None
        else:
            self.reference = reference if reference is not None else frozen(copy.deepcopy(model))

        if config.sync_ref_model:
            self.check_mixable(self.reference)

    def read_examples(self, config: Any, tokenizer: Tokenizer, dataset: Dataset | None,
                      eval_dataset: Dataset | None) -> tuple[list[Any], Any, list[Any] | None]:
        """The training and evaluation examples (KTO reads its own rows)."""
        convert = PreferenceRows(tokenizer, config.max_length, config.truncation, config.truncation_mode == "keep_end")
        return load_train_and_eval(config, dataset, eval_dataset, convert,
                                   "DPO needs a dataset of {prompt, chosen, rejected} rows")

    def shuffled(self, config: Any) -> bool:
        """Whether each epoch's rows are shuffled (KTO's KL term needs them in dataset order)."""
        return True

    @property
    def ld_alpha(self) -> float | None:
        """LD-DPO's weight of the verbose tokens in an answer's sum, which the reference's sums take too."""
        return self.config.ld_alpha

    # -- TR-DPO: the reference mixed toward the policy -------------------------------------------

    def check_mixable(self, reference: torch.nn.Module | None) -> None:
        """TR-DPO mixes the policy into the reference tensor by tensor: the two must have the same ones."""
        mine = [(k, tuple(v.shape)) for k, v in self.model.named_parameters()]
        theirs = [] if reference is None else [(k, tuple(v.shape)) for k, v in reference.named_parameters()]
        if mine != theirs:
            raise ValueError("sync_ref_model: the reference model does not have the policy's parameters (names "
                             "and shapes), so the policy cannot be mixed into it; give a ref_model of the policy's "
                             "architecture and size")

    def after_optimizer_step(self, step: int) -> None:
        """TR-DPO (Gorbatovski et al. 2024): every `ref_model_sync_steps` steps the reference moves to
        α·policy + (1-α)·reference, as TRL's SyncRefModelCallback mixes them, so that the policy is held
        near a recent version of itself rather than only the start."""
        c = self.config
        if c.sync_ref_model and step % c.ref_model_sync_steps == 0:
            assert self.reference is not None
            alpha = c.ref_model_mixup_alpha
            with torch.no_grad():
                for ref, p in zip(self.reference.parameters(), self.model.parameters(), strict=True):
                    ref.mul_(1.0 - alpha).add_(p.detach(), alpha=alpha)

    def state_dict(self) -> dict[str, Any]:
        """With TR-DPO the reference is part of the run's state: a resumed run mixes into the same one."""
        state = super().state_dict()
        if self.config.sync_ref_model and self.reference is not None:
            state["reference"] = {k: v.detach().cpu().clone() for k, v in self.reference.state_dict().items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if "reference" in state and self.reference is not None:
            self.reference.load_state_dict(state["reference"])

    # -- reference log-probs --------------------------------------------------------------------

    def precompute(self, source: torch.nn.Module, pairs: list[Preference]) -> list[ReferencedPair]:
        """The reference's log-probs of every pair, each rank computing a strided share and the
        shares summed across ranks (every slot is filled by exactly one rank), in batches of
        `precompute_ref_batch_size` pairs (no gradient: larger ones than training's may fit)."""
        mine = list(range(self.dist.rank, len(pairs), self.dist.world_size))
        table = torch.zeros(len(pairs), 2, dtype=torch.float64)
        was_training = source.training
        source.eval()
        bf16 = self.config.use_bf16(self.device)
        base = disable_adapter(source) if self.base_is_reference else contextlib.nullcontext()
        with torch.no_grad(), base, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            size = self.config.precompute_ref_batch_size or self.per_device
            for start in range(0, len(mine), size):
                chunk = mine[start:start + size]
                logps = answer_logps(source, self.collate([pairs[i] for i in chunk]), ld_alpha=self.ld_alpha).logps
                table[chunk] = logps.view(2, -1).t().to("cpu", torch.float64)
        source.train(was_training)
        table = all_reduce_sum(table.reshape(-1), self.dist).view(-1, 2)
        return [ReferencedPair(p, float(c), float(r)) for p, (c, r) in zip(pairs, table.tolist(), strict=True)]

    def reference_logps(self, batch: PairBatch) -> torch.Tensor:
        if batch.ref_logps is not None:
            return batch.ref_logps
        if self.base_is_reference:
            with reference_forward(self.model):
                return answer_logps(self.model, batch, ld_alpha=self.ld_alpha).logps
        if self.reference is None:
            raise RuntimeError("reference log-probs were not precomputed for this batch")
        with torch.no_grad():
            return answer_logps(self.reference, batch, ld_alpha=self.ld_alpha).logps

    # -- the loop's interface -------------------------------------------------------------------

    def collate(self, examples: Sequence[Preference | ReferencedPair]) -> PairBatch:
        referenced = [e for e in examples if isinstance(e, ReferencedPair)]
        pairs = [e.pair if isinstance(e, ReferencedPair) else e for e in examples]
        refs = [(e.ref_chosen, e.ref_rejected) for e in referenced] if len(referenced) == len(pairs) else None
        return collate_pairs(pairs, self.pad_id, self.device, answer_tokens=True, ref_logps=refs,
                             sliding_window=self.model.config.sliding_window)

    def count(self, batch: PairBatch) -> float:
        return float(batch.num_pairs)

    def loss(self, model: Any, batch: PairBatch, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        balance = self.router_coef != 0.0
        with collect_router_logits() if balance else contextlib.nullcontext() as router_logits:
            policy = answer_logps(model, batch, with_logits=True, ld_alpha=self.config.ld_alpha,
                                  weights=self.config.use_weighting)
        ref = self.reference_logps(batch).to(policy.logps.dtype)
        chosen, rejected = policy.logps.chunk(2)
        ref_chosen, ref_rejected = ref.chunk(2)
        lengths_chosen, lengths_rejected = batch.answer_lengths.chunk(2)
        c, n = self.config, batch.num_pairs
        out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=c.beta, loss_type=c.loss_type,
                       label_smoothing=c.label_smoothing, chosen_lengths=lengths_chosen,
                       rejected_lengths=lengths_rejected, loss_weights=c.loss_weights, discopop_tau=c.discopop_tau,
                       f_divergence_type=c.f_divergence_type, f_alpha_divergence_coef=c.f_alpha_divergence_coef,
                       sft_chosen_logps=policy.full[:n], sft_chosen_tokens=scored_tokens(batch)[:n],
                       pair_weights=None if policy.weights is None else policy.weights[:n] * policy.weights[n:])
        loss = out.losses.sum() / global_count
        with torch.no_grad():
            is_chosen = batch.answer_of < n
            n_chosen, n_rejected = is_chosen.sum(), (~is_chosen).sum()
            metrics = {
                "rewards/chosen": Metric.mean(out.chosen_rewards.sum(), n),
                "rewards/rejected": Metric.mean(out.rejected_rewards.sum(), n),
                "rewards/accuracies": Metric.mean((out.chosen_rewards > out.rejected_rewards).sum(), n),
                "rewards/margins": Metric.mean((out.chosen_rewards - out.rejected_rewards).sum(), n),
                "logps/chosen": Metric.mean(chosen.detach().sum(), n),
                "logps/rejected": Metric.mean(rejected.detach().sum(), n),
                "logits/chosen": Metric.mean(policy.mean_logits[is_chosen].sum(), n_chosen),
                "logits/rejected": Metric.mean(policy.mean_logits[~is_chosen].sum(), n_rejected),
                "num_tokens": Metric.cumulative(batch.num_tokens),
            }
        if balance and router_logits:
            loss = self.add_router_loss(loss, router_logits, batch.token_weights, metrics)
        return loss, metrics

    def add_router_loss(self, loss: torch.Tensor, router_logits: Any, token_weights: torch.Tensor | None,
                        metrics: dict[str, Any]) -> torch.Tensor:
        """`loss` plus the micro-batch's load-balancing term over the tokens `token_weights` counts (how many
        of TRL's rows hold each), logged as `aux_loss`."""
        cfg = self.model.config
        aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok, token_weights)
        metrics["aux_loss"] = Metric.mean(aux.detach())
        return loss + self.router_coef * aux * self.micro_batch_share()

    def summary_lines(self) -> list[str]:
        c = self.config
        if c.precompute_ref_log_probs:
            ref = f"reference log-probs precomputed from {self.reference_source} (one model in memory)"
        else:
            ref = f"reference: {self.reference_source}"
        types = loss_types_of(c.loss_type)
        weights = f" (weights {', '.join(f'{w:g}' for w in c.loss_weights)})" if c.loss_weights else ""
        smoothing = f", label_smoothing {c.label_smoothing:g}" if c.label_smoothing else ""
        tau = f", discopop_tau {c.discopop_tau:g}" if "discopop" in types else ""
        f_div = "" if c.f_divergence_type == "reverse_kl" else f", f-divergence {c.f_divergence_type}" + (
            f" (alpha {c.f_alpha_divergence_coef:g})" if c.f_divergence_type == "alpha_divergence" else "")
        ld = ("" if c.ld_alpha is None else f", ld_alpha {c.ld_alpha:g}") + (", WPO weights" if c.use_weighting else "")
        if c.sync_ref_model:
            ref += f", mixed toward the policy (alpha {c.ref_model_mixup_alpha:g}) every {c.ref_model_sync_steps} steps"
        return super().summary_lines() + [f"dpo: loss {' + '.join(types)}{weights}, beta {c.beta:g}{smoothing}{tau}"
                                          f"{f_div}{ld}; {ref}"] + \
            [f"dpo: {line}" for line in trl_differences(c.loss_type, c.label_smoothing)] + \
            [f"dpo: {line}" for line in trl_warnings(c.loss_type, c.label_smoothing)] + \
            ([f"dpo: {PADDING_FREE_LINE}"] if c.padding_free else [])


def run_dpo(config: DPOConfig, dataset: Dataset | None = None, eval_dataset: Dataset | None = None,
            progress: bool = True) -> Path:
    """Train `config.model` with DPO on `dataset` (default: `config.dataset`); returns `output_dir/final`."""
    return run_with_reference(DPO, config, dataset, eval_dataset, progress)


def run_with_reference(cls: type[DPO], config: Any, dataset: Dataset | None, eval_dataset: Dataset | None,
                       progress: bool) -> Path:
    """Load the policy (and `ref_model`, if given), build `cls` (DPO or KTO) and train it."""
    from pagedrl.train.start import start_run
    from pagedrl.train.trainer import Trainer

    dist, loaded = start_run(config, f"{cls.name.upper()} needs")
    reference = None
    if config.ref_model is not None:
        reference = load_frozen(config.ref_model, dist.device)
    algorithm = cls(config, loaded.model, loaded.tokenizer, dist, dataset, eval_dataset,
                    loaded.generation_config or None, ref_model=reference)
    del reference  # with precomputed log-probs the algorithm no longer holds it either
    return Trainer(config, algorithm, dist, progress=progress).train()

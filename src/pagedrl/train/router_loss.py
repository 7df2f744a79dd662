"""The load-balancing auxiliary loss of a mixture of experts (Switch Transformer, Fedus et al. 2021,
eqs. 4-6), as transformers' `load_balancing_loss_func` computes it for Mixtral and Qwen3-MoE.

A router that sends every token to the same few experts trains those and starves the rest; the loss
is E · Σ_e f_e · P_e, with f_e the share of (token, choice) assignments that went to expert e (each
token counted k times, so Σ f_e = k) and P_e the mean router probability of e, both over the tokens
of every sparse layer together (padding excluded). It is smallest when both are uniform. Only P_e
carries a gradient (the top-k choice has none), as in transformers.

Which runs add it, and with what weight, follows TRL's SFT, DPO and GRPO trainers (`router_loss_coef`): every
model of a family whose config declares `output_router_logits` (its value does not matter; the
trainer's setting decides), weighted by the trainer's `router_aux_loss_coef`, or by the model's own
when that is left unset; 0 turns it off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedrl.model.config import ModelConfig
from pagedrl.train.config import TrainConfigError


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """router_logits: each sparse layer's [tokens, E] (`model/moe.collect_router_logits`); mask: the
    tokens that count ([tokens] or any shape of that many elements; None: all). The softmax runs in
    float32 whatever the logits' dtype."""
    device = router_logits[0].device
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        weight = (torch.ones(probs.shape[0], device=device) if mask is None
                  else mask.reshape(-1).to(device=device, dtype=torch.float32))
        assignments = assignments + torch.zeros_like(assignments).scatter_add(
            0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * weight[:, None]).sum(0)
        rows = rows + weight.sum()
    return (assignments / rows * (prob_sum / rows)).sum() * num_experts


def router_loss_coef(requested: float | None, model: ModelConfig) -> float:
    """The weight of the load-balancing loss in a trainer's loss, 0.0 when it is not added: TRL's rule.
    `requested`: the trainer's `router_aux_loss_coef` (None: the model config's `router_aux_loss_coef`).
    A non-zero weight for a model without the loss is refused by the field's name, as TRL refuses it,
    rather than silently training without the term it asks for."""
    if not model.load_balancing_loss:
        if requested:
            why = ("transformers' DeepSeek-V3 computes no router load-balancing loss" if model.deepseek is not None
                   else "it is not a mixture of experts whose router has a load-balancing loss")
            raise TrainConfigError("router_aux_loss_coef", f"set to {requested}, but the model "
                                   f"({model.architecture}) has no auxiliary loss to weight: {why}; leave it "
                                   "unset or 0")
        return 0.0
    return float(model.router_aux_loss_coef if requested is None else requested)

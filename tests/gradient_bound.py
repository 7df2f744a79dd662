"""How far a float32 trainer's gradients can be from the exact ones: `decoder_bound`'s probes run
with autograd, each probe on its own float64 copy of the parameters, and every step of the backward
adds its own worst-case float32 rounding with a random sign, as the forward's steps do: a product's
input gradient its sum over the outputs (gamma(N) of the terms' magnitudes), a weight's gradient its
sum over every token of the step (gamma(tokens + 8): any split into micro-batches, chunks and their
accumulation), RMSNorm's and softmax's backward their row sums, the element-wise steps a few units,
the embedding's gradient its sum over a token's occurrences. The gradients of tensors two steps read
add once more. A gradient's bound is then `decoder_bound.SIGMAS` standard deviations of the probes'
gradients about the exact one, per element.

It bounds two float32 computations of one gradient apart (one batch against micro-batches, packed
against padded rows, pagedrl against transformers) by the sum of their bounds; a dropped token, a
wrong normaliser or a missing term moves a gradient by a part in a hundred or more."""

from __future__ import annotations

from collections.abc import Callable

import torch
from decoder_bound import FLOAT32, PROBES, Precision, Probed, Rounding, hidden, linear, one_thread
from float_bounds import EXP_ERROR, U, gamma, log_softmax_bounds


class GradRounding(Rounding):
    """`Rounding` whose products, embedding and noise points carry the backward's roundings, and whose
    parameters are per-probe leaves [1 + PROBES, ...] (their `.grad` is each probe's gradient)."""

    def __init__(self, precision: Precision, leaves: dict[int, torch.Tensor], tokens: int, seed: int = 0) -> None:
        super().__init__(precision, seed)
        self.leaves = leaves
        self.tokens = tokens  # how many rows a weight's gradient sums over

    def weight(self, t: torch.Tensor, cast: bool = True) -> torch.Tensor:
        leaf = self.leaves.get(id(t))
        return leaf if leaf is not None else super().weight(t, cast)

    def product(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _Product.apply(x, w, self)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _MatMul.apply(a, b, self)

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _Embed.apply(table, ids, self) if table.requires_grad else super().embed(table, ids)

    def backward_noise(self, x: torch.Tensor, bound: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return _Noise.apply(x, bound, self)

    def tap(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cell: list[torch.Tensor] = []
        return _Tap.apply(x, cell), cell


def _per_probe(w: torch.Tensor) -> str:
    return "pnk" if w.dim() == 3 else "nk"


class _Product(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, rounding):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        ctx.rounding = rounding
        return Rounding.product(rounding, x, w)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        r, spec = ctx.rounding, _per_probe(w)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch.einsum(f"p...n,{spec}->p...k", g, w)
            gx = r(gx, gamma(w.shape[-2]) * torch.einsum(f"p...n,{spec}->p...k", g.abs(), w.abs()))
        if ctx.needs_input_grad[1]:
            gw = torch.einsum("p...n,p...k->pnk", g, x)
            gw = r(gw, gamma(r.tokens + 8) * torch.einsum("p...n,p...k->pnk", g.abs(), x.abs()))
            if w.dim() == 2:
                gw = gw.sum(0)
        return gx, gw, None


class _MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, rounding):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(a, b)
        ctx.rounding = rounding
        return a @ b

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        a, b = ctx.saved_tensors
        r = ctx.rounding
        ga = r(g @ b.transpose(-1, -2), gamma(b.shape[-1]) * (g.abs() @ b.abs().transpose(-1, -2)))
        gb = r(a.transpose(-1, -2) @ g, gamma(a.shape[-2]) * (a.abs().transpose(-1, -2) @ g.abs()))
        return ga, gb, None


class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, ids, rounding):  # type: ignore[no-untyped-def]
        ctx.shape, ctx.ids, ctx.rounding = table.shape, ids, rounding
        return table[:, ids]

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        P, V, H = ctx.shape
        flat, rows = ctx.ids.reshape(-1), g.reshape(P, -1, H)
        grad = g.new_zeros(P, V, H).index_add_(1, flat, rows)
        size = g.new_zeros(P, V, H).index_add_(1, flat, rows.abs())
        return ctx.rounding(grad, gamma(flat.numel()) * size), None, None


class _Noise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bound, rounding):  # type: ignore[no-untyped-def]
        ctx.bound, ctx.rounding = bound, rounding
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return ctx.rounding(g, ctx.bound(g)), None, None


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cell):  # type: ignore[no-untyped-def]
        ctx.cell = cell
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        ctx.cell[:] = [g]
        return g, None


def token_logps(rounding: Rounding, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[target] per row [P, N], as float32 computes it: its forward's roundings
    (`float_bounds.log_softmax_bounds`) and its backward's, d logits = g (onehot - p) with p off by an
    exp's error and its argument's rounding, and the products' and difference's roundings."""
    logp = torch.log_softmax(logits, -1)
    picked = logp.gather(-1, targets.expand(logits.shape[0], -1)[..., None])[..., 0]
    own = log_softmax_bounds(logits[0].detach()).gather(1, targets[:, None])[:, 0]
    onehot = torch.nn.functional.one_hot(targets, logits.shape[-1]).double()

    def backward(dl: torch.Tensor) -> torch.Tensor:
        p, lp = logp.detach().exp(), logp.detach()
        upstream = cell[0].abs()[..., None]
        return upstream * ((EXP_ERROR + 4 * U + U * lp.abs()) * p + 2 * U * onehot)

    logits = rounding.backward_noise(logits, backward)
    picked, cell = rounding.tap(rounding(picked, own))
    return picked


def gradients(model: torch.nn.Module, input_ids: torch.Tensor, loss: Callable[[torch.Tensor, Rounding], torch.Tensor],
              attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              allowed: torch.Tensor | None = None, precision: Precision = FLOAT32,
              freq_error: torch.Tensor | float = 0.0, seed: int = 0) -> tuple[Probed, dict[str, Probed]]:
    """A loss of a model's final hidden states (`loss(hidden [1 + PROBES, B, T, H], rounding)` -> [1 +
    PROBES]; its heads through `decoder_bound.linear` with the rounding given) and its gradients by
    parameter name, exact and perturbed, for a batch as `decoder_bound.logits` takes one."""
    leaves = {id(p): p.detach().double().expand(1 + PROBES, *p.shape).clone().requires_grad_()
              for p in model.parameters() if p.requires_grad}
    rounding = GradRounding(precision, leaves, input_ids.numel(), seed)
    with one_thread(), torch.enable_grad():
        value = loss(hidden(model, input_ids, attention_mask, rounding, freq_error, positions, allowed), rounding)
        value.sum().backward()
    grads = {name: Probed(leaves[id(p)].grad) for name, p in model.named_parameters() if id(p) in leaves}
    return Probed(value.detach()), grads


def completion_loss(model: torch.nn.Module, rows: torch.Tensor, targets: torch.Tensor
                    ) -> Callable[[torch.Tensor, Rounding], torch.Tensor]:
    """The mean negative log-prob of `targets` [N] predicted at flat rows `rows` [N] of a batch (the
    SFT loss over completion tokens). The float32 sum's and division's own roundings, one worst case
    rather than many, are left to the caller: `mean_rounding`."""

    def loss(states: torch.Tensor, rounding: Rounding) -> torch.Tensor:
        picked = states.reshape(states.shape[0], -1, states.shape[-1])[:, rows]
        lp = token_logps(rounding, linear(picked, model.lm_head, rounding), targets)
        lp = rounding.backward_noise(lp, lambda g: U * g.abs())  # d / d lp = -1 / N, rounded
        return -lp.sum(-1) / len(targets)

    return loss


def mean_rounding(value: float, terms: int) -> float:
    """Bound on a float32 mean's own roundings for `terms` terms of one sign (log-probs): gamma(terms +
    1) of their magnitudes' mean, which is the mean's own size, in any order and split."""
    return gamma(terms + 1) * abs(value)

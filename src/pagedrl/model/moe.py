"""The sparse mixture-of-experts block of Mixtral, Qwen3-MoE and gpt-oss: a router picks k of E SwiGLU
experts per token and the block returns their outputs weighted by the router's probabilities.

router: logits = x Wᵀ (the `gate` projection) → softmax over the experts, in float32 → the top k →
renormalised to sum to one (Mixtral always; Qwen3-MoE if `norm_topk_prob`) → Qwen3-MoE rounds the
weights to the activations' dtype, Mixtral keeps them in float32. gpt-oss's router (`router`, a
projection with a bias) takes the top k of the logits first and softmaxes those k alone, in the logits'
dtype. The order and the casts are transformers', so a float32 forward agrees with it to rounding and
a bf16 one rounds alike.

Experts run grouped: the (token, expert) assignments are sorted by expert, and each expert multiplies
the rows sent to it in one product per weight, so the work is a loop over experts, never over tokens.
The results come back in token order, weighted, and each token's k of them are summed at once (in
float32 under Mixtral's float32 weights) and cast to the input's dtype, as transformers' default
("grouped_mm") experts path does: in bf16, one rounding of each token's sum where its eager loop
rounds after every add.

The weights sit as transformers 5 holds them in memory, one 3-D tensor per kind (`experts.gate_up_proj`
[E, 2I, H], each expert's gate rows then its up rows; `experts.down_proj` [E, H, I]), so its state dict
loads unrenamed; checkpoints on disk hold one 2-D tensor per expert (`model/expert_weights.py`).
gpt-oss's experts (`ClampedSwiGLUExperts`) sit in its own layout, on disk as in memory: transposed,
gate and up columns interleaved, with biases, and its clamped SwiGLU (`model/gpt_oss.py`).
The router (`gate`) is a projection like the others, and the experts' products go to the engine's
kernels as they do (`Routes.experts`, a bf16 engine's own steps). A trainer's rollouts take products
with `F.linear`'s numbers and no expert route (`engine/cpu_routes.py`), so their routing decisions
are computed as the trainer's recompute computes them.

LoRA on the stacked weights (PEFT's `target_parameters`, `model/expert_lora.py`) sits in `experts.adapters`:
each expert's products take its low-rank update, and the engine's expert route, which multiplies the bare
weights, steps aside while one is on. An engine's adapters chosen per request (`per_request`,
`engine/expert_slots.py`) split a step's rows instead: the base's keep the route, the adapted ones take
each expert's products and their own slot's update (`slotted`).

`collect_router_logits()` records each sparse layer's router logits, the input of the load-balancing
loss (`train/router_loss.py`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.model import routed
from pagedrl.model.config import ModelConfig
from pagedrl.model.routed import Linear

_recording = threading.local()


@contextlib.contextmanager
def collect_router_logits() -> Iterator[list[torch.Tensor]]:
    """A list that receives, in layer order, the router logits [tokens, experts] of every sparse layer
    run on this thread inside the block. Gradient checkpointing's recompute runs in the backward,
    outside the block, so nothing is recorded twice."""
    previous = getattr(_recording, "logits", None)
    _recording.logits = collected = []
    try:
        yield collected
    finally:
        _recording.logits = previous


class SlotSplit(Protocol):
    """A step's assignments split between rows without an adapter on these experts and rows with one,
    chosen per request (`engine/expert_slots.py`)."""

    order: torch.Tensor  # the assignments: the base's grouped by expert, then the adapted ones grouped by expert
    num_base: int
    base_counts: list[int]  # per expert, its base rows
    counts: list[int]  # per expert, its adapted rows

    def add(self, weight: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out`, the adapted rows' products of x by `weight`, with each row's own adapter's update."""
        ...


class PerRequest(Protocol):
    def split(self, order: torch.Tensor, k: int, counts: list[int]) -> SlotSplit | None:
        """The step's split, or None when no row of the step runs with an adapter on these experts."""
        ...


class Experts(nn.Module):
    """E SwiGLU experts in two 3-D tensors; `forward` runs each expert once over the rows routed to it."""

    routable = True  # the layout and activation `Routes.experts` computes
    per_request: PerRequest | None = None  # an engine's adapters chosen per request (`engine/expert_slots.py`)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.adapters = nn.ModuleDict()  # LoRA on the weights, by weight name (`model/expert_lora.py`)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's projections drawn as an `nn.Linear` of its shape draws them (fan-in uniform)."""
        with torch.no_grad():
            for weight in (self.gate_up_proj, self.down_proj):
                bound = 1.0 / math.sqrt(weight.shape[-1])
                weight.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; experts [N, k] (each row's chosen experts); weights [N, k] → [N, H] in x's dtype."""
        n, k = experts.shape
        if n == 0:
            return torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read per layer
        split = None if self.per_request is None else self.per_request.split(order, k, counts)
        if split is None:
            grouped = self.products(x.index_select(0, order // k), counts)
        else:  # the base's rows as ever, then the rows whose adapters adapt these experts
            order = split.order
            rows = x.index_select(0, order // k)
            base = split.num_base
            adapted = self.slotted(rows[base:], split)
            grouped = adapted if not base else torch.cat([self.products(rows[:base], split.base_counts), adapted])
        # Back in (token, choice) order, weighted, and each token's k results summed at once.
        per_choice = torch.empty_like(grouped).index_copy(0, order, grouped)
        weighted = per_choice * weights.reshape(-1, 1)
        return weighted.view(n, k, -1).sum(dim=1).to(x.dtype)

    def products(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert's SwiGLU of its rows (grouped by expert): on the engine's expert route when it takes
        them, else expert by expert."""
        routes = routed.current()
        grouped = None
        if routes is not None and routes.experts is not None and self.routable and not self.adapted():
            grouped = routes.experts(rows, counts, self.gate_up_proj, self.down_proj)
        return self.grouped(rows, counts) if grouped is None else grouped

    def grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows grouped by expert, `counts[e]` of them expert e's → each expert's SwiGLU of its rows."""
        return torch.cat([self.expert(e, part) for e, part in by_expert(rows, counts)])

    def slotted(self, rows: torch.Tensor, split: SlotSplit) -> torch.Tensor:
        """The rows of adapters chosen per request: every expert's gate/up product, then each row's own
        adapter's update on them all at once, the activation, and the same for down (`split.add`)."""
        counts = split.counts
        gate_up = split.add("gate_up_proj", rows, torch.cat([self.gate_up_of(e, p) for e, p in by_expert(rows, counts)]))
        hidden = self.activation(gate_up)
        return split.add("down_proj", hidden, torch.cat([self.down_of(e, p) for e, p in by_expert(hidden, counts)]))

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = self.activation(self.adapt(rows, self.gate_up_of(e, rows), "gate_up_proj", e))
        return self.adapt(hidden, self.down_of(e, hidden), "down_proj", e)

    def gate_up_of(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.gate_up_proj[e])

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def down_of(self, e: int, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.down_proj[e])

    def adapted(self) -> bool:
        """Whether a LoRA update is on: the engine's expert route multiplies the bare weights, so it is declined."""
        adapters = getattr(self, "adapters", None)  # (GGUF's experts hold none)
        return bool(adapters) and any(not a.disabled for a in adapters.values())

    def adapt(self, x: torch.Tensor, out: torch.Tensor, weight: str, e: int) -> torch.Tensor:
        """`out`, expert e's product of x by `weight`, plus that weight's LoRA update if it has one on."""
        adapters = self.adapters
        if weight not in adapters or adapters[weight].disabled:
            return out
        return adapters[weight].add_update(out, x, e)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.down_proj.shape[1]}, intermediate={self.intermediate_size}"


def by_expert(rows: torch.Tensor, counts: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, its rows) for each expert that has any, from rows grouped by expert (`counts[e]` expert e's)."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, rows[start:start + count]
            start += count


class ClampedSwiGLUExperts(Experts):
    """gpt-oss's E experts, as transformers holds them: `gate_up_proj` [E, H, 2I] (gate and up columns
    interleaved) and `down_proj` [E, I, H], multiplied from the right, each with a bias ([E, 2I], [E, H]),
    and the clamped SwiGLU between. No route takes them (`Routes.experts` computes the other layout and
    activation); under autocast the products run in bf16 and the biases are added in float32, as
    transformers' `x @ W + b` does."""

    routable = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        nn.Module.__init__(self)  # (the parent's tensors have other shapes)
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.adapters = nn.ModuleDict()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fan-in uniform, the fan-in being each weight's rows here; biases zero."""
        with torch.no_grad():
            for weight in (self.gate_up_proj, self.down_proj):
                bound = 1.0 / math.sqrt(weight.shape[-2])
                weight.uniform_(-bound, bound)
            self.gate_up_proj_bias.zero_()
            self.down_proj_bias.zero_()

    def gate_up_of(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        from pagedrl.model.gpt_oss import clamped_swiglu

        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def down_of(self, e: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.down_proj[e] + self.down_proj_bias[e]

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.down_proj.shape[2]}, intermediate={self.intermediate_size}, "
                f"alpha={self.alpha}, limit={self.limit}")


class SparseMoeBlock(nn.Module):
    """Router and experts: the feed-forward part of a sparse decoder layer (transformers' `mlp`). The
    router is `gate` (Mixtral, Qwen3-MoE) or `router` with a bias (gpt-oss), as transformers names it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalise = cfg.norm_topk_prob
        self.weights_in_input_dtype = cfg.model_type == "qwen3_moe"
        self.softmax_of_top_k = cfg.gpt_oss is not None
        if cfg.gpt_oss is not None:
            self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=True)
            self.experts: Experts = ClampedSwiGLUExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size,
                                                         cfg.gpt_oss.swiglu_alpha, cfg.gpt_oss.swiglu_limit)
        else:
            self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
            self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] → (router logits [N, E], chosen experts [N, k], their weights [N, k])."""
        if self.softmax_of_top_k:
            logits = self.router(x)
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            return logits, chosen, torch.softmax(top, dim=-1, dtype=top.dtype)
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.weights_in_input_dtype:
            top = top.to(logits.dtype)
        return logits, chosen, top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, chosen, weights = self.route(flat)
        recorded = getattr(_recording, "logits", None)
        if recorded is not None:
            recorded.append(logits)
        return self.experts(flat, chosen, weights).view(x.shape)


class DeepseekMoE(nn.Module):
    """DeepSeek-V3's sparse feed-forward (`model/deepseek.py` has the routing rule): routed experts
    weighted by `gate`, plus the shared experts every token goes through."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module) -> None:
        super().__init__()
        from pagedrl.model.deepseek import TopkRouter

        self.top_k = cfg.num_experts_per_tok
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)
        self.shared_experts = shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, chosen, weights = self.route(flat)
        return self.experts(flat, chosen, weights).view(x.shape) + self.shared_experts(x)


def has_sparse_layers(model: nn.Module) -> bool:
    """Whether `model` holds a sparse layer: the engine's fast paths that assume every layer's
    feed-forward is one SwiGLU (its CPU decode program) or a step without a host read (its CUDA
    graphs; each sparse layer reads its experts' row counts) decline such a model."""
    return any(isinstance(m, (SparseMoeBlock, DeepseekMoE)) for m in model.modules())

"""Adapters chosen per request on a mixture of experts' stacked weights (PEFT's `target_parameters`).

An adapter on expert weights gives each expert e of a weight its own rank-r update s·B_e A_e
(`model/expert_lora.py`). Per request, a row routed to expert e by a token of slot s takes
s·(x A[s, e]ᵀ) B[s, e]ᵀ, added to that expert's product before the activation (gate/up) or after
it (down), so the engine's expert route, which multiplies gate, up, activation and down in one go,
cannot take such rows. It keeps the rest: in a step where some requests carry an expert adapter,
the layer's assignments are split (`ExpertSplit`), the base's rows go to the route (or the plain
products) exactly as in a step without adapters, and the adapted rows take each expert's products
and then their updates, all at once: every adapted row is keyed by (slot, expert), grouped into
equal-width entries (`lora_step.Grouped`, the projections' own batching), and two batched matmuls
give every row its own slot's and expert's update. No row reads another slot's numbers (a NaN in one
adapter stays in its own requests), and a step without an expert adapter is not touched at all.

The stacks are made at the first adapter that adapts a weight, so an engine that never serves one
holds none: per weight [slots · E, in, max rank] (Aᵀ) and [slots · E, max rank, out] ((s·B)ᵀ),
rows past an adapter's rank zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedrl.engine.lora_step import Grouped
from pagedrl.model.expert_lora import EXPERT_WEIGHTS, matches
from pagedrl.model.moe import ClampedSwiGLUExperts, Experts

if TYPE_CHECKING:
    from pagedrl.engine.multi_lora import LoRASlots

ExpertPair = tuple[torch.Tensor, torch.Tensor]  # Aᵀ [E, in, r] and (s·B)ᵀ [E, r, out], in the model's dtype


class ExpertSlots:
    """One experts module's adapters per request: its stacks, each slot's rank per weight, and the split
    of a step's assignments (`split`, called by the module's forward as its `per_request`)."""

    def __init__(self, module: Experts, slots: LoRASlots) -> None:
        self.slots = slots
        self.num_experts = module.num_experts
        # PEFT nests one wrapper per targeted parameter, in the module's own order (`peft_names`).
        self.param_order = [name for name, _ in module.named_parameters(recurse=False)]
        transposed = isinstance(module, ClampedSwiGLUExperts)  # gpt-oss's [E, in, out]
        self.features: dict[str, tuple[int, int]] = {}  # weight → (in, out)
        for weight in EXPERT_WEIGHTS:
            _, rows, cols = getattr(module, weight).shape
            self.features[weight] = (rows, cols) if transposed else (cols, rows)
        self.ranks = {w: [0] * slots.max_loras for w in EXPERT_WEIGHTS}
        # Per weight, whether a slot's adapter adapts it, indexed by slot + 1 (BASE's entry is always False).
        self.adapts = {w: torch.zeros(slots.max_loras + 1, dtype=torch.bool) for w in EXPERT_WEIGHTS}
        self.stacks: dict[str, ExpertPair] = {}
        module.per_request = self

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.stacks.values() for t in pair)

    def stack(self, weight: str) -> ExpertPair:
        pair = self.stacks.get(weight)
        if pair is None:
            s, r, (n_in, n_out) = self.slots.max_loras * self.num_experts, self.slots.max_lora_rank, self.features[weight]
            kw: dict[str, Any] = {"dtype": self.slots.dtype, "device": self.slots.device}
            with torch.inference_mode(False):  # made inside a step, written in place by later ones
                pair = self.stacks[weight] = (torch.zeros(s, n_in, r, **kw), torch.zeros(s, r, n_out, **kw))
        return pair

    @torch.no_grad()
    def load(self, slot: int, tensors: dict[str, ExpertPair], rank: int) -> None:
        """Slot `slot` takes `tensors` (by weight; a weight left out: no update on it)."""
        rows = slice(slot * self.num_experts, (slot + 1) * self.num_experts)
        for weight in EXPERT_WEIGHTS:
            pair = tensors.get(weight)
            self.ranks[weight][slot] = 0 if pair is None else rank
            self.adapts[weight][slot + 1] = pair is not None
            if pair is None and weight not in self.stacks:
                continue
            a, bt = self.stack(weight)
            a[rows].zero_()
            bt[rows].zero_()
            if pair is not None:
                a[rows, :, :rank].copy_(pair[0])
                bt[rows, :rank].copy_(pair[1])

    def split(self, order: torch.Tensor, k: int, counts: list[int]) -> ExpertSplit | None:
        """The step's assignments (`order`: grouped by expert, token = index // k) split between the base
        and adapted rows; None when none of the step's adapters adapts these experts."""
        step = self.slots.step
        if step is None or not any(r for ranks in self.ranks.values() for r in ranks[step.lo:step.hi]):
            return None
        if len(step.token_slot) * k != len(order):
            raise RuntimeError(f"experts got {len(order) // k} rows in a step of {len(step.token_slot)} tokens; "
                               "adapters per request on experts need the step's rows as they are")
        host = order.cpu()
        slot = step.token_slot[host // k]  # each assignment's slot, BASE for the base's
        adapts = self.adapts["gate_up_proj"][slot + 1] | self.adapts["down_proj"][slot + 1]
        if not bool(adapts.any()):
            return None
        experts = self.num_experts
        expert = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
        base, rows = (~adapts).nonzero().flatten(), adapts.nonzero().flatten()
        base_counts = torch.bincount(expert[base], minlength=experts).tolist()
        slot, expert = slot[rows], expert[rows]
        plans: dict[str, Grouped] = {}
        for weight in EXPERT_WEIGHTS:
            mine = self.adapts[weight][slot + 1]
            if not bool(mine.any()):
                continue
            same = next((g for w, g in plans.items() if torch.equal(self.adapts[w][slot + 1], mine)), None)
            which = mine.nonzero().flatten()
            plans[weight] = same or Grouped.of(which, slot[which] * experts + expert[which], len(rows), order.device)
        return ExpertSplit(torch.cat([host[base], host[rows]]).to(order.device), len(base), base_counts,
                           torch.bincount(expert, minlength=experts).tolist(), plans, self)


@dataclass
class ExpertSplit:
    """One layer's assignments in a step with expert adapters (`model/moe.py`'s `SlotSplit`)."""

    order: torch.Tensor
    num_base: int
    base_counts: list[int]
    counts: list[int]
    plans: dict[str, Grouped]  # by weight: its adapted rows grouped by (slot, expert)
    owner: ExpertSlots

    def add(self, weight: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        g = self.plans.get(weight)
        if g is None:
            return out
        (n_in, n_out), (a, bt) = self.owner.features[weight], self.owner.stack(weight)
        a, bt = a[g.lo:g.hi], bt[g.lo:g.hi]
        if g.entry_slot is not None:
            a, bt = a.index_select(0, g.entry_slot), bt.index_select(0, g.entry_slot)
        grouped = x.index_select(0, g.gather).view(-1, g.width, n_in).to(a.dtype)  # [entries, width, in]
        own = torch.bmm(torch.bmm(grouped, a), bt).view(-1, n_out).index_select(0, g.back).to(out.dtype)
        if g.tokens is None:
            return out.add_(own)
        return out.index_add_(0, g.tokens, own)


def slot_experts(model: torch.nn.Module, slots: LoRASlots) -> dict[str, ExpertSlots]:
    """Every experts module with stacked float weights takes adapters per request (experts kept
    quantized, GGUF's or MXFP4's, hold none), by module name."""
    return {name: ExpertSlots(m, slots) for name, m in model.named_modules()
            if isinstance(m, Experts) and all(getattr(m, w, None) is not None for w in EXPERT_WEIGHTS)}


def read_expert_tensors(where: str, config: Any, state: dict[str, torch.Tensor], experts: dict[str, ExpertSlots],
                        dtype: torch.dtype) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, ExpertPair]]]:
    """The expert adapters' tensors of `state` (taken out of it), by module and weight: PEFT's lora_A
    [r·E, in] and lora_B [out, r·E], and the pair a slot holds. PEFT names them by the nesting of its
    wrappers (the last targeted weight's at `experts.lora_A.weight`, the one before it under
    `base_layer.`, and so on), which the targets and the module's parameter order resolve."""
    found: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key in list(state):
        module, sep, part = key.rpartition(".lora_")
        name, depth = module, 0
        while name.endswith(".base_layer"):
            name, depth = name[: -len(".base_layer")], depth + 1
        if not sep or name not in experts:
            continue
        targeted = [w for w in experts[name].param_order if matches(f"{name}.{w}", config.target_parameters or [])]
        if depth >= len(targeted):
            raise ValueError(f"{where}: tensor {key!r} is the adapter of none of {name}'s weights that "
                             f"target_parameters {config.target_parameters} name")
        weight = targeted[len(targeted) - 1 - depth]
        if weight not in EXPERT_WEIGHTS:
            raise ValueError(f"{where}: target_parameters adapt {name}.{weight}; adapters on an expert module take "
                             f"its stacked weights ({', '.join(EXPERT_WEIGHTS)}) only")
        found.setdefault(name, {}).setdefault(weight, {})[part[0]] = state.pop(key)
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, ExpertPair]]] = {}
    r = config.r
    for name, weights in found.items():
        e = experts[name].num_experts
        for weight, pair in weights.items():
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{where}: {name}.{weight} has lora_{next(iter(pair))} but not its other half")
            (n_in, n_out), a, b = experts[name].features[weight], pair["A"], pair["B"]
            want_a, want_b = (r * e, n_in), (n_out, r * e)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(f"{where}: {name}.{weight} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                                 f"this base model's {e} experts need {want_a} and {want_b} at rank {r} (an adapter "
                                 "of another base model?)")
            at = a.view(e, r, n_in).transpose(1, 2)  # PEFT's reshape(E, r, in): expert e's A in rows e·r …
            bt = b.double().view(n_out, r, e).permute(2, 1, 0) * config.scaling  # (E, r, out): B's interleave
            out.setdefault(name, {})[weight] = (a, b, (at.to(dtype).contiguous(), bt.to(dtype).contiguous()))
    return out


def is_expert_key(key: str) -> bool:
    """Whether an adapter tensor sits on an experts module (PEFT's wrappers of stacked weights)."""
    module = key.rpartition(".lora_")[0]
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    return module.endswith(".experts")


"""Low-precision copies of a float32 module's projection weights, for an engine that samples under
the trainer's autocast.

Autocast casts the weight of every linear projection from float32 to bf16 at every call (its cast
cache lives only inside one autocast block, and a copy kept across steps would go stale after the
next optimizer step). On a CPU those casts cost as much as a decode step's matmuls: 324-356 output
tokens/s for a float32 SmolLM2-135M under bf16 autocast against 611-646 for the same module with
bf16 projection weights (32 prompts, 64 greedy tokens each, 2 threads).

So the engine runs on a twin of the module: it shares every tensor autocast leaves in float32
(embeddings, norms, buffers: the same tensors, not copies) and holds a bf16 copy of each tensor
autocast would cast (the weights and biases of the projections and of the LM head, the adapters', a
mixture of experts' router and stacked expert weights).
A cast is a deterministic rounding, so the twin under autocast computes exactly what the trainer's
autocast computes from the masters. The copies are refreshed once per change of the masters: each
step compares the masters' in-place version counters (bumped by an optimizer step, a checkpoint
load, a merge) with those seen at the last copy. Memory: two bytes per projection parameter
(~270 MB for SmolLM2-135M, whose tied LM head gets a copy of its own).
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from pagedrl.model.expert_lora import ExpertLoRA
from pagedrl.model.lora import LoRALinear
from pagedrl.model.moe import Experts

PROJECTIONS = (nn.Linear, LoRALinear)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # a mixture of experts' stacked projections, cast as autocast casts them


class CastWeights:
    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
        self.twin: nn.Module = copy.deepcopy(model, memo=shared)  # every tensor shared, the modules new
        self.masters: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []
        made: dict[int, nn.Parameter] = {}
        for module in self.twin.modules():
            if not isinstance(module, (*PROJECTIONS, Experts)):
                continue
            for name in EXPERT_WEIGHTS if isinstance(module, Experts) else ("weight", "bias"):
                master = getattr(module, name, None)
                if master is None:
                    continue
                if id(master) not in made:
                    made[id(master)] = nn.Parameter(master.detach().to(dtype), requires_grad=False)
                    self.masters.append(master)
                    self.copies.append(made[id(master)])
                setattr(module, name, made[id(master)])
        self.lora_pairs = [(m, t) for m, t in zip(model.modules(), self.twin.modules(), strict=True)
                           if isinstance(m, (LoRALinear, ExpertLoRA))]
        self.versions = [m._version for m in self.masters]
        self.num_refreshes = 0

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)

    @torch.no_grad()
    def refresh(self) -> bool:
        """Copy the masters that changed since the last copy; True if any did. Adapters switched
        off on the master (`disable_adapter`) are switched off on the twin too."""
        for master, twin in self.lora_pairs:
            twin.disabled = master.disabled
        versions = [m._version for m in self.masters]
        if versions == self.versions:
            return False
        for i, (master, cast) in enumerate(zip(self.masters, self.copies, strict=True)):
            if versions[i] != self.versions[i]:
                cast.copy_(master)
        self.versions = versions
        self.num_refreshes += 1
        return True

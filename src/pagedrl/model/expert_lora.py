"""LoRA on a mixture of experts' stacked weights: PEFT's `target_parameters` (its `ParamWrapper`).

A 3-D expert weight W [E, ·, ·] gets, for each expert e, W_e + s·ΔW_e with ΔW_e = B_e A_e (A_e [r, in],
B_e [out, r], s = lora_alpha / r): a rank-r update per expert, as PEFT computes it. Its tensors are
PEFT's, shaped and ordered as PEFT holds them, so a saved adapter is byte for byte what PEFT reads:
  lora_A.weight [r·E, in]  expert e's A in rows e·r … e·r + r - 1 (PEFT's reshape(E, r, in));
  lora_B.weight [out, r·E] expert e's B in columns j·E + e, the experts interleaved (PEFT's
                           reshape(out, r, E)): the two halves do not share one layout, and PEFT's
                           reshapes are what the tensors mean.
Mixtral's and Qwen3-MoE's weights are [E, out, in] (y = x W_eᵀ; `gate_up_proj` in = hidden, out = 2·I),
gpt-oss's are [E, in, out] (y = x W_e, PEFT's `is_transposed`); either way the update of a product of
rows x is s·(x A_eᵀ) B_eᵀ, which the experts add to each expert's product (`model/moe.py`), factored:
never a weight-sized tensor per step. Merging adds ΔW (transposed for gpt-oss) to W.

As PEFT: A is drawn like an `nn.Linear` weight of its shape (Kaiming-uniform, fan-in `in`), B starts at
zero, and there is no dropout (PEFT refuses `lora_dropout` on a parameter: dropout of x cannot be
folded into a weight's update).

Names: PEFT wraps the experts module once per targeted weight, in the module's parameter order, each
wrapper around the one before, so the last targeted weight's adapter is `experts.lora_A.weight`, the
one before it `experts.base_layer.lora_A.weight`, and so on. pagedrl holds them at
`experts.adapters.<weight>` and renames on save and load (`peft_names`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedrl.model.moe import ClampedSwiGLUExperts, Experts

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class ExpertLoRA(nn.Module):
    """The rank-r updates of one stacked expert weight, one per expert, in PEFT's tensors."""

    def __init__(self, weight: torch.Tensor, transposed: bool, r: int, lora_alpha: float,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        experts, rows, cols = weight.shape
        self.in_features, self.out_features = (rows, cols) if transposed else (cols, rows)
        self.num_experts, self.r, self.transposed = experts, r, transposed
        kw = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A = nn.Linear(self.in_features, r * experts, bias=False, **kw)
        self.lora_B = nn.Linear(r * experts, self.out_features, bias=False, **kw)
        with torch.no_grad():
            bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=√5) of [r·E, in], PEFT's init
            self.lora_A.weight.copy_(torch.empty(r * experts, self.in_features).uniform_(-bound, bound,
                                                                                           generator=generator))
            self.lora_B.weight.zero_()
        self.scaling = lora_alpha / r
        self.disabled = False

    def factors(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (A_e [r, in], B_e [out, r]): views of the two tensors."""
        a = self.lora_A.weight.view(self.num_experts, self.r, self.in_features)[e]
        b = self.lora_B.weight.view(self.out_features, self.r, self.num_experts)[:, :, e]
        return a, b

    def add_update(self, out: torch.Tensor, x: torch.Tensor, e: int) -> torch.Tensor:
        """out + s·(x A_eᵀ) B_eᵀ: expert e's product `out` of the rows x [n, in] with its update, in one
        fused op as `LoRALinear` adds its own (gpt-oss's float32 sums with a bias under autocast: added)."""
        a, b = self.factors(e)
        down = F.linear(x, a)
        if out.dtype != down.dtype:
            return out + F.linear(down, b) * self.scaling
        return torch.addmm(out, down, b.t(), alpha=self.scaling)

    def delta_weight(self) -> torch.Tensor:
        """s·B_e A_e for every expert, laid out as the weight is ([E, out, in], or [E, in, out] transposed)."""
        a = self.lora_A.weight.view(self.num_experts, self.r, self.in_features)
        b = self.lora_B.weight.view(self.out_features, self.r, self.num_experts).permute(2, 0, 1)
        delta = torch.bmm(b, a) * self.scaling
        return delta.transpose(1, 2) if self.transposed else delta

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, r={self.r}, "
                f"scaling={self.scaling:g}")


def expert_adapters(model: nn.Module) -> Iterator[tuple[str, ExpertLoRA]]:
    for name, m in model.named_modules():
        if isinstance(m, ExpertLoRA):
            yield name, m


def matches(key: str, targets: Sequence[str]) -> list[str]:
    """The targets that name parameter `key`, by PEFT's rule: the whole name, or a tail after a dot."""
    return [t for t in targets if key == t or key.endswith(f".{t}")]


def expert_weight_names(model: nn.Module) -> list[str]:
    """Every adaptable expert weight of `model`, by its parameter name."""
    return [f"{name}.{w}" for name, m in model.named_modules() if isinstance(m, Experts)
            for w in EXPERT_WEIGHTS if getattr(m, w, None) is not None and getattr(m, w).dim() == 3]


def apply_expert_lora(model: nn.Module, targets: Sequence[str], r: int, lora_alpha: float,
                      generator: torch.Generator | None = None) -> int:
    """Adapters on every expert weight that `targets` names (PEFT's `target_parameters`); returns how many.
    A target that names no parameter, or one that is not an expert's stacked weight, is refused by name, as
    are experts kept in MXFP4 (their weights are blocks, not parameters: load the model without quantization)."""
    kept = next((f"{name}.gate_up_blocks" for name, m in model.named_modules() if hasattr(m, "gate_up_blocks")), None)
    if kept is not None and targets:
        raise ValueError(f"lora_target_parameters: {kept} is kept in MXFP4, which takes no adapter; load the model "
                         "without quantization='mxfp4' / 'gguf' to train its experts")
    adaptable = set(expert_weight_names(model))
    used: set[str] = set()
    for key, _ in model.named_parameters():
        hits = matches(key, targets)
        if hits and key not in adaptable:
            raise ValueError(f"lora_target_parameters: {hits[0]!r} names {key}, which is not an expert's stacked "
                             f"weight; adapters on parameters are supported on {', '.join(EXPERT_WEIGHTS)} of a "
                             "mixture of experts only")
        used.update(hits)
    unused = [t for t in targets if t not in used]
    if unused:
        tails = sorted({k.split(".layers.")[-1].split(".", 1)[-1] for k in adaptable}) or ["none in this model"]
        raise ValueError(f"lora_target_parameters: {unused} name no parameter of the model; its expert weights "
                         f"are {', '.join(tails)}")
    count = 0
    for prefix, module in list(model.named_modules()):
        if not isinstance(module, Experts):
            continue
        for weight_name, weight in module.named_parameters(recurse=False):  # PEFT's order: the module's own
            if matches(f"{prefix}.{weight_name}", targets):
                transposed = isinstance(module, ClampedSwiGLUExperts)
                module.adapters[weight_name] = ExpertLoRA(weight, transposed, r, lora_alpha, generator)
                count += 1
    return count


def merge_expert_lora(model: nn.Module) -> None:
    """Fold every expert adapter into its weight (in place) and remove it."""
    for module in model.modules():
        adapters = getattr(module, "adapters", None)
        if not isinstance(module, Experts) or not adapters:
            continue
        with torch.no_grad():
            for weight_name, lora in adapters.items():
                weight = getattr(module, weight_name)
                weight.add_(lora.delta_weight().to(weight.dtype))
        module.adapters = nn.ModuleDict()


def peft_names(model: nn.Module) -> dict[str, str]:
    """pagedrl's name of each expert adapter tensor → PEFT's (the nesting of its wrappers, module docstring)."""
    out = {}
    for name, module in model.named_modules():
        adapters = getattr(module, "adapters", None)
        if not isinstance(module, Experts) or not adapters:
            continue
        for i, weight_name in enumerate(adapters):
            nesting = "base_layer." * (len(adapters) - 1 - i)
            for half in ("lora_A.weight", "lora_B.weight"):
                out[f"{name}.adapters.{weight_name}.{half}"] = f"{name}.{nesting}{half}"
    return out

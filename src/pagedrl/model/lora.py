"""LoRA (Hu et al. 2021): a frozen linear projection plus a trained low-rank update, W x + s·B A x.

`LoRALinear` replaces a decoder projection in place and keeps the base weight and bias under
their own names (`q_proj.weight`), so the base still loads and saves in Hugging Face layout; the
update lives in `q_proj.lora_A.weight` [r, in] and `q_proj.lora_B.weight` [out, r], PEFT's names.
As PEFT: A is drawn like an `nn.Linear` weight (Kaiming-uniform), B starts at zero (so the adapted
model starts as the base), s = lora_alpha / r, and dropout applies to the adapter's input only.

The engine runs on the same module, so a rollout samples from the adapted model with no merge and
no copy. Dropout acts only where a gradient is taken (training mode with autograd on): rollouts
(inference mode), evaluations and the no-grad passes that fix old log-probs see the adapter whole.

A mixture of experts' stacked weights take adapters too, named as PEFT's `target_parameters` name them
(`mlp.experts.gate_up_proj`): `model/expert_lora.py`.

`disable_adapter(model)` switches every adapter off for a block: DPO, GRPO and PPO use the base
model as their reference that way, without a second copy of the weights.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from pagedrl.model import batch_invariant
from pagedrl.model.expert_lora import ExpertLoRA, apply_expert_lora, expert_adapters, merge_expert_lora
from pagedrl.model.moe import has_sparse_layers
from pagedrl.model.projections import LAYER_PROJECTIONS
from pagedrl.model.quantized_linear import QuantizedLinear

ALL_LINEAR = "all-linear"
# PEFT's defaults for the Llama family (llama, mistral, qwen2, qwen3): the query and value projections.
DEFAULT_TARGETS = ("q_proj", "v_proj")
HEADS = ("lm_head", "score", "value_head")
FEED_FORWARD = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """What an adapter is: PEFT's LoraConfig fields that pagedrl supports."""

    r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    target_modules: list[str] | None = None  # None: q_proj, v_proj; ["all-linear"]: every layer projection
    # PEFT's target_parameters: a mixture of experts' stacked weights ("mlp.experts.gate_up_proj"); with
    # target_modules None, only those (as PEFT: its default modules apply when no parameter is named).
    target_parameters: list[str] | None = None
    modules_to_save: list[str] = field(default_factory=list)  # fully trained modules (a reward model's `score`)
    task_type: str = "CAUSAL_LM"  # or SEQ_CLS (a reward model or a critic)
    base_model_name_or_path: str | None = None
    revision: str | None = None  # of a Hub base (PEFT records it too)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora_r: must be an integer >= 1, got {self.r!r}")
        if not math.isfinite(self.lora_alpha) or self.lora_alpha <= 0:  # NaN passes `<= 0`: every update NaN
            raise ValueError(f"lora_alpha: must be a finite number > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout: must lie in [0, 1), got {self.lora_dropout}")
        if self.target_parameters is not None and not self.target_parameters:
            raise ValueError("lora_target_parameters: empty; name expert weights (mlp.experts.gate_up_proj, "
                             "mlp.experts.down_proj) or leave it unset")
        if self.target_parameters and self.lora_dropout:
            raise ValueError(f"lora_dropout: must be 0 with lora_target_parameters, got {self.lora_dropout} (as in "
                             "PEFT, a dropped input cannot be folded into an expert weight's update)")
        names = self.resolved_targets()
        unknown = [t for t in names if t not in LAYER_PROJECTIONS]
        if unknown or not (names or self.target_parameters):
            raise ValueError(f"lora_target_modules: {unknown or names} are not decoder projections; choose among "
                             f"{', '.join(LAYER_PROJECTIONS)} or {ALL_LINEAR!r}")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r

    def resolved_targets(self) -> list[str]:
        """The projection names adapted, in the decoder's order."""
        targets = self.target_modules
        if targets is None:
            return [] if self.target_parameters else list(DEFAULT_TARGETS)
        if targets == ALL_LINEAR or list(targets) == [ALL_LINEAR]:
            return list(LAYER_PROJECTIONS)
        return [t for t in LAYER_PROJECTIONS if t in targets] + [t for t in targets if t not in LAYER_PROJECTIONS]


class LoRALinear(nn.Module):
    """y = x Wᵀ + b + s · B(A(dropout(x))), with W and b frozen (the base layer's own tensors).

    On a quantized base (QLoRA, `model/quantized_linear.py`) the base is kept whole as `base_layer`
    (PEFT's name), whose product dequantizes W on the fly; `weight` and `bias` are then None."""

    def __init__(self, base: nn.Linear | QuantizedLinear, r: int, lora_alpha: float, lora_dropout: float,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.base_layer: QuantizedLinear | None = None
        if isinstance(base, QuantizedLinear):
            self.base_layer = base.requires_grad_(False)
            self.weight, self.bias = None, None
            kw = {"device": base.qweight.device, "dtype": torch.float32}
        else:
            self.weight = base.weight
            self.bias = base.bias
            self.weight.requires_grad_(False)
            if self.bias is not None:
                self.bias.requires_grad_(False)
            kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **kw)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **kw)
        with torch.no_grad():
            bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=√5), nn.Linear's and PEFT's init
            a = torch.empty(r, self.in_features).uniform_(-bound, bound, generator=generator)
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()
        self.scaling = lora_alpha / r
        self.dropout = lora_dropout
        self.disabled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias) if self.base_layer is None else self.base_layer(x)
        if self.disabled:
            return out
        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            # Checkpointed: backward redraws the same mask (the RNG state is kept) instead of holding
            # a dropped copy of x per adapted projection: without it LoRA held more activation
            # memory than full fine-tuning (x itself is shared by q, k and v). The recompute runs in
            # backward, outside the forward's batch-invariant scope: it is re-entered, or the recompute
            # would multiply differently and save other tensors than the forward did.
            a = torch.utils.checkpoint.checkpoint(batch_invariant.scoped(self.dropped_down, batch_invariant.active()),
                                                  x, use_reentrant=False)
        else:
            a = self.lora_A(x)
        # out + s·B(a) in one fused op: on a CPU decode step the adapter's cost is mostly op count.
        fused = torch.addmm(out.reshape(-1, self.out_features), a.reshape(-1, a.shape[-1]), self.lora_B.weight.t(),
                            alpha=self.scaling)
        return fused.view(out.shape)

    def dropped_down(self, x: torch.Tensor) -> torch.Tensor:
        """A(dropout(x)): the adapter's input side under dropout."""
        return self.lora_A(F.dropout(x, self.dropout, training=True))

    def delta_weight(self) -> torch.Tensor:
        """s · B A: what merging adds to W."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain Linear holding W + s·B A (the base tensors themselves, updated in place; a quantized
        base is dequantized first, as PEFT merges into a 4-bit layer, and the result stays float)."""
        if self.base_layer is not None:
            base = self.base_layer
            linear = nn.Linear(self.in_features, self.out_features, bias=base.bias is not None, device="meta")
            weight = base.dequantized(torch.float32) + self.delta_weight().detach().float()
            linear.weight = nn.Parameter(weight, requires_grad=False)
            linear.bias = base.bias
            return linear
        with torch.no_grad():
            self.weight.add_(self.delta_weight().to(self.weight.dtype))
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.lora_A.out_features}, scaling={self.scaling:g}"


def _set_child(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield name, m


def apply_lora(model: nn.Module, config: LoRAConfig, generator: torch.Generator | None = None) -> nn.Module:
    """Adapt `model` in place: every targeted projection becomes a `LoRALinear`; every parameter but
    the adapters' and those of `config.modules_to_save` is frozen. `model.lora_config` records the
    config (what saving writes and what `adapter_config` finds)."""
    if getattr(model, "lora_config", None) is not None:
        raise ValueError("apply_lora: the model already carries an adapter")
    targets = set(config.resolved_targets())
    feed_forward = sorted(targets & set(FEED_FORWARD))
    if feed_forward and has_sparse_layers(model):
        attention = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                            if isinstance(m, nn.Linear) and ".self_attn." in n}, key=LAYER_PROJECTIONS.index)
        raise ValueError(f"lora_target_modules: {feed_forward} on a mixture of experts is not supported (PEFT would "
                         "adapt the experts' weights under those names too); target the attention projections "
                         f"({', '.join(attention)}), and the experts with lora_target_parameters "
                         "(mlp.experts.gate_up_proj, mlp.experts.down_proj)")
    wrapped = [name for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, QuantizedLinear)) and name.rpartition(".")[2] in targets]
    if targets and not wrapped:
        present = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
                         & set(LAYER_PROJECTIONS), key=LAYER_PROJECTIONS.index)
        raise ValueError(f"lora_target_modules: no layer of the model is named {sorted(targets)}; its projections "
                         f"are {', '.join(present)}")
    model.requires_grad_(False)
    for name in wrapped:
        base = model.get_submodule(name)
        _set_child(model, name, LoRALinear(base, config.r, config.lora_alpha, config.lora_dropout, generator))
    if config.target_parameters:
        apply_expert_lora(model, config.target_parameters, config.r, config.lora_alpha, generator)
    for name in config.modules_to_save:
        try:
            model.get_submodule(name).requires_grad_(True)
        except AttributeError:
            raise ValueError(f"modules_to_save: the model has no module {name!r}") from None
    model.lora_config = config
    return model


def adapter_config(model: nn.Module) -> LoRAConfig | None:
    """The adapter `model` carries, or None for a plain model."""
    return getattr(model, "lora_config", None)


@contextlib.contextmanager
def disable_adapter(model: nn.Module) -> Iterator[None]:
    """Within the block `model` computes as its base (every LoRA update off); restored after."""
    layers: list[LoRALinear | ExpertLoRA] = [m for _, m in lora_layers(model)]
    layers += [m for _, m in expert_adapters(model)]
    before = [m.disabled for m in layers]
    for m in layers:
        m.disabled = True
    try:
        yield
    finally:
        for m, was in zip(layers, before, strict=True):
            m.disabled = was


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put plain Linears back: the model then is an
    ordinary one (saved in HF layout, served at the base model's speed)."""
    for name, m in list(lora_layers(model)):
        _set_child(model, name, m.merged())
    merge_expert_lora(model)
    model.lora_config = None
    return model


def adapter_state_dict(model: nn.Module, extra: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """The trained tensors of an adapter: lora_A/lora_B of every layer, and the full tensors of
    `modules_to_save` (and of `extra` module names)."""
    config = adapter_config(model)
    keep = tuple(f"{name}." for name in [*(config.modules_to_save if config else []), *extra])
    return {k: v for k, v in model.state_dict().items()
            if ".lora_A." in k or ".lora_B." in k or k.startswith(keep)}

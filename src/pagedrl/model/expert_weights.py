"""Expert weights between a checkpoint's layout and the model's.

On disk, Mixtral and Qwen3-MoE checkpoints (those the model makers publish, and those transformers 5
writes with `save_pretrained`) hold one 2-D tensor per expert and projection:
  Mixtral    `layers.L.block_sparse_moe.experts.E.w1.weight` (gate), `w3` (up), `w2` (down), and the
             router `layers.L.block_sparse_moe.gate.weight`;
  Qwen3-MoE  `layers.L.mlp.experts.E.gate_proj.weight`, `up_proj`, `down_proj`, router `layers.L.mlp.gate.weight`.
In memory the model holds them as transformers 5 does (`model/moe.py`): `layers.L.mlp.experts.gate_up_proj`
[E, 2I, H] (expert e's gate rows, then its up rows), `layers.L.mlp.experts.down_proj` [E, H, I] and
`layers.L.mlp.gate.weight`. `from_disk` stacks the per-expert tensors (and passes the in-memory names
through, so a state dict taken from a transformers model loads too); `to_disk` splits them again, so
what pagedrl saves is what transformers' `from_pretrained` and vLLM read. Dense models pass through, and
so does gpt-oss, whose checkpoints hold each layer's experts stacked as its model holds them
(`experts.gate_up_proj`, `experts.down_proj` and their biases; published ones as MXFP4 pairs,
dequantized when read: `model/mxfp4.py`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from pagedrl.model.config import ModelConfig


class DiskNames(NamedTuple):
    block: str  # the feed-forward module's name in a layer, on disk
    gate: str
    up: str
    down: str


DISK_NAMES = {
    "mixtral": DiskNames("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": DiskNames("mlp", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": DiskNames("mlp", "gate_proj", "up_proj", "down_proj"),  # (shared_experts: one MLP, as is)
}
_FUSED = re.compile(r"^(?P<prefix>.*\.)mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")


def to_disk(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's state dict in the checkpoint layout: each expert's projections as tensors of their own
    (copies: safetensors stores no two names over one buffer)."""
    names = DISK_NAMES.get(cfg.model_type)
    if names is None or not cfg.num_experts:
        return state
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        fused = _FUSED.match(key)
        if fused is None:
            out[_router_on_disk(key, names)] = tensor
            continue
        base = f"{fused['prefix']}{names.block}.experts"
        for e in range(tensor.shape[0]):
            if fused["kind"] == "down_proj":
                out[f"{base}.{e}.{names.down}.weight"] = tensor[e].clone()
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{base}.{e}.{names.gate}.weight"] = gate.clone()
                out[f"{base}.{e}.{names.up}.weight"] = up.clone()
    return out


def from_disk(state: dict[str, torch.Tensor], cfg: ModelConfig,
              origins: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the model's names, each layer's experts stacked; `origins` (tensor
    name -> file) gets the stacked names too. Raises ValueError naming a missing or misshapen expert."""
    names = DISK_NAMES.get(cfg.model_type)
    if names is None or not cfg.num_experts:
        return state
    roles = {names.gate: "gate", names.up: "up", names.down: "down"}
    per_expert = re.compile(rf"^(?P<prefix>.*\.){names.block}\.experts\.(?P<e>\d+)\."
                            rf"(?P<role>{'|'.join(map(re.escape, roles))})\.weight$")
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[tuple[str, int], str]] = {}  # layer prefix -> (role, expert) -> name on disk
    for key, tensor in state.items():
        match = per_expert.match(key)
        if match is None:
            out[_router_in_memory(key, names)] = tensor
            continue
        groups.setdefault(match["prefix"], {})[(roles[match["role"]], int(match["e"]))] = key
    for prefix, found in groups.items():
        def expert(role: str, e: int, found: dict[tuple[str, int], str] = found, prefix: str = prefix) -> torch.Tensor:
            key = found.get((role, e))
            if key is None:
                disk = {"gate": names.gate, "up": names.up, "down": names.down}[role]
                raise ValueError(f"missing tensor {prefix}{names.block}.experts.{e}.{disk}.weight "
                                 f"(config.json names {cfg.num_experts} experts)")
            return state[key]

        experts = range(cfg.num_experts)
        gate_up = f"{prefix}mlp.experts.gate_up_proj"
        down = f"{prefix}mlp.experts.down_proj"
        out[gate_up] = _stack([torch.cat([expert("gate", e), expert("up", e)]) for e in experts], gate_up)
        out[down] = _stack([expert("down", e) for e in experts], down)
        for name, role in ((gate_up, "gate"), (down, "down")):
            if origins is not None and found[(role, 0)] in origins:
                origins[name] = origins[found[(role, 0)]]
        extra = sorted(e for _, e in found if e >= cfg.num_experts)
        if extra:
            raise ValueError(f"unexpected tensors of expert {extra[0]} in {prefix}{names.block} "
                             f"(config.json names {cfg.num_experts} experts)")
    return out


def _stack(tensors: list[torch.Tensor], name: str) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"the experts stacked into {name!r} differ in shape: {sorted(shapes)}")
    return torch.stack(tensors)


def _router_on_disk(key: str, names: DiskNames) -> str:
    if names.block != "mlp" and key.endswith(".mlp.gate.weight"):
        return key[: -len("mlp.gate.weight")] + f"{names.block}.gate.weight"
    return key


def _router_in_memory(key: str, names: DiskNames) -> str:
    if names.block != "mlp" and key.endswith(f".{names.block}.gate.weight"):
        return key[: -len(f"{names.block}.gate.weight")] + "mlp.gate.weight"
    return key

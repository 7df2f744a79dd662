"""Many LoRA adapters in one engine, chosen per request, all in the same step (Punica, S-LoRA).

Every decoder projection of the engine's model becomes a `SlotLinear`: the base matmul runs once
for the whole batch, as the projection it wraps computes it (the decoder's `Linear` through the step's
routes, or a `GGUFLinear` whose weight stays quantized, GGUF or int8 / int4 made at load, on the block
kernels), then each token gets the low-rank update of its own adapter's slot, through
that slot's A and B only (`lora_step`): a prompt's run of tokens in place, the scattered rest
gathered by slot into one batch, a few ops per projection whatever the mix. A loop over the step's
adapters (a gather, two small matmuls and a scatter each) cost 29% of the throughput at four
adapters.

No number crosses from one slot to another's tokens: an adapter whose weights hold a NaN (refused at
load, but a slot must not be able to hurt its neighbours however it got there) makes its own tokens'
logits NaN, and those requests end with an error, while every other token of the step, the base
model's included, gets the very numbers it would get were that adapter sound. The first version ran
every token through every slot's A and zeroed the other slots' columns with a 0/1 mask, and 0 * NaN
= NaN reached every token of the step.

A mixture of experts' stacked weights take adapters per request too (PEFT's `target_parameters`): each
experts module holds its slots' per-expert stacks and updates the rows routed to it (`expert_slots`).

Residency: `max_loras` slots hold adapters on the device, stacked per projection and padded to
`max_lora_rank` with zeros. An adapter a step needs and no slot holds takes the least recently used
slot that the step does not need, copied in from its CPU copy; the scheduler never runs more than
`max_loras` adapters at once, so a slot is always there. CPU copies (scaling folded into B, in the
model's dtype) are kept for the `max_cpu_loras` most recently used adapters and read again from the
adapter's folder when evicted.

An adapter is refused, naming it, when it does not fit: a rank above `max_lora_rank`, a tensor whose
shape is not the base projection's (an adapter of another base model), a module the base does not
have, a reward-model adapter, `modules_to_save` (full tensors, which only a merge can serve), or NaN
and infinities in its tensors or its scaling (what a diverged fine-tune saves).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedrl.engine.expert_slots import (
    ExpertPair,
    ExpertSlots,
    is_expert_key,
    read_expert_tensors,
    slot_experts,
)
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.lora_step import BASE, Grouped, StepSlots
from pagedrl.model.adapter import ADAPTER_CONFIG, is_adapter_folder, read_adapter_config, read_adapter_weights
from pagedrl.model.checkpoint import CheckpointError
from pagedrl.model.expert_lora import ExpertLoRA
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.lora import LoRALinear
from pagedrl.model.projections import LAYER_PROJECTIONS

if TYPE_CHECKING:
    from pagedrl.engine.sequence import Sequence

SCRATCH_MIN_NUMEL = 1 << 19  # updates this large go into buffers kept across steps (`LoRASlots.scratch`)


class SlotLinear(nn.Module):
    """A base projection plus the adapters resident in the slots.

    The base is the module it replaces, kept whole as `base` and computing its own product: the
    decoder's `Linear` through the step's routes (the engine's kernels), or a `GGUFLinear` whose weight
    stays quantized (GGUF blocks, int8 / int4 made at load) on the block kernels. So a token without an
    adapter gets the very numbers it gets from an engine built without `enable_lora`, and an adapter on
    a quantized base adds its update (x Aᵀ (s·B)ᵀ, in float) to the quantized product, never to a
    dequantized copy of the weight."""

    def __init__(self, base: nn.Module, slots: LoRASlots) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.slots = slots
        kw = {"dtype": slots.dtype, "device": slots.device}
        # Every slot's A stacked [slots * max rank, in], and its (s·B)ᵀ [slots * max rank, out]; rows past
        # an adapter's rank, and whole slots whose adapter leaves this projection alone, hold zeros.
        # Plain attributes, not buffers: not part of the state dict, nor of a checkpoint.
        self.lora_a = torch.zeros(slots.max_loras * slots.max_lora_rank, self.in_features, **kw)
        self.lora_bt = torch.zeros(slots.max_loras * slots.max_lora_rank, self.out_features, **kw)
        self.ranks = [0] * slots.max_loras  # 0: the slot's adapter leaves this projection alone
        self._span: tuple[int, int, torch.Tensor, torch.Tensor] | None = None  # see `stacks`

    def stacks(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Aᵀ [n, in, r] and (s·B)ᵀ [n, r, out] of slots lo to hi (exclusive): views, kept while the
        steps use the same slots (four view ops fewer per projection, a tenth of a decode's update)."""
        span = self._span
        if span is None or span[0] != lo or span[1] != hi:
            r, n = self.slots.max_lora_rank, hi - lo
            rows = slice(lo * r, hi * r)
            span = self._span = (lo, hi, self.lora_a[rows].view(n, r, self.in_features).transpose(1, 2),
                                 self.lora_bt[rows].view(n, r, self.out_features))
        return span[2], span[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.slots.step
        if step is None or not any(self.ranks[step.lo:step.hi]):
            return out
        # Each token through its own slot's A and B only (`lora_step`): runs in place, the rest grouped.
        flat_x, flat = x.reshape(-1, self.in_features), out.view(-1, self.out_features)
        r = self.slots.max_lora_rank
        for start, end, slot in step.runs:
            if self.ranks[slot]:  # its own rank's rows only (the rest of the slot is zeros)
                rows = slice(slot * r, slot * r + self.ranks[slot])
                down = torch.mm(flat_x[start:end], self.lora_a[rows].t())
                flat[start:end].addmm_(down, self.lora_bt[rows])
        if step.grouped is not None:
            self.add_grouped(flat_x, flat, step.grouped)
        return out

    def add_grouped(self, flat_x: torch.Tensor, flat: torch.Tensor, g: Grouped) -> None:
        """The grouped tokens' updates: gathered into entries, two batched matmuls, each row added back."""
        in_features, out_features, width, rows = self.in_features, self.out_features, g.width, len(g.gather)
        a, bt = self.stacks(g.lo, g.hi)
        if g.entry_slot is not None:
            a, bt = a.index_select(0, g.entry_slot), bt.index_select(0, g.entry_slot)
        if rows * max(in_features, out_features) < SCRATCH_MIN_NUMEL:
            grouped = flat_x.index_select(0, g.gather).view(-1, width, in_features)  # [entries, width, in]
            own = torch.bmm(torch.bmm(grouped, a), bt).view(-1, out_features).index_select(0, g.back)
        else:  # a large one: into buffers kept across steps (`LoRASlots.scratch`)
            scratch = self.slots.scratch
            grouped = torch.index_select(flat_x, 0, g.gather, out=scratch(0, (rows, in_features), flat_x))
            down = torch.bmm(grouped.view(-1, width, in_features), a)
            update = torch.bmm(down, bt, out=scratch(1, (rows // width, width, out_features), flat_x))
            own = torch.index_select(update.view(-1, out_features), 0, g.back,
                                     out=scratch(2, (len(g.back), out_features), flat_x))
        if g.tokens is None:
            flat.add_(own)
        else:
            flat.index_add_(0, g.tokens, own)

    def extra_repr(self) -> str:
        return f"slots={len(self.ranks)}"


class AdapterNotFound(ValueError):
    """The adapter's path names no adapter folder (a server answers 404, not 400)."""


@dataclass
class AdapterWeights:
    """One adapter ready for a slot: per projection name, A [r, in] and (s·B)ᵀ [r, out]; per experts
    module and weight, every expert's Aᵀ and (s·B)ᵀ."""

    request: LoRARequest
    rank: int
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    experts: dict[str, dict[str, ExpertPair]] = field(default_factory=dict)


def read_lora(request: LoRARequest, projections: dict[str, nn.Module], max_lora_rank: int,
              dtype: torch.dtype, experts: dict[str, ExpertSlots] | None = None) -> AdapterWeights:
    """Read and check `request`'s adapter against the base projections (name → module with
    in_features/out_features) and experts modules (`engine/expert_slots.py`). Every refusal is a ValueError naming the adapter and what does not fit."""
    from pagedrl.model.resolve import resolve_model_path

    name = request.lora_name
    try:
        path = resolve_model_path(request.lora_path)
    except (CheckpointError, OSError) as e:
        raise AdapterNotFound(f"LoRA adapter {name!r}: {e}") from None
    if not is_adapter_folder(path):
        raise AdapterNotFound(f"LoRA adapter {name!r}: {path} holds no {ADAPTER_CONFIG}; not a PEFT adapter folder")
    try:
        config = read_adapter_config(path)
        state = read_adapter_weights(path)
    except (CheckpointError, OSError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {e}") from None
    where = f"LoRA adapter {name!r} ({path})"
    if config.task_type != "CAUSAL_LM":
        raise ValueError(f"{where}: task_type {config.task_type}; only CAUSAL_LM adapters generate")
    if config.modules_to_save:
        raise ValueError(f"{where}: modules_to_save {config.modules_to_save} are full tensors, which cannot be "
                         "switched per request; serve it merged (pagedrl serve --adapter, or pagedrl merge)")
    if config.r > max_lora_rank:
        raise ValueError(f"{where}: rank {config.r} exceeds max_lora_rank {max_lora_rank}; raise max_lora_rank "
                         "(--max-lora-rank) to serve it")
    found = read_expert_tensors(where, config, state, experts or {}, dtype)
    expert_tensors: dict[str, dict[str, ExpertPair]] = {}
    for module, weights in found.items():
        for weight, (a, b, pair) in weights.items():
            check_finite(where, f"{module}.{weight}", a, b, pair, config.scaling, dtype)
            expert_tensors.setdefault(module, {})[weight] = pair
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        module, sep, part = key.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise ValueError(f"{where}: tensor {key!r} is not a lora_A or lora_B weight")
        if module not in projections and module.endswith(LATENT_UP):
            raise ValueError(f"{where}: tensor {key!r} adapts {module!r}: adapters per request on latent attention's "
                             "kv_b_proj are not supported (it up-projects cached latents, not the step's rows); merge "
                             "this adapter into the weights, or train one without kv_b_proj")
        if module not in projections and is_expert_key(key):
            raise ValueError(f"{where}: tensor {key!r} adapts experts whose weights this base model does not hold "
                             "as stacked float tensors (experts kept quantized: GGUF, MXFP4?), or has none there; merge this "
                             "adapter into the weights")
        if module not in projections:
            raise ValueError(f"{where}: tensor {key!r} adapts {module!r}, which the base model does not have "
                             "(an adapter of another base model?)")
        halves.setdefault(module, {})[part[0]] = tensor
    tensors = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {module!r} has lora_{next(iter(pair))} but not its other half")
        base = projections[module]
        a, b = pair["A"], pair["B"]
        want_a, want_b = (config.r, base.in_features), (base.out_features, config.r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"{where}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; this base "
                             f"model needs {want_a} and {want_b} at rank {config.r} (an adapter of another base model?)")
        bt = (b.double() * config.scaling).t()  # s·B folded once, rounded once into the model's dtype
        pair = (a.to(dtype).contiguous(), bt.to(dtype).contiguous())
        check_finite(where, module, a, b, pair, config.scaling, dtype)
        tensors[module] = pair
    if not tensors and not expert_tensors:
        raise ValueError(f"{where}: holds no lora_A/lora_B tensors")
    return AdapterWeights(request, config.r, tensors, expert_tensors)


def check_finite(where: str, module: str, a: torch.Tensor, b: torch.Tensor,
                 folded: tuple[torch.Tensor, torch.Tensor], scaling: float, dtype: torch.dtype) -> None:
    """Refuse NaN and infinities: a diverged fine-tune saves them, and one would make this adapter's
    every answer garbage (the step's arithmetic keeps them from other requests, see `SlotLinear`)."""
    for half, tensor in (("lora_A", a), ("lora_B", b)):
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            raise ValueError(f"{where}: {module!r} {half} holds {bad} NaN or infinite values of {tensor.numel()} "
                             "(saved by a fine-tune that diverged?)")
    if not all(bool(torch.isfinite(t).all()) for t in folded):
        raise ValueError(f"{where}: {module!r} overflows {dtype} once lora_B is scaled by lora_alpha / r = "
                         f"{scaling:g}")


LATENT_UP = ".kv_b_proj"  # latent attention's up-projection (DeepSeek-V3): no adapters per request


class LoRASlots:
    """The engine's adapters: the slots on the device, the CPU copies, and the running step's grouping."""

    def __init__(self, model: nn.Module, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None) -> None:
        # The limits are checked with the rest of the engine's settings (EngineConfig.validate).
        if any(isinstance(m, (LoRALinear, ExpertLoRA)) for m in model.modules()):
            raise ValueError("enable_lora: the model already carries a trained adapter; merge it first or serve "
                             "it on its own")
        # Latent attention's kv_b_proj multiplies the cached latents (or is folded into the queries), not
        # the step's rows: a per-token update has nowhere to go. Its other projections take adapters.
        latent = getattr(getattr(model, "config", None), "deepseek", None) is not None
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.layers: dict[str, SlotLinear] = {}
        for name, module in list(model.named_modules()):
            if name.rpartition(".")[2] not in LAYER_PROJECTIONS or (latent and name.endswith(LATENT_UP)):
                continue
            if not isinstance(module, (nn.Linear, GGUFLinear)):
                raise ValueError(f"enable_lora: {name} is a {type(module).__name__}; adapters per request are built on "
                                 "float projections and on GGUF / int8 / int4 ones kept quantized only")
            parent, _, child = name.rpartition(".")
            layer = SlotLinear(module, self)
            setattr(model.get_submodule(parent), child, layer)
            self.layers[name] = layer
        self.experts = slot_experts(model, self)  # a mixture of experts' stacked weights (made at first use)
        self.resident: list[int | None] = [None] * max_loras  # lora_int_id per slot
        self.last_used = [0] * max_loras  # step counter at the slot's last use (LRU)
        self.cpu: OrderedDict[int, AdapterWeights] = OrderedDict()  # most recently used last
        self.known: dict[int, LoRARequest] = {}
        self.step: StepSlots | None = None  # the running step's, see `begin_step`
        self._scratch: list[torch.Tensor | None] = [None, None, None]  # see `scratch`
        self.num_steps = 0
        self.num_slot_loads = 0

    def scratch(self, i: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """Buffer `i` (0 to 2) of `shape`, kept across projections and steps on a CPU: a fresh tensor of a
        prefill's update is mapped anew by the C allocator at every projection, and its page faults cost
        five times the products (3.0 against 0.5 ms at 1024 tokens x 1536 in bf16; at 512 tokens, none).
        It grows to the largest update a step has had; smaller ones than SCRATCH_MIN_NUMEL are fresh.
        None (a fresh tensor) off the CPU, where the caching allocator keeps them."""
        if like.device.type != "cpu":
            return None
        numel = math.prod(shape)
        buf = self._scratch[i]
        if (buf is None or buf.numel() < numel or buf.dtype != like.dtype
                or buf.is_inference() != torch.is_inference_mode_enabled()):
            self._scratch[i] = None
            buf = self._scratch[i] = torch.empty(numel, dtype=like.dtype)
        return buf[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        """Device memory the slots hold (logged at start-up: it grows with max_loras * max_lora_rank)."""
        return (sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.lora_a, layer.lora_bt))
                + sum(experts.nbytes for experts in self.experts.values()))

    def read(self, request: LoRARequest) -> AdapterWeights:
        """The adapter read from disk and checked; changes nothing (safe off the engine thread)."""
        return read_lora(request, self.layers, self.max_lora_rank, self.dtype, self.experts)

    def prepare(self, request: LoRARequest) -> AdapterWeights:
        """The adapter's CPU copy, read if it is not kept; the least recently used copies go."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        seen = self.known.get(request.lora_int_id)
        if seen is not None and (seen.lora_path, seen.lora_name) != (request.lora_path, request.lora_name):
            raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} already names adapter {seen.lora_name!r} "
                             f"({seen.lora_path}); give {request.lora_name!r} an id of its own")
        weights = self.cpu.get(request.lora_int_id)
        if weights is None:
            weights = self.read(request)
            self.cpu[request.lora_int_id] = weights
            self.known[request.lora_int_id] = request
            while len(self.cpu) > self.max_cpu_loras:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(request.lora_int_id)
        return weights

    def activate(self, requests: Seq[LoRARequest]) -> dict[int, int]:
        """Make every adapter of `requests` resident; its slot by lora_int_id."""
        self.num_steps += 1
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters; only max_loras={self.max_loras} fit")
        slots = {}
        for lora_id in wanted:
            if lora_id in self.resident:
                slots[lora_id] = self.resident.index(lora_id)
        for lora_id, request in wanted.items():
            if lora_id not in slots:
                free = [s for s in range(self.max_loras) if s not in slots.values()]
                slot = min(free, key=lambda s: (self.resident[s] is not None, self.last_used[s]))
                self.load(slot, self.prepare(request))
                slots[lora_id] = slot
        for slot in slots.values():
            self.last_used[slot] = self.num_steps
        return slots

    @torch.no_grad()
    def load(self, slot: int, weights: AdapterWeights) -> None:
        """Copy an adapter into a slot (in place: the stacks are never reallocated)."""
        r, rows = weights.rank, slice(slot * self.max_lora_rank, (slot + 1) * self.max_lora_rank)
        for name, layer in self.layers.items():
            pair = weights.tensors.get(name)
            layer.lora_a[rows].zero_()
            layer.lora_bt[rows].zero_()
            layer.ranks[slot] = 0 if pair is None else r
            if pair is not None:
                layer.lora_a[rows][:r].copy_(pair[0])
                layer.lora_bt[rows][:r].copy_(pair[1])
        for name, experts in self.experts.items():
            experts.load(slot, weights.experts.get(name, {}), r)
        self.resident[slot] = weights.request.lora_int_id
        self.num_slot_loads += 1

    def begin_step(self, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
        """Make the step's adapters resident and group its tokens by slot (`StepSlots`); None when no
        sequence runs with an adapter."""
        self.step = None
        if all(seq.lora is None for seq in seqs):
            return
        slots = self.activate([seq.lora for seq in seqs if seq.lora is not None])
        seq_slot = torch.tensor([BASE if seq.lora is None else slots[seq.lora.lora_int_id] for seq in seqs])
        self.step = StepSlots.plan(seq_slot.repeat_interleave(torch.tensor(num_new_tokens)), self.device)

    def end_step(self) -> None:
        self.step = None

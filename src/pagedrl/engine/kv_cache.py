"""The KV cache tensors: every layer's keys and values in fixed-size blocks, allocated once.

A sequence never owns contiguous memory; it owns a block table (a list of block ids) and its token
at position p lives in block `table[p // block_size]` at offset `p % block_size`. That indirection
is what lets sequences share prefix blocks and lets memory be handed out and taken back one block
at a time. Which block belongs to whom is the block pool's business, not this file's: here are only
the tensors, their size, and the copy that copy-on-write needs.

A model with multi-head latent attention (DeepSeek-V3, `model/mla.py`) caches one latent per token
and layer instead of keys and values: a cache of one "head" as wide as the latent, with no value
tensor (`values=False`; `value_cache` is then `key_cache`), in the same blocks and block tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


class KVCache:
    """Per layer a key and a value tensor of shape [num_blocks, block_size, num_kv_heads, head_dim]
    (without `values`, one tensor: a latent attention's latents).

    All of them are views into one allocation ([layers, 2 or 1, blocks, block_size, heads, dim]) so a
    block can be copied in every layer with a single indexing op. Memory starts zeroed: padded
    block-table entries and not-yet-written slots are read (then masked) by the attention ops, and
    masking cannot undo a NaN left by uninitialised memory.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        values: bool = True,
        layer_slots: Sequence[int] | None = None,
    ) -> None:
        """`layer_slots`: the tensor each model layer reads and writes, where layers in groups share
        `num_layers` tensors (`kv_cache_groups`); None: a tensor a layer."""
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            _require_positive_int(name, value)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.values = values
        self.layer_slots = tuple(range(num_layers)) if layer_slots is None else tuple(layer_slots)
        if not all(0 <= slot < num_layers for slot in self.layer_slots):
            raise ValueError(f"layer_slots must name tensors in [0, {num_layers}), got {list(self.layer_slots)}")
        self.data = torch.zeros(num_layers, self.tensors, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        self._views()
        self._scratch: torch.Tensor | None = None

    @classmethod
    def for_model(
        cls,
        config: Any,
        *,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        memory_fraction: float | None = None,
    ) -> KVCache:
        """A cache shaped for a `ModelConfig`, sized by exactly one budget (see `num_blocks_for`)."""
        heads, head_dim, values = config.kv_cache_layout
        shape = dict(num_layers=config.num_hidden_layers, block_size=block_size, num_kv_heads=heads, head_dim=head_dim)
        num_blocks = cls.num_blocks_for(**shape, dtype=dtype, device=device, max_tokens=max_tokens,
                                        max_bytes=max_bytes, memory_fraction=memory_fraction, values=values)
        return cls(**shape, num_blocks=num_blocks, dtype=dtype, device=device, values=values)

    @property
    def tensors(self) -> int:
        """Tensors a layer caches: keys and values, or a latent attention's latents alone."""
        return 2 if self.values else 1

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds when allocated (whether or not it is released right now)."""
        return self.bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                                    self.dtype, self.values) * self.num_blocks

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, values: bool = True) -> int:
        """Keys and values (or latents) of one block in every layer: the unit the budget is divided by."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (2 if values else 1) * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @classmethod
    def num_blocks_for(
        cls,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        *,
        device: torch.device | str = "cpu",
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        memory_fraction: float | None = None,
        values: bool = True,
    ) -> int:
        """How many blocks a budget buys. Give exactly one of: `max_tokens` (rounded up to whole
        blocks), `max_bytes` (rounded down), or `memory_fraction` of the CUDA device's currently
        free memory (what is left after the weights are loaded, so call it then)."""
        given = [name for name, v in (("max_tokens", max_tokens), ("max_bytes", max_bytes),
                                      ("memory_fraction", memory_fraction)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of max_tokens, max_bytes, memory_fraction; got {given or 'none'}")
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype, values)
        if max_tokens is not None:
            _require_positive_int("max_tokens", max_tokens)
            return math.ceil(max_tokens / block_size)
        if max_bytes is not None:
            _require_positive_int("max_bytes", max_bytes)
            budget = max_bytes
        else:
            assert memory_fraction is not None
            if not 0.0 < memory_fraction <= 1.0:
                raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
            dev = torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"memory_fraction needs a CUDA device, got device={dev}; "
                                 "give max_tokens or max_bytes instead")
            free, _total = torch.cuda.mem_get_info(dev)
            budget = int(free * memory_fraction)
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"a budget of {budget} bytes is less than one block ({per_block} bytes)")
        return blocks

    def scratch(self, numel: int) -> torch.Tensor:
        """A flat buffer of at least `numel` elements, kept and reused by every layer of every step
        (it only grows). Attention gathers each sequence's blocks into it: on a CPU, allocating those
        megabytes afresh in every layer costs more in page faults than the attention itself. Valid
        until the next call; nothing returned to a caller may alias it. One made under inference mode
        cannot be written outside it, so it is replaced then."""
        stale = self._scratch is not None and self._scratch.is_inference() and not torch.is_inference_mode_enabled()
        if self._scratch is None or self._scratch.numel() < numel or stale:
            self._scratch = None
            self._scratch = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self._scratch[:numel]

    @property
    def allocated(self) -> bool:
        return self.data.numel() > 0

    def release(self) -> None:
        """Give the memory back (training runs between rollouts); `allocate` brings it back zeroed."""
        self.data = self.data.new_empty(0)
        self.key_cache, self.value_cache, self._scratch = [], [], None

    def allocate(self) -> None:
        if self.allocated:
            return
        self.data = torch.zeros(self.num_layers, self.tensors, self.num_blocks, self.block_size, self.num_kv_heads,
                                self.head_dim, dtype=self.dtype, device=self.data.device)
        self._views()

    def _views(self) -> None:
        """Each model layer's key and value tensors: views of its slot in `data`."""
        self.key_cache = [self.data[slot, 0] for slot in self.layer_slots]
        self.value_cache = [self.data[slot, self.tensors - 1] for slot in self.layer_slots]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block `src` onto block `dst` in every layer, keys and values (copy-on-write of a
        shared partial block). All sources are read before any destination is written."""
        if not pairs:
            return
        for pair in pairs:
            if len(pair) != 2 or not all(isinstance(b, int) and 0 <= b < self.num_blocks for b in pair):
                raise ValueError(f"pairs: each entry must be (src, dst) block ids in [0, {self.num_blocks}), "
                                 f"got {pair!r}")
        dst = [d for _, d in pairs]
        if len(set(dst)) != len(dst):
            raise ValueError(f"pairs: a destination block appears twice in {pairs!r}")
        src_idx = torch.tensor([s for s, _ in pairs], device=self.device)
        dst_idx = torch.tensor(dst, device=self.device)
        self.data[:, :, dst_idx] = self.data[:, :, src_idx]

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, blocks={self.num_blocks}, block_size={self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{'' if self.values else ', latent'}, "
                f"dtype={self.dtype}, "
                f"device={self.device}, {self.nbytes / 2**20:.1f} MiB)")


# With no budget given on a CPU, the cache takes 4 GiB, vLLM's CPU default: a continuous batch needs
# room for many sequences at once, or it preempts and recomputes (bench/RESULTS.md, "Engine", has the
# cost of a smaller default). The token cap keeps a tiny model's pool small.
DEFAULT_CPU_TOKENS = 1 << 17
DEFAULT_CPU_BYTES = 4 << 30


def num_blocks_for_budget(
    config: Any,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    tokens: int | None = None,
    nbytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
) -> int:
    """The engine's sizing rule for a `ModelConfig`: an explicit budget in `tokens` or `nbytes`
    (not both) wins; otherwise on CUDA `gpu_memory_utilization` of the free memory, and on a CPU
    DEFAULT_CPU_BYTES capped at DEFAULT_CPU_TOKENS tokens (a fixed size, as vLLM's CPU backend takes,
    rather than a fraction of host RAM, which a CPU could not fill at its speed)."""
    if tokens is not None and nbytes is not None:
        raise ValueError(f"give at most one of tokens ({tokens}) and nbytes ({nbytes})")
    heads, head_dim, values = config.kv_cache_layout
    shape = dict(num_layers=config.num_hidden_layers, block_size=block_size, num_kv_heads=heads, head_dim=head_dim,
                 dtype=dtype, device=device, values=values)
    if tokens is not None or nbytes is not None:
        return KVCache.num_blocks_for(**shape, max_tokens=tokens, max_bytes=nbytes)
    if torch.device(device).type == "cuda":
        return KVCache.num_blocks_for(**shape, memory_fraction=gpu_memory_utilization)
    by_tokens = KVCache.num_blocks_for(**shape, max_tokens=DEFAULT_CPU_TOKENS)
    per_block = KVCache.bytes_per_block(config.num_hidden_layers, block_size, heads, head_dim, dtype, values)
    return max(1, min(by_tokens, DEFAULT_CPU_BYTES // per_block))


def _require_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

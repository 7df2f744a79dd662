"""A decode step on a CPU as one straight run of the engine's kernels: the decoder's forward for steps
where every sequence feeds one token, written out as the calls it makes. bf16 on the k-pairs
kernels; float32 on the float32 kernel (`csrc/float_linear.cpp`, the weights as they lie) and the
row-wise kernels' float32 forms, the very calls a float32 step's routes make (`cpu_routes.FLOAT_ROUTES`).

Why: at one sequence a decode step is short enough that Python around the kernels counts. The
default model's one-row forward took 12.9 ms through the decoder's modules (module calls, the routes'
checks, packed-copy lookups, views: some 25 Python-level calls a layer around its 8 kernels) and
9.2 ms as this program: the same kernels in the same order on the same copies of the weights, so
the same bits (tested against the modules for every family). Whole steps, `bench/bench_decode_program.py`:
1.33x / 1.17x / 1.12x faster at 1 / 16 / 64 sequences.

It is what a compiled forward would be here, and `torch.compile` (inductor) of this very program was
measured (bench/RESULTS.md): with each layer's cache a tensor of its own it ran no faster than as
written (8.6-8.8 ms against 7.5-9.2, after 15 s of compiling on 2 cores); with the layers' caches as
views of one buffer, as the engine keeps them, every call copied the whole KV cache around the cache
writes (7.3 s a step, after 29 s of compiling). So the program runs as written and compiles nothing.

A step's layers then go to the kernels in one call (`ops.decode_layers`, `csrc/decode_layers.cpp`):
the same ops in the same order, each looked up once in C++, where from Python each of a layer's 16 calls
cost 2-6 us of boxing and dispatch. A single stream's step, one thread, capped to AVX2: 10.2 -> 9.2 ms
on Q8_0 weights and 8-bit activations, 7.8 -> 6.4 on Q4_1, 26.9 -> 24.8 in float32 (13.4 -> 12.4 in
bf16 on AVX512-BF16); 1.00-1.04x at 16 sequences (`bench/bench_decode_program.py --sides loop,program`).
The loop stays for steps whose GGUF products on float32 activations exceed those kernels' rows.

It covers what the decoder's routes cover on the k-pairs kernels (`products.pairs_available`) or
the float32 kernel: a plain `CausalLM` whose projections are all the decoder's own `Linear` (an
adapter's layer is not), with or without biases and q/k norms. `enforce_eager=True` runs every step
through the modules.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.nn.functional as F

from pagedrl.engine.attention import PagedAttention
from pagedrl.kernels import ops, products
from pagedrl.model.decoder import CausalLM
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.moe import has_sparse_layers
from pagedrl.model.rope import rope_cos_sin
from pagedrl.model.routed import Linear


def supports(model: torch.nn.Module) -> bool:
    """Whether `model`'s decode steps can run as the program: a bf16 or float32 dense `CausalLM` on the
    CPU whose projections are all plain `Linear` (LoRA layers keep their own forward; a mixture of
    experts' sparse layers, `model/moe.py`, theirs; Phi-3's fused projections, `model/fused.py`,
    theirs; Gemma's and gpt-oss's layer rules, whatever their activation, theirs); for bf16, on a CPU
    where the k-pairs kernels run, with input sizes those kernels take (even)."""
    if type(model) is not CausalLM or model.device.type != "cpu" or not ops.available():
        return False
    cfg = model.config
    if has_sparse_layers(model):  # rows routed to experts: the modules run them
        return False
    if cfg.fused_projections:  # Phi-3's qkv_proj and gate_up_proj (`model/fused.py`): the modules run them
        return False
    if cfg.deepseek is not None:  # latent attention (`model/mla.py`): the modules run it
        return False
    if cfg.gemma is not None or cfg.gpt_oss is not None:  # layer rules the program's layers leave out (Gemma's
        return False  # sandwich norms and soft caps, gpt-oss's sinks, per-layer windows): the modules keep them
    projections = [model.lm_head]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    quantized = model.dtype == torch.float32 and all(type(m) in (Linear, GGUFLinear) for m in projections)
    if cfg.hidden_act != "silu" or not (quantized or all(type(m) is Linear for m in projections)):
        return False
    if model.dtype == torch.float32:
        return True
    return (model.dtype == torch.bfloat16 and products.pairs_available()
            and cfg.hidden_size % 2 == 0 and (cfg.num_attention_heads * cfg.head_dim) % 2 == 0
            and cfg.intermediate_size % 2 == 0)


@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF (or int8 / int4) weight kept quantized, as the program's product reads it: its blocks and
    their type listed once, not looked up on the module at every call."""

    blocks: torch.Tensor
    ggml_type: int
    k: int
    bias: torch.Tensor | None
    product: Callable[..., torch.Tensor]  # `ops.gguf_linear`'s op itself (`gguf_linear_int8`'s: int8 activations)
    max_rows: int  # the most rows `product` takes; above, `route` (int8 activations: any number)
    route: Callable[..., torch.Tensor | None]  # `products.quantized_rows` (`int8_rows`)


def float_product(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, n: int, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """A float32 step's projection as its route computes it (`products.float_rows`): the engine's float32
    kernels by row count (`products.float_kernel`), torch's (MKL) above; a weight kept quantized as its
    module's route computes it (`products.quantized_rows`; a decode step's few rows, contiguous as the program makes
    them, straight to the kernel: a single stream's 210 products a token, each five Python calls
    shorter). `n`, the output features, is the k-pairs product's argument, unused: the program calls
    both alike."""
    if type(weight) is QuantizedWeight:
        if x.shape[0] <= weight.max_rows:
            return weight.product(x, weight.blocks, weight.ggml_type, weight.k, weight.bias)
        return weight.route(x, weight.blocks, weight.ggml_type, weight.k, weight.bias)
    out = products.float_kernel(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out



class Kind(IntEnum):
    """How `ops.decode_layers` computes a projection (`csrc/decode_layers.cpp`): as the program's loop
    does (`float_product`, or `ops.pair_linear` on a bf16 weight's k-pairs copy)."""

    FLOAT_LINEAR = 0  # a float32 weight, up to products.MAX_ROWS_FLOAT rows
    FLOAT_GEMM = 1  # up to products.MAX_ROWS_GEMM
    TORCH_LINEAR = 2  # above (MKL's)
    INT8 = 3  # a GGUF weight on 8-bit activations
    GGUF = 4  # a GGUF weight on float32 activations, up to its `max_rows`
    PAIRS = 5  # a bf16 weight's k-pairs copy (`ops.pair_linear`)
    GATE_UP = 6  # a bf16 layer's gate and up in one pass (`ops.pair_silu_mul`), on both entries


@dataclass
class FlatLayers:
    """The program's layers as `ops.decode_layers` takes them: flat lists, made once per weight version.
    `kinds` is per step: a float32 weight's product follows the step's row count."""

    norms: list[torch.Tensor]
    qk_norms: list[torch.Tensor | None]
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    types: list[int]
    fixed: list[Kind | None]  # a projection's kind at every row count; None: a float32 weight's (by rows)
    max_rows: int  # the most rows every GGUF weight on float32 activations takes in one product
    by_dense: dict[Kind, list[int]] = field(default_factory=dict)  # `kinds`' lists, made once each

    def kinds(self, rows: int) -> list[int] | None:
        """The projections' kinds for a step of `rows` rows; None where one is not a single kernel call
        (a GGUF product above its `max_rows`: the program's route runs it). One of three lists, by the
        float32 kernel the row count picks, each made on first use rather than at every step."""
        if rows > self.max_rows:
            return None
        dense = (Kind.FLOAT_LINEAR if rows <= products.MAX_ROWS_FLOAT
                 else Kind.FLOAT_GEMM if rows <= products.MAX_ROWS_GEMM else Kind.TORCH_LINEAR)
        if dense not in self.by_dense:
            self.by_dense[dense] = [int(dense if kind is None else kind) for kind in self.fixed]
        return self.by_dense[dense]


def flat_layers(model: CausalLM, layers: list[tuple], bf16: bool) -> FlatLayers:
    """`DecodeProgram._layers` as `FlatLayers` (`bf16`: the weights are k-pairs copies)."""
    norms, qk, weights, biases, types, fixed, max_rows = [], [], [], [], [], [], sys.maxsize
    for norm1, q_proj, k_proj, v_proj, o_proj, qk_norms, norm2, mlp, down, _ in layers:
        norms += [norm1, norm2]
        qk += list(qk_norms) if qk_norms is not None else [None, None]
        fused = len(mlp) == 1  # gate and up interleaved in one copy: on both entries
        gate_up = [(mlp[0], 0, None)] * 2 if fused else list(mlp)
        for at, (weight, n, bias) in enumerate((q_proj, k_proj, v_proj, o_proj, *gate_up, down)):
            if type(weight) is QuantizedWeight:
                int8 = weight.max_rows == sys.maxsize
                weights.append(weight.blocks)
                biases.append(weight.bias)
                types.append(weight.ggml_type)
                fixed.append(Kind.INT8 if int8 else Kind.GGUF)
                max_rows = max_rows if int8 else min(max_rows, weight.max_rows)
            else:
                weights.append(weight)
                biases.append(bias)
                types.append(n if bf16 else 0)
                fixed.append(Kind.GATE_UP if fused and at in (4, 5) else Kind.PAIRS if bf16 else None)
    norms.append(model.model.norm.weight)
    return FlatLayers(norms, qk, weights, biases, types, fixed, max_rows)


def shared_input(*modules: torch.nn.Module) -> tuple | None:
    """`ops.gguf_linear_int8_many`'s arguments after the input for projections of one input (a layer's q,
    k and v; its gate and up) that all run on 8-bit activations; None where any does not. One call
    instead of three quantizes the input once and reads the weights as one stream: a single stream's
    Q8_0 token, 90 calls fewer."""
    if not all(type(m) is GGUFLinear and m.int8_activations for m in modules):
        return None
    if len({m.in_features for m in modules}) != 1:
        return None
    return ([m.qweight for m in modules], [m.kernel_type for m in modules], modules[0].in_features,
            [m.bias for m in modules])


class DecodeProgram:
    """The decoder's forward for a step of one-token rows (`run`) and, for bf16, its vocabulary
    projection (`logits`) over `packed`'s k-pairs copies of the weights, listed once per weight
    version; a float32 model's (`packed` None) over its weights as they lie."""

    def __init__(self, model: CausalLM, packed: products.PackedWeights | None,
                 weight_version: Callable[[], int] = lambda: 0) -> None:
        self.model, self.packed, self.weight_version = model, packed, weight_version
        self.float32 = packed is None
        cfg = model.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        # The fused gate-and-up pass where the routes take it (`PackedWeights.gate_up`).
        self.fused_mlp = not self.float32 and not cfg.mlp_bias and cfg.intermediate_size % 32 == 0
        self._tracked: list[torch.Tensor] = []  # the weights whose write counters are checked
        self._fingerprint: tuple[int, ...] | None = None
        self._layers: list[tuple] = []
        self._flat: FlatLayers | None = None  # the layers in one kernel call (`ops.decode_layers`)
        self._head: tuple | None = None

    def _fingerprint_now(self) -> tuple[int, ...]:
        """What the listed copies depend on: the packed cache's generation (cleared at a weight-version
        bump), the engine's weight version (a float32 model's parameters may be replaced under it) and
        every weight's in-place write counter."""
        generation = -1 if self.packed is None else self.packed.generation
        return (generation, self.weight_version(), *(w._version for w in self._tracked))

    def _refresh(self) -> None:
        """The weights and their packed copies, one tuple a layer, listed again when they changed."""
        fingerprint = self._fingerprint_now()
        if fingerprint == self._fingerprint:
            return
        pack = self._pack
        # Listed anew with the copies: a parameter replaced (under a weight-version bump) is tracked in
        # its predecessor's place. Inference tensors keep no counter; the bump is their only signal.
        self._tracked = [w for w in self.model.parameters() if not w.is_inference()]
        layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = [self._projection(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
            if self.fused_mlp:
                mlp_weights = (pack(mlp.gate_proj.weight, "gate_up", mlp.up_proj.weight),)
            else:
                mlp_weights = tuple(self._projection(m) for m in (mlp.gate_proj, mlp.up_proj))
            down = self._projection(mlp.down_proj)
            qk_norms = None if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
            shared = (shared_input(attn.q_proj, attn.k_proj, attn.v_proj),
                      None if self.fused_mlp else shared_input(mlp.gate_proj, mlp.up_proj))
            layers.append((layer.input_layernorm.weight, *projections, qk_norms, layer.post_attention_layernorm.weight,
                           mlp_weights, down, shared))
        self._layers = layers
        self._flat = flat_layers(self.model, layers, bf16=not self.float32)
        self._head = self._projection(self.model.lm_head)
        self._fingerprint = self._fingerprint_now()  # packing may have moved the generation

    def _projection(self, module: torch.nn.Module) -> tuple:
        """(weight or its k-pairs copy, output features, bias): a projection's arguments to the product; a
        GGUF one's, the module itself (its product reads the blocks)."""
        if type(module) is GGUFLinear:
            int8 = module.int8_activations
            weight = QuantizedWeight(module.qweight, module.kernel_type, module.in_features, module.bias,
                                     ops.gguf_linear_int8_op() if int8 else ops.gguf_linear_op(),
                                     sys.maxsize if int8 else products.MAX_ROWS_QUANTIZED,
                                     products.int8_rows if int8 else products.quantized_rows)
            return weight, module.out_features, None
        return self._pack(module.weight, "pairs"), module.weight.shape[0], module.bias

    def _pack(self, weight: torch.Tensor, layout: str, *more: torch.Tensor) -> torch.Tensor:
        """`weight`'s copy in `layout` (bf16); a float32 model's products read the weight itself."""
        return weight if self.packed is None else self.packed.packed(weight, layout, *more)

    def run(self, input_ids: torch.Tensor, meta: PagedAttention) -> torch.Tensor:
        """input_ids [N] (sequence s's new token in row s) → final hidden states [N, hidden], keys and
        values written to the cache, for metadata that reads the cache in place (`meta.in_place`)."""
        self._refresh()
        return self.forward(input_ids, meta)

    def forward(self, input_ids: torch.Tensor, meta: PagedAttention) -> torch.Tensor:
        """`run` on the weights as last listed (what a compiler would trace). A float32 model's products
        are the calls `cpu_routes.FLOAT_ROUTES` makes through the modules, so the same numbers."""
        n, heads, kv_heads, head_dim, eps = input_ids.shape[0], self.heads, self.kv_heads, self.head_dim, self.eps
        product = float_product if self.float32 else ops.pair_linear
        backbone = self.model.model
        embed = backbone.embed_tokens
        x = F.embedding(input_ids, embed.weight) if type(embed) is torch.nn.Embedding else embed(input_ids)
        cos, sin = rope_cos_sin(meta.positions[None], backbone.inv_freq, x.dtype, backbone.longrope,
                                backbone.attention_factor)
        cache = meta.kv_cache
        scale = meta.scale if meta.scale is not None else 1.0 / math.sqrt(head_dim)
        kinds = self._flat.kinds(n) if self._flat is not None else None
        if kinds is not None:  # the loop below in one call
            flat = self._flat
            windows = [0] * len(self._layers) if meta.windows is None else [w or 0 for w in meta.windows]
            return ops.decode_layers(x, cos, sin, flat.norms, flat.qk_norms, flat.weights, flat.biases, kinds,
                                     flat.types, cache.key_cache, cache.value_cache, meta.slot_mapping,
                                     meta.block_tables, meta.seq_lens, scale, windows, heads, kv_heads, head_dim, eps)
        for index, (norm1, q_proj, k_proj, v_proj, o_proj, qk_norms, norm2, mlp, down, shared) in enumerate(
                self._layers):
            key_cache, value_cache = cache.key_cache[index], cache.value_cache[index]
            h = ops.rms_norm(x, norm1, eps)
            if shared[0] is not None:  # q, k and v on 8-bit activations: one call
                q, k, v = ops.gguf_linear_int8_many(h, *shared[0])
            else:
                q, k, v = product(h, *q_proj), product(h, *k_proj), product(h, *v_proj)
            q, k, v = q.view(1, n, heads, head_dim), k.view(1, n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
            if qk_norms is not None:
                q, k = ops.rms_norm(q, qk_norms[0], eps), ops.rms_norm(k, qk_norms[1], eps)
            q, k = ops.rope(q, k, cos, sin)
            ops.store_kv(k[0], v, key_cache, value_cache, meta.slot_mapping)
            window = meta.windows[index] if meta.windows is not None else None  # a uniform window
            out = ops.paged_decode(q[0], key_cache, value_cache, meta.block_tables, meta.seq_lens, scale, window)
            x = x + product(out.view(n, heads * head_dim), *o_proj)
            h = ops.rms_norm(x, norm2, eps)
            if len(mlp) == 1:
                hidden = ops.pair_silu_mul(h, mlp[0])
            elif shared[1] is not None:
                hidden = ops.silu_mul(*ops.gguf_linear_int8_many(h, *shared[1]))
            else:
                hidden = ops.silu_mul(product(h, *mlp[0]), product(h, *mlp[1]))
            x = x + product(hidden, *down)
        return ops.rms_norm(x, backbone.norm.weight, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → float32 logits [N, vocab], as `CausalLM.logits` computes them routed (bf16;
        a float32 model's are the runner's `project`)."""
        assert self._head is not None, "run() lists the weights first"
        return ops.pair_linear(hidden, *self._head).float()


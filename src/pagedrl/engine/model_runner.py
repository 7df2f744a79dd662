"""One forward pass of a scheduled batch through the paged path of the model.

The runner flattens every scheduled sequence's new tokens into one row, builds the paged attention
metadata once (which computes the tokens' positions, read by both the rotary embedding and the
cache writes), runs the model and projects to the vocabulary only the rows that are sampled (and the
prompt rows whose log-probs were asked for). A step that only decodes replays a CUDA graph instead on
CUDA (`cuda_graphs`), and runs as one straight program of the engine's kernels for a bf16 model on a
CPU (`cpu_decode`), unless `enforce_eager` or a LoRA adapter runs in it (`multi_lora`).

The forward runs in the precision it is given: with `autocast_dtype` under `torch.autocast`, as a
trainer's bf16 autocast runs the same module, so rollouts are sampled from the numbers training
computes (the KV cache is then kept in that dtype too). The projections then read bf16 copies of
their float32 weights, made once per weight change rather than cast anew at every step
(`cast_weights`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedrl.engine import cpu_decode
from pagedrl.engine.attention import PagedAttention, prefill_by_rows, resolve_impl, uniform_windows
from pagedrl.engine.cast_weights import CastWeights
from pagedrl.engine.cpu_routes import routed_step, usable
from pagedrl.engine.cuda_graphs import DecodeGraphs
from pagedrl.engine.host_tensors import long_tensor
from pagedrl.engine.kv_cache import KVCache
from pagedrl.engine.kv_cache_manager import KVCacheManager
from pagedrl.engine.multi_lora import LoRASlots
from pagedrl.engine.sequence import Sequence, wants_prompt_logprobs
from pagedrl.kernels import isa, products
from pagedrl.kernels.memory import keep_freed_memory
from pagedrl.kernels.products import float_rows, packed_weights, packs_weights
from pagedrl.kernels.threads import bind_threads
from pagedrl.model.decoder import CausalLM
from pagedrl.model.gemma import soft_cap
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.moe import has_sparse_layers


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [rows, vocab] float32, one row per entry of `rows`
    rows: list[tuple[Sequence, int]]  # (sequence, token position whose next-token logits the row holds)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, kv_manager: KVCacheManager, block_size: int,
                 attention_impl: str = "auto", *, enforce_eager: bool = False, autocast_dtype: torch.dtype | None = None,
                 max_num_seqs: int = 256, max_model_len: int | None = None, cast_weights: bool = True) -> None:
        self.cast: CastWeights | None = None
        if cast_weights and autocast_dtype is not None and model.dtype == torch.float32:
            self.cast = CastWeights(model, autocast_dtype)
            model = self.cast.twin  # type: ignore[assignment]
        self.model = model
        self.attention_impl = resolve_impl(attention_impl, model.device)
        self.autocast_dtype = autocast_dtype
        self.cpu_routes = usable(model, autocast_dtype)  # bf16 on a CPU: the engine's own kernels
        self.float_routes = usable(model, autocast_dtype, torch.float32)  # float32: its products of a few rows
        # Without AMX, decode-sized products on oneDNN's layout of the weights, made once a version: for
        # a bf16 model the engine owns, and for the bf16 twin of a trainer's steps that need not be
        # batch-invariant (greedy evaluations; its rollouts get them through `batch_invariant`).
        self.twin_products = self.cast is not None and autocast_dtype == torch.bfloat16
        self.packed = packed_weights() if (self.cpu_routes or self.twin_products) and packs_weights() else None
        # Decode steps on a CPU as one straight run of the kernels, outside the modules (`cpu_decode`): bf16
        # ones on the k-pairs copies, float32 ones on the float32 kernel and the row-wise kernels' float32 forms.
        program = (self.cpu_routes and self.packed is not None) or self.float_routes
        self.program = (cpu_decode.DecodeProgram(model, self.packed if self.cpu_routes else None,
                                                 lambda: kv_manager.weight_version)
                        if program and not enforce_eager and cpu_decode.supports(model) else None)
        self.windows = uniform_windows(model)  # every layer's window, where all share one (else None)
        self.on_cpu = model.device.type == "cpu"
        if self.on_cpu:
            keep_freed_memory()
        self.kv_cache = kv_cache
        self.kv_manager = kv_manager
        self.block_size = block_size
        # Prompt chunks through the row kernel where it is the faster prefill; not for a trainer's
        # rollouts, whose attention must be the kernel its recompute runs.
        self.prefill_rows = autocast_dtype is None and kv_cache is not None and prefill_by_rows(kv_cache, model.device)
        self._logits: torch.Tensor | None = None  # see `project`
        self.lora: LoRASlots | None = None  # set by the engine when it serves adapters per request
        self.graphs: DecodeGraphs | None = None  # decode steps from CUDA graphs: on CUDA with the kernels
        if (not enforce_eager and model.device.type == "cuda" and self.attention_impl == "triton"
                and not has_sparse_layers(model) and model.config.gemma is None
                and getattr(model.config, "deepseek", None) is None):
            # (Gemma's per-layer rules are attached in its forward, not yet recorded in graphs; DeepSeek's
            # latent attention reads the host. A uniform window goes in the graphs' metadata.)
            self.graphs = DecodeGraphs(model, kv_cache, block_size, max_num_seqs,
                                       max_model_len or model.config.max_model_len, self.precision)

    def decode_path(self) -> str:
        """How steps that only decode run, for the start-up line."""
        if self.graphs is not None:
            return f"decode steps replay CUDA graphs ({len(self.graphs.sizes)} batch sizes)"
        if self.program is not None and self.program.float32:
            return (f"decode steps as one program of the CPU kernels, its layers in one call, "
                    f"{products.describe_float()} (CPU class {isa.describe()}; enforce_eager: through the modules)")
        if self.program is not None:
            return (f"decode steps as one program of the CPU kernels on CPU class {isa.describe()} "
                    "(enforce_eager: through the modules)")
        modules = "decode steps through the model's modules"
        if has_sparse_layers(self.model):
            modules += " (a mixture of experts: its sparse layers run as modules, no decode program or CUDA graphs)"
        elif getattr(getattr(self.model, "config", None), "deepseek", None) is not None:
            modules += " (latent attention: no decode program)"
        elif getattr(getattr(self.model, "config", None), "fused_projections", False):
            modules += " (fused qkv_proj and gate_up_proj: no decode program)"
        if self.float_routes:
            return f"{modules}, {products.describe_float()} (CPU class {isa.describe()})"
        if self.on_cpu:
            return f"{modules} (CPU class {isa.describe()})"
        return modules

    def precision(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast as the trainer runs it, without its weight-cast cache (a cached copy would be
        stale after the next optimizer step, and freed memory inside a CUDA graph)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.model.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.capture_all()

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> ForwardResult:
        if self.on_cpu:
            bind_threads()  # by the thread that runs the steps: its OpenMP team is the one that works
        if self.cast is not None:
            self.cast.refresh()
        copies = self.kv_manager.take_pending_copies()
        if copies:
            self.kv_cache.copy_blocks(copies)
        if self.graphs is not None and self.is_plain_decode(seqs, num_new_tokens) \
                and (self.lora is None or all(seq.lora is None for seq in seqs)) \
                and self.graphs.fits(len(seqs), max(seq.num_tokens for seq in seqs)):
            positions = [seq.num_computed_tokens for seq in seqs]
            tables = self.kv_manager.block_table_rows([seq.seq_id for seq in seqs],
                                                      -(-(max(positions) + 1) // self.block_size))
            hidden = self.graphs.run([seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)], positions,
                                     tables)
            with self.precision():
                logits = self.project(hidden)
            return ForwardResult(logits, [(seq, p) for seq, p in zip(seqs, positions, strict=True)])
        if self.lora is not None:  # which adapter each of the step's tokens runs with
            self.lora.begin_step(seqs, num_new_tokens)
        try:
            with self.precision():
                return self.execute_eager(seqs, num_new_tokens)
        finally:
            if self.lora is not None:
                self.lora.end_step()

    @staticmethod
    def is_plain_decode(seqs: list[Sequence], num_new_tokens: list[int]) -> bool:
        """Every sequence feeds its last token and samples the next (no prompt rows)."""
        return all(n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
                   for seq, n in zip(seqs, num_new_tokens, strict=True))

    def execute_eager(self, seqs: list[Sequence], num_new_tokens: list[int]) -> ForwardResult:
        """The step's new tokens in one row. Block tables come from the KV cache manager's persistent
        table (read, not rebuilt); per sequence only its lengths and new token ids are listed."""
        device = self.model.device
        ids: list[int] = []
        rows: list[tuple[Sequence, int]] = []
        row_index: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            base = len(ids)
            if n == 1:
                ids.append(seq.token_ids[start])
            else:
                ids.extend(seq.token_ids[start:start + n])
            q_lens.append(n)
            seq_lens.append(start + n)
            if wants_prompt_logprobs(seq):
                # The row at position p predicts prompt token p + 1.
                for p in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                    rows.append((seq, p))
                    row_index.append(base + p - start)
            if start + n == len(seq.token_ids):
                rows.append((seq, start + n - 1))
                row_index.append(base + n - 1)
        seq_ids, num_blocks = [seq.seq_id for seq in seqs], -(-max(seq_lens) // self.block_size)
        invariant = getattr(getattr(self.model, "model", None), "batch_invariant", False)

        def metadata(tables: torch.Tensor) -> PagedAttention:
            # Under a trainer's autocast the decode attention stays torch's SDPA, the kernel the trainer's
            # recompute runs: the in-place kernel's float32 softmax tripled the bf16 log-prob gap of a rollout.
            return PagedAttention.from_block_tables(self.kv_cache, tables, q_lens, seq_lens, device,
                                                    impl=self.attention_impl, read_in_place=self.autocast_dtype is None,
                                                    rows=invariant, prefill_rows=self.prefill_rows,
                                                    queries=self.autocast_dtype or self.model.dtype)

        groups = getattr(self.kv_manager, "layer_groups", None)
        if groups is None:
            meta = metadata(self.kv_manager.block_table_rows(seq_ids, num_blocks))
        else:  # each group of layers its own tables (`kv_cache_groups`)
            metas = [metadata(tables) for tables in self.kv_manager.group_block_table_rows(seq_ids, num_blocks)]
            meta = dataclasses.replace(metas[0], layer_metas=tuple(metas[g] for g in groups.group_of_layer))
        meta.windows = self.windows
        input_ids = long_tensor(ids).to(device)[None]
        if self.program is not None and meta.in_place and not invariant and self.lora is None:
            return self.result(self.program.run(input_ids[0], meta), row_index, rows,
                               self.project if self.program.float32 else self.program.logits)
        with routed_step(len(ids), (self.cpu_routes or self.twin_products or self.float_routes) and not invariant,
                         self.packed, products_only=not self.cpu_routes, float32=self.float_routes):
            return self.result(self.model(input_ids, meta.positions[None], meta)[0], row_index, rows, self.project)

    def result(self, hidden: torch.Tensor, row_index: list[int], rows: list[tuple[Sequence, int]],
               project: Callable[[torch.Tensor], torch.Tensor]) -> ForwardResult:
        """The logits of the rows that are sampled or scored, from the step's hidden states."""
        if not row_index:
            return ForwardResult(hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32), [])
        picked = hidden if len(row_index) == hidden.shape[0] else hidden[torch.tensor(row_index, device=hidden.device)]
        return ForwardResult(project(picked), rows)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `logits(hidden)`. For a plain float32 `CausalLM` head the same product is
        written into a buffer kept across steps: a fresh [rows, vocab] tensor (50 MB at 256 rows of
        SmolLM2's vocabulary) is mapped anew on every step by the C allocator, and its page faults
        cost a CPU about a fifth of the projection itself. The result is valid until the next step."""
        head = getattr(self.model, "lm_head", None)
        plain = (getattr(self.model.config, "gemma", None) is None  # (Gemma 2 soft-caps its logits)
                 and type(self.model).logits is CausalLM.logits and isinstance(head, torch.nn.Linear)
                 and head.bias is None and head.weight.dtype == torch.float32 and hidden.dtype == torch.float32
                 and hidden.dim() == 2 and hidden.device.type == "cpu" and self.autocast_dtype is None
                 and not self.model.model.batch_invariant)
        if not plain:
            if (type(head) is GGUFLinear and self.float_routes and type(self.model).logits is CausalLM.logits
                    and not self.model.model.batch_invariant):
                logits = head.rows_product(hidden)  # the product its float32 step route computes
                rules = getattr(self.model.config, "gemma", None)
                return soft_cap(logits, rules.final_logit_softcapping) if rules is not None else logits
            return self.model.logits(hidden)
        if self.float_routes:
            few = float_rows(hidden, head.weight, None)
            if few is not None:
                return few
        rows, vocab = hidden.shape[0], head.weight.shape[0]
        if self._logits is None or self._logits.shape[0] < rows or self._logits.shape[1] != vocab:
            self._logits = None
            self._logits = torch.empty(rows, vocab, dtype=torch.float32, device=hidden.device)
        out = self._logits[:rows]
        return torch.mm(hidden, head.weight.t(), out=out)

"""The engine: requests in, one scheduled forward pass per `step()`, tokens out.

It owns the KV cache, the cache manager, the scheduler and the runner, and it can be built on a model
that training owns (same parameter tensors, no copy): `bump_weight_version()` after an optimizer step
makes every prefix hash computed under the old weights unreachable.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from math import isfinite
from typing import Any

import torch

from pagedrl.engine.engine_config import EngineConfig
from pagedrl.engine.engine_stats import EngineStats, engine_stats, model_bytes
from pagedrl.engine.grammar import GrammarCompiler, StepBitmasks
from pagedrl.engine.kv_cache import num_blocks_for_budget
from pagedrl.engine.kv_cache_groups import cache_and_manager, describe
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.model_runner import ModelRunner
from pagedrl.engine.multi_lora import LoRASlots
from pagedrl.engine.output_processor import logits_error, logprob_entry, make_output, record_prompt_logprob
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.request_checks import check_fits, check_logprobs, check_num_seqs, encode_prompt, salt_key
from pagedrl.engine.sampler import Sampler, SamplingRow
from pagedrl.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedrl.engine.scheduler import Scheduler
from pagedrl.engine.sequence import Request, Sequence
from pagedrl.engine.stop_checker import check_stop
from pagedrl.engine.token_choices import TokenChoices
from pagedrl.model import batch_invariant
from pagedrl.model.decoder import CausalLM

logger = logging.getLogger(__name__)
# Called after each step with the engine and that step's outputs (`LLMEngine.add_step_observer`).
StepObserver = Callable[["LLMEngine", list[RequestOutput]], None]


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer: Any = None, config: EngineConfig | None = None,
                 eos_token_ids: list[int] | None = None) -> None:
        self.config = config or EngineConfig()
        self.config.validate()
        self.model = model
        self.tokenizer = tokenizer
        if self.config.batch_invariant:
            batch_invariant.require(model)  # before the runner makes its bf16 twin of the module
        cfg = model.config
        self.max_model_len = self.config.context_length(cfg.max_model_len)
        bs = self.config.block_size
        # The cache holds keys and values in the dtype the model computes them in, or in kv_cache_dtype.
        kv_dtype = self.config.cache_dtype(self.config.autocast_dtype or model.dtype)
        num_blocks = num_blocks_for_budget(cfg, bs, model.device, kv_dtype, tokens=self.config.kv_cache_tokens,
                                           nbytes=self.config.kv_cache_bytes,
                                           gpu_memory_utilization=self.config.gpu_memory_utilization)
        self.kv_cache, self.kv_manager = cache_and_manager(cfg, num_blocks, bs, kv_dtype, model.device,
                                                           self.config.enable_prefix_caching,
                                                           not self.config.disable_hybrid_kv_cache_manager)
        c = self.config
        self.scheduler = Scheduler(self.kv_manager, c.max_num_seqs, c.max_num_batched_tokens,
                                   c.enable_chunked_prefill, max_loras=c.max_loras if c.enable_lora else None)
        self.runner = ModelRunner(model, self.kv_cache, self.kv_manager, bs, c.attention_impl,
                                  enforce_eager=c.enforce_eager, autocast_dtype=c.autocast_dtype,
                                  max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len,
                                  cast_weights=c.cast_weights)
        # Adapters per request: the projections of the model the runner runs become slotted ones.
        self.lora = LoRASlots(self.runner.model, c.max_loras, c.max_lora_rank, c.max_cpu_loras) \
            if c.enable_lora else None
        self.runner.lora = self.lora
        self.weight_bytes = model_bytes(model)
        self.sampler = Sampler(torch.Generator(device=model.device).manual_seed(self.config.seed))
        tokenizer_eos = {getattr(tokenizer, "eos_token_id", None)} - {None}
        self.eos_token_ids = sorted(set(eos_token_ids or []) | set(cfg.eos_token_ids) | tokenizer_eos)
        self.token_choices = TokenChoices(cfg.vocab_size, tokenizer, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.num_steps = 0
        self.num_forked_blocks = 0  # prompt blocks shared by n > 1 samples instead of recomputed
        self._grammars: GrammarCompiler | None = None  # built by the first structured-output request
        self._bitmasks: StepBitmasks | None = None  # grammar masks of one step, in a buffer kept
        self._step_observers: list[StepObserver] = []
        self.runner.capture_graphs()  # on CUDA unless enforce_eager: decode graphs recorded at start-up

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    lora_request: LoRARequest | None = None, cache_salt: str | None = None) -> str:
        """Validate and queue a request (on the base model or the adapter of `lora_request`, its prefix-cache
        blocks apart from other `cache_salt`s', as vLLM's); a bad one raises ValueError and changes nothing."""
        params = params or SamplingParams()
        self.wake_up()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text = prompt if isinstance(prompt, str) else None
        ids, salt = self.encode(prompt, params), salt_key(cache_salt)
        self.check_fits(len(ids), params)
        self.token_choices.check(params)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request: this engine was built without enable_lora=True")
            self.lora.prepare(lora_request)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler().matcher(params.structured_outputs)
        now = time.monotonic()
        req = Request(request_id, text, ids, params, now)
        seq = Sequence(request_id, 0, ids, params, self.make_generator(params.seed, 0), now)
        seq.grammar = grammar
        seq.lora, seq.request_salt = lora_request, salt
        seq.detokenizer = self.new_detokenizer(params, ids)
        seq.seats = params.n
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return request_id

    def encode(self, prompt: str | list[int], params: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids, checked against the vocabulary, and only the last `truncate_prompt_tokens`
        of them (-1: as many as the context holds) when the request asks (`request_checks.encode_prompt`)."""
        keep = None if params is None else params.truncate_prompt_tokens
        return encode_prompt(prompt, self.tokenizer, self.vocab_size, self.max_model_len if keep == -1 else keep)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """ValueError unless the request fits one step, the context and the KV cache (and max_logprobs)."""
        check_num_seqs(params, self.config.max_num_seqs)
        check_logprobs(params, self.config.max_logprobs)
        check_fits(num_prompt_tokens, params, self.max_model_len, self.kv_manager, self.block_size,
                   self.config.max_num_batched_tokens)

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler for structured outputs (its tokenizer tables are built once)."""
        if self._grammars is None:
            if self.tokenizer is None or not hasattr(self.tokenizer, "backend"):
                raise ValueError("structured_outputs needs the model's tokenizer (tokenizer.json)")
            self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.vocab_size, self.eos_token_ids)
        return self._grammars

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError naming the field (`structured_outputs.json`, ...) when the constraint does not
        compile; cheap after the first time, since compiled constraints are cached."""
        if params.structured_outputs is not None:
            self.grammar_compiler().check(params.structured_outputs)

    def make_generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        # torch takes 64-bit seeds; sample i's seed wraps around like the generator's own arithmetic
        return torch.Generator(device=self.model.device).manual_seed((seed + 1_000_003 * index) % 2**64)

    def new_detokenizer(self, params: SamplingParams, prompt_ids: list[int]) -> Any:
        if self.tokenizer is not None and params.detokenize:
            return self.tokenizer.detokenizer(prompt_ids, skip_special_tokens=params.skip_special_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; returns False if it was not live."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample; return the requests whose state changed (in
        batch order): every request that streams (CUMULATIVE, DELTA) and every one that finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.num_steps += 1
        result = self.runner.execute(batch.seqs, batch.num_new_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        every_row_once = True  # each logits row sampled once, in order: no [S, V] copy to make
        for r, (seq, pos) in enumerate(result.rows):
            if pos == len(seq.token_ids) - 1:
                if seq.params.n == 1:
                    sample_rows.append(r)
                    sample_seqs.append(seq)
                    continue
                children = self.fork_if_needed(seq)
                every_row_once = every_row_once and len(children) == 1
                for child in children:
                    sample_rows.append(r)
                    sample_seqs.append(child)
            else:
                every_row_once = False
                record_prompt_logprob(seq, pos, result.logits[r], self.decode_one)
        if sample_seqs:
            logits = result.logits
            if not every_row_once:
                logits = logits[torch.tensor(sample_rows, device=logits.device)]
            self.sample_and_append(logits, sample_seqs)
        final_only = RequestOutputKind.FINAL_ONLY
        touched = dict.fromkeys(seq.request_id for seq in batch.seqs
                                if seq.params.output_kind is not final_only or seq.is_finished)
        outputs = []
        for rid in touched:
            req = self.requests.get(rid)
            if req is None:
                continue
            out = make_output(req)
            if out is not None:
                outputs.append(out)
            if out.finished if out is not None else req.is_finished:
                del self.requests[rid]
        for observe in self._step_observers:
            observe(self, outputs)
        return outputs

    def add_step_observer(self, observe: StepObserver) -> Callable[[], None]:
        """Call `observe(engine, outputs)` after every step that ran a batch, before `step()` returns,
        so a caller can sample the cache (`block_tables()`, `stats()`) while `LLM.generate` drives the
        steps, without wrapping the engine's methods. Returns the function that removes it again."""
        self._step_observers.append(observe)
        return lambda: self._step_observers.remove(observe)

    def fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        """The first time a request's prompt is in, it becomes `n` sequences sharing its blocks."""
        req = self.requests[seq.request_id]
        if req.forked or req.params.n == 1:
            req.forked = True
            return [seq]
        req.forked = True
        seq.seats = 1
        for i in range(1, req.params.n):
            child = Sequence(req.request_id, i, req.prompt_token_ids, req.params,
                             self.make_generator(req.params.seed, i), req.arrival)
            child.num_computed_tokens = seq.num_computed_tokens
            child.detokenizer = self.new_detokenizer(req.params, req.prompt_token_ids)
            child.prompt_logprobs = seq.prompt_logprobs
            child.block_hashes = list(seq.block_hashes)
            child.grammar = seq.grammar.copy() if seq.grammar is not None else None
            child.lora, child.request_salt = seq.lora, seq.request_salt
            self.kv_manager.fork(seq.seq_id, child.seq_id)
            self.num_forked_blocks += len(self.kv_manager.block_table(seq.seq_id))
            self.scheduler.add_running(child)
            req.seqs.append(child)
        return list(req.seqs)

    def sample_and_append(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        masks: list[torch.Tensor | None] = [None] * len(seqs)
        if self._grammars is not None and any(s.grammar is not None for s in seqs):
            if self._bitmasks is None:
                self._bitmasks = StepBitmasks(self.vocab_size)
            masks, failed = self._bitmasks.fill([s.grammar for s in seqs])
            if failed:
                for i, reason in failed.items():
                    logger.warning("request %s ended: %s", seqs[i].request_id, reason)
                    self.finish(seqs[i], "abort")
                keep = [i for i in range(len(seqs)) if i not in failed]
                if not keep:  # (an empty index list would be a float tensor, not an index)
                    return
                logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
                seqs, masks = [seqs[i] for i in keep], [masks[i] for i in keep]
        rows = [s.sampling_row or self.sampling_row(s, masks[i]) for i, s in enumerate(seqs)]
        out = self.sampler(logits, rows)
        now = time.monotonic()
        # One copy to the host for the step's tokens and both log-probs (one synchronisation on a GPU);
        # float64 holds the ids and the float32 log-probs exactly.
        host = torch.stack((out.token_ids.double(), out.raw_logprobs.double(), out.processed_logprobs.double())).cpu()
        tokens, raw, processed = host[0].long().tolist(), host[1].tolist(), host[2].tolist()
        for i, seq in enumerate(seqs):
            token = tokens[i]
            if not (isfinite(raw[i]) and isfinite(processed[i])):  # finish_reason "error"; the batch goes on
                seq.error = logits_error(seq, isfinite(raw[i]))
                logger.warning("request %s ended: %s", seq.request_id, seq.error)
                self.finish(seq, "error")
                continue
            entry = None
            if seq.params.num_logprobs is not None:
                chosen = processed[i] if seq.params.logprobs_mode == "processed_logprobs" else raw[i]
                entry = logprob_entry(token, chosen, out.top_logprobs[i], self.decode_one if seq.params.detokenize
                                      else None, *out.ranks_of(i))
            seq.append(token, processed[i], raw[i], entry)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            if seq.first_token_time is None:  # its prompt is in: counted now, per sample, as vLLM counts it
                seq.first_token_time = now
                self.prompt_tokens += seq.num_prompt_tokens
            stop = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
            if stop is not None:
                self.finish(seq, *stop)
        self.generation_tokens += len(seqs)

    def sampling_row(self, seq: Sequence, token_bitmask: torch.Tensor | None) -> SamplingRow:
        """What the sampler needs about `seq` this step; kept on the sequence for the steps to come
        when nothing in it can change (no penalties, no grammar, no bad words, no min_tokens ban left)."""
        p = seq.params
        banned = self.token_choices.banned(p, seq.num_output_tokens, seq.output_token_ids)
        row = SamplingRow(params=p, generator=seq.generator, prompt_token_ids=seq.prompt_token_ids,
                          output_token_ids=seq.output_token_ids if p.has_penalties else (),
                          banned_token_ids=banned, token_bitmask=token_bitmask)
        if not p.has_penalties and seq.grammar is None and not banned and not p.bad_words:
            seq.sampling_row = row
        return row

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None, flush: bool = True) -> None:
        if flush and seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()
        self.scheduler.finish(seq, reason, stop_reason)

    # ------------------------------------------------------------------ outputs
    def decode_one(self, token: int) -> str | None:
        """The token's name in log-probs: its text, or `bytes:\\xNN` for part of a UTF-8 character."""
        return None if self.tokenizer is None else self.tokenizer.token_name(token)

    # ------------------------------------------------------------------ what callers may read
    @property
    def block_size(self) -> int:
        """Tokens per KV block: a prefix is shared in whole blocks of this many tokens."""
        return self.config.block_size

    @property
    def vocab_size(self) -> int:
        """Token ids run over [0, vocab_size)."""
        return self.model.config.vocab_size

    @property
    def lora_enabled(self) -> bool:
        """Built with `enable_lora`: requests may name adapters."""
        return self.lora is not None

    def read_lora(self, request: LoRARequest) -> object:
        """Read `request`'s adapter from disk and check it against the model and the slots (ValueError
        naming what does not fit); changes nothing, so it is safe off the engine thread."""
        if self.lora is None:
            raise ValueError("lora_request: this engine was built without enable_lora=True")
        return self.lora.read(request)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype keys and values are cached in (`kv_cache_dtype`), for a start-up line's bytes a token."""
        return self.kv_cache.dtype

    def kv_layout(self) -> str:
        """The KV cache's blocks, for a start-up line (`kv_cache_groups.describe`)."""
        return describe(self.kv_manager, self.block_size, self.kv_cache.dtype)

    def decode_path(self) -> str:
        """How steps that only decode run (CUDA graphs, the CPU kernels' program, the modules), for a
        start-up line."""
        return self.runner.decode_path()

    def block_tables(self) -> list[tuple[Sequence, list[int]]]:
        """Each running sequence that holds blocks, with a copy of its block table: a picture of how
        the requests share the KV cache (the demo draws one)."""
        return [(seq, list(self.kv_manager.block_table(seq.seq_id))) for seq in list(self.scheduler.running)
                if seq.seq_id in self.kv_manager]

    def reseed(self, seed: int) -> None:
        """Restart the random stream of requests without a seed of their own (a trainer does this
        per rollout, so a resumed run draws what an uninterrupted one would)."""
        self.sampler.reseed(seed)

    # ------------------------------------------------------------------ weights and stats
    def sleep(self) -> None:
        """Free the KV cache memory while no request runs (the optimizer needs it more); the next
        request allocates it again. Cached prefixes are forgotten, since their KV is gone."""
        if self.has_unfinished_requests():
            raise RuntimeError("sleep: requests are still running; finish or abort them first")
        self.kv_manager.reset_prefix_cache()
        if self.runner.graphs is not None:
            self.runner.graphs.drop()  # they read the cache's memory; recorded again after wake-up
        self.kv_cache.release()

    def wake_up(self) -> None:
        self.kv_cache.allocate()

    def bump_weight_version(self) -> int:
        """Record a weight update: prefix KV computed under the old weights is never reused, and the
        runner's packed copies of the weights are made again."""
        if self.runner.packed is not None:
            self.runner.packed.clear()
        return self.kv_manager.bump_weight_version()

    def metrics_snapshot(self) -> EngineStats:
        """The engine's numbers and its adapters' residency now (readable from another thread while
        requests run: plain ints and copied lists, no locks)."""
        return engine_stats(self)

    def stats(self) -> dict[str, float]:
        """The numbers of `metrics_snapshot()` by name, without the adapters."""
        return engine_stats(self, with_lora=False).counters()

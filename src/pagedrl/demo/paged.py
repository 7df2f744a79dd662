"""Paged attention, measured: the same requests through pagedrl's engine and through transformers'
static batching, the KV slots each holds for live tokens, and blocks with and without prefix
sharing. `bench/bench_engine.py` and `pagedrl demo` both measure with these functions.

The static baseline is the usual one: requests in order, each batch left-padded to its longest
prompt and run to its longest output (`min_new_tokens = max_new_tokens`, so EOS cannot end it
early), a finished row held to the end. An n-sample request is n rows there: static batching has
no fork, so each sample holds its own copy of the prompt.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedrl.engine.llm import LLM
from pagedrl.engine.llm_engine import LLMEngine
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.sampling_params import SamplingParams


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    n: int = 1  # samples drawn from this prompt (pagedrl forks its blocks; static batches repeat it)


def make_workload(num_requests: int, scale: float, vocab: int, seed: int = 0) -> list[Request]:
    """Prompt lengths 16-512 and output lengths 16-256 (times `scale`), random token ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt_len = max(1, round(rng.randint(16, 512) * scale))
        max_tokens = max(1, round(rng.randint(16, 256) * scale))
        out.append(Request([rng.randrange(16, vocab) for _ in range(prompt_len)], max_tokens))
    return out


def expand(workload: list[Request]) -> list[Request]:
    """One request per sample: what static batching runs."""
    return [Request(r.prompt, r.max_tokens) for r in workload for _ in range(r.n)]


def fit_tokens(workload: list[Request], block_size: int) -> int:
    """A KV budget that holds every request at once without sharing (what a GPU's memory would give)."""
    return sum(r.n * math.ceil((len(r.prompt) + r.max_tokens) / block_size) * block_size for r in workload)


@dataclass
class SeqBlocks:
    """One running sequence at the moment of a KV snapshot."""

    request: int  # index of its request in the workload
    sample: int  # which of the request's n samples
    blocks: list[int]  # its block table: physical block ids
    live_tokens: int  # tokens whose keys and values are in those blocks
    reserved_tokens: int  # what a contiguous allocator reserves up front: prompt + max_tokens
    prompt_tokens: int


@dataclass
class KVSnapshot:
    step: int
    block_size: int
    num_blocks: int
    blocks_used: int
    seqs: list[SeqBlocks]

    @property
    def shared_blocks(self) -> set[int]:
        """Physical blocks in more than one block table (a forked or cached prefix)."""
        seen: dict[int, int] = {}
        for s in self.seqs:
            for b in s.blocks:
                seen[b] = seen.get(b, 0) + 1
        return {b for b, k in seen.items() if k > 1}


@dataclass
class Run:
    seconds: float
    prompt_tokens: int
    output_tokens: int
    outputs: list[list[int]]
    kv_live: list[int] = field(default_factory=list)  # per step: distinct tokens with KV in the cache
    kv_slots: list[int] = field(default_factory=list)  # per step: slots of the blocks held
    snapshot: KVSnapshot | None = None  # the KV cache at the step that held the most blocks

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def kv_utilisation(self) -> float:
        """Live tokens over allocated slots, summed over every step (a time average)."""
        return sum(self.kv_live) / max(1, sum(self.kv_slots))


def _live_per_block(engine: Any) -> tuple[int, list[tuple[Any, list[int]]]]:
    """Distinct live tokens in the blocks the running sequences hold (a shared block counts once),
    and each sequence's block table."""
    block_size = engine.block_size
    filled: dict[int, int] = {}
    tables = engine.block_tables()
    for seq, table in tables:
        for i, b in enumerate(table):
            filled[b] = max(filled.get(b, 0), min(block_size, seq.num_computed_tokens - i * block_size))
    return sum(max(0, v) for v in filled.values()), tables


def run_pagedrl(llm: LLM, workload: list[Request], seed: int = 0) -> Run:
    """`LLM.generate` over the workload (greedy; an n-sample request samples at temperature 1);
    a step observer samples the KV cache's occupancy after each step and keeps a snapshot of its
    fullest step."""
    engine = llm.engine
    block_size = engine.block_size
    run = Run(0.0, 0, 0, [])
    owners: list[str] = []  # the snapshot's sequences' request ids, made workload indices at the end

    def sample(engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        live, tables = _live_per_block(engine)
        stats = engine.stats()
        used = stats["num_blocks_used"]
        run.kv_live.append(live)
        run.kv_slots.append(used * block_size)
        if run.snapshot is None or used > run.snapshot.blocks_used:
            owners[:] = [seq.request_id for seq, _ in tables]
            run.snapshot = KVSnapshot(len(run.kv_live), block_size, stats["num_blocks_total"], used, [
                SeqBlocks(-1, seq.index, list(table), seq.num_computed_tokens,
                          seq.num_prompt_tokens + seq.params.max_tokens, seq.num_prompt_tokens)
                for seq, table in tables])

    params = [SamplingParams(n=r.n, temperature=1.0 if r.n > 1 else 0.0, seed=seed, max_tokens=r.max_tokens,
                             ignore_eos=True) for r in workload]
    stop_observing = engine.add_step_observer(sample)
    try:
        start = time.perf_counter()
        outs = llm.generate([r.prompt for r in workload], params, use_tqdm=False)
        run.seconds = time.perf_counter() - start
    finally:
        stop_observing()
    request_of = {o.request_id: i for i, o in enumerate(outs)}  # generate answers in workload order
    if run.snapshot is not None:
        for s, rid in zip(run.snapshot.seqs, owners, strict=True):
            s.request = request_of.get(rid, -1)
    run.outputs = [list(c.token_ids) for o in outs for c in o.outputs]
    assert all(len(c.token_ids) == r.max_tokens for o, r in zip(outs, workload, strict=True) for c in o.outputs), \
        "ignore_eos must hold"
    run.prompt_tokens = sum(r.n * len(r.prompt) for r in workload)
    run.output_tokens = sum(len(t) for t in run.outputs)
    return run


def run_transformers(model: Any, workload: list[Request], batch_size: int, pad_token_id: int) -> tuple[Run, float]:
    """Static batches in request order (n-sample requests expanded), left-padded, each run to its
    longest output. Also returns the share of the KV rows those batches held that were live tokens
    of a request (the same time average as `Run.kv_utilisation`)."""
    workload = expand(workload)
    live_total = slots_total = 0
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        width = max(len(r.prompt) for r in batch)
        new = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad_token_id)
        assert gen.shape[1] == width + new, "min_new_tokens must hold the batch to its longest output"
        outputs += [gen[i, width:width + r.max_tokens].tolist() for i, r in enumerate(batch)]
        # Decode step t (0-based) holds width + t cached rows per sequence, of which a request's own
        # prompt and its first min(t, max_tokens) outputs are live.
        for t in range(new):
            slots_total += len(batch) * (width + t)
            live_total += sum(len(r.prompt) + min(t, r.max_tokens) for r in batch)
    seconds = time.perf_counter() - start
    run = Run(seconds, sum(len(r.prompt) for r in workload), sum(r.max_tokens for r in workload), outputs)
    return run, live_total / slots_total


def load_transformers_model(path: Any, dtype: torch.dtype = torch.float32) -> tuple[Any, int]:
    """The same weights in transformers (in pagedrl's precision, eval mode) and the pad id its
    `generate` needs."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    pad = hf.generation_config.pad_token_id
    if pad is None:
        pad = hf.generation_config.eos_token_id
    pad = 0 if pad is None else int(pad if isinstance(pad, int) else pad[0])
    return hf, pad


def peak_blocks(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> int:
    """Most blocks held by live requests at the end of any step while `prompts` run."""
    engine = llm.engine
    peak = 0
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats()["num_blocks_used"])
    assert not engine.has_unfinished_requests(), ids
    return peak


@dataclass
class PrefixSharing:
    prompt_tokens: int
    n: int
    max_tokens: int
    block_size: int
    shared: int  # peak blocks: one request with n samples (the prompt's blocks forked)
    unshared: int  # peak blocks: n separate requests, prefix caching off
    ideal: int  # the prompt's full blocks once + each completion's own blocks


def prefix_sharing(model: Any, tokenizer: Any, prompt: list[int], n: int, max_tokens: int,
                   block_size: int = 16) -> PrefixSharing:
    """Peak blocks of n samples from one prompt, with the prompt's blocks shared and without."""
    shared_llm = LLM.from_module(model, tokenizer, block_size=block_size,
                                 kv_cache_tokens=n * (len(prompt) + max_tokens + block_size))
    sampled = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    got = peak_blocks(shared_llm, [prompt], sampled)
    del shared_llm
    separate = LLM.from_module(model, tokenizer, block_size=block_size, enable_prefix_caching=False,
                               kv_cache_tokens=n * (len(prompt) + max_tokens + block_size))
    single = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    unshared = peak_blocks(separate, [prompt] * n, single)
    del separate
    # The last sampled token is never fed back, so a completion's KV holds max_tokens - 1 tokens.
    kv_tokens = len(prompt) + max_tokens - 1
    prompt_blocks = len(prompt) // block_size  # full prompt blocks shared; a partial one is per sample
    ideal = prompt_blocks + n * (math.ceil(kv_tokens / block_size) - prompt_blocks)
    return PrefixSharing(len(prompt), n, max_tokens, block_size, got, unshared, ideal)
